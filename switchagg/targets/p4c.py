"""Compile the P4 program with p4c: one command per target, outputs in a build directory."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import SwitchAggError

P4_DIR = Path(__file__).resolve().parents[2] / "p4"
MAIN = P4_DIR / "v1model" / "main.p4"
TOOL_DIRS = ("/opt/p4/bin", "/usr/local/bin", "/usr/bin")


def find_tool(name: str, dirs: tuple[str, ...] = TOOL_DIRS) -> str | None:
    """``name`` on PATH, or in ``dirs``, the usual install prefixes of a hand-built toolchain."""
    found = shutil.which(name)
    if found:
        return found
    for d in dirs:
        if os.access(Path(d) / name, os.X_OK):
            return str(Path(d) / name)
    return None


# p4c's LocalCopyPropagation copies the expression a metadata field was just given into each later
# use within the action: the tag stage then evaluated its "fresh" test three times, and a register
# write recomputed the value it writes. The program is written for the compiler without it (no
# ternaries in actions, which it would spill into temporaries); docs/protocol.md section 8.
P4C_OPTIONS = ("--excludeMidendPasses", "P4::LocalCopyPropagation")


@dataclass(frozen=True)
class Pipeline:
    """A compiled program: BMv2 JSON and P4Info (text format)."""

    json: Path
    p4info: Path


def source_digest() -> str:
    """What a build depends on: the compiler's options and every P4 source."""
    h = hashlib.sha256(" ".join(P4C_OPTIONS).encode() + b"\0")
    for path in sorted(P4_DIR.rglob("*.p4")):
        h.update(path.relative_to(P4_DIR).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def build(out_dir: str | Path = "build/bmv2") -> Pipeline:
    """Compile ``p4/v1model/main.p4`` into ``out_dir`` (skipped when sources and options did not change)."""
    if not MAIN.exists():
        raise SwitchAggError(f"the P4 sources are not at {P4_DIR}: build from a checkout of switchagg")
    compiler = find_tool("p4c-bm2-ss")
    if compiler is None:
        raise SwitchAggError("p4c-bm2-ss was not found (PATH, /opt/p4/bin): install p4c as the README says")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipeline = Pipeline(out / "switchagg.json", out / "switchagg.p4info.txtpb")
    stamp = out / "sources.sha256"
    digest = source_digest()
    if pipeline.json.exists() and pipeline.p4info.exists() and stamp.exists() and stamp.read_text() == digest:
        return pipeline
    proc = subprocess.run([compiler, *P4C_OPTIONS, "--p4runtime-files", str(pipeline.p4info), "-o", str(pipeline.json),
                           str(MAIN)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SwitchAggError(f"p4c-bm2-ss failed on {MAIN}:\n{proc.stderr.strip()}")
    stamp.write_text(digest)
    return pipeline
