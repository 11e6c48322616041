"""Compile ``p4/tna`` with the open Tofino compiler (p4c's ``backends/tofino``: ``bf-p4c``), and read
its resource report.

The compiler writes, under the output folder: ``bfrt.json`` (the control plane's names),
``switchagg.conf`` (what bf_switchd loads), ``manifest.json``, and per pipe ``pipe/tofino.bin`` (or
``tofino2.bin``), ``pipe/context.json`` and ``pipe/logs/`` with ``metrics.json`` and
``resources.json``, from which :func:`resources` prints what matters for switchagg: stages, SRAM,
TCAM, stateful ALUs and PHV.
"""

from __future__ import annotations

import enum
import json
import subprocess
from pathlib import Path

from ..errors import SwitchAggError
from .p4c import P4_DIR, find_tool, source_digest

MAIN = P4_DIR / "tna" / "main.p4"
PROGRAM = "switchagg"  # the program's name in bfrt.json and bf_switchd's configuration
TOOL_DIRS = ("/opt/tofino/bin",)


class Chip(enum.Enum):
    """A Tofino generation: its compiler target and architecture, stages, and recirculation port of pipe 0."""

    TOFINO = ("tofino", "tna", 12, 68)
    TOFINO2 = ("tofino2", "t2na", 20, 6)

    def __init__(self, target: str, arch: str, stages: int, recirculation_port: int) -> None:
        self.target, self.arch, self.stages, self.recirculation_port = target, arch, stages, recirculation_port


def compiler() -> str:
    """The bf-p4c driver, or an error that says how to install it."""
    found = find_tool("bf-p4c", TOOL_DIRS)
    if found is None:
        raise SwitchAggError("bf-p4c, the open Tofino compiler, was not found (PATH, /opt/tofino/bin): build p4c's "
                             "backends/tofino as the README's Tofino section says")
    return found


def build(chip: Chip, out_dir: Path) -> dict[str, Path]:
    """Compile ``p4/tna/main.p4`` for ``chip`` into ``out_dir`` (skipped when sources and compiler did not change)."""
    if not MAIN.exists():
        raise SwitchAggError(f"the P4 sources are not at {MAIN.parent}: build from a checkout of switchagg")
    bf_p4c = compiler()
    out = Path(out_dir)
    made = {"BfRt schema": out / "bfrt.json", "context": out / "pipe" / "context.json",
            "binary": out / "pipe" / f"{chip.target}.bin", "bf_switchd conf": out / f"{PROGRAM}.conf"}
    stamp = out / "sources.sha256"
    digest = f"{source_digest()} {chip.target} {bf_p4c}"
    if all(p.exists() for p in made.values()) and stamp.exists() and stamp.read_text() == digest:
        return made
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([bf_p4c, "--target", chip.target, "--arch", chip.arch, "--program-name", PROGRAM,
                           "-o", str(out), str(MAIN)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SwitchAggError(f"bf-p4c failed on {MAIN} for {chip.target}:\n{(proc.stderr or proc.stdout).strip()}")
    missing = [str(p) for p in made.values() if not p.exists()]
    if missing:
        raise SwitchAggError(f"bf-p4c succeeded but did not write {', '.join(missing)}: is it the open Tofino "
                             "compiler with its assembler (bfas)?")
    stamp.write_text(digest)
    return made


def _logs(out_dir: Path) -> Path:
    logs = Path(out_dir) / "pipe" / "logs"
    if not (logs / "metrics.json").exists():
        raise SwitchAggError(f"no resource report in {logs}: build first (`switchagg build-p4 --target ...`)")
    return logs


def stages_used(out_dir: Path) -> dict[str, int]:
    """MAU stages each gress uses, from the compiler's resources.json."""
    report = json.loads((_logs(out_dir) / "resources.json").read_text())["resources"]["mau"]
    used: dict[str, set[int]] = {}
    for stage in report["mau_stages"]:
        for table in stage.get("logical_tables", []):
            used.setdefault(table.get("gress", "ingress"), set()).add(stage["stage_number"])
    return {gress: len(stages) for gress, stages in used.items()}


def resources(chip: Chip, out_dir: Path) -> str:
    """The compiler's resource report of a build in ``out_dir``, as lines a person reads."""
    logs = _logs(out_dir)
    metrics = json.loads((logs / "metrics.json").read_text())
    mau = metrics["mau"]
    report = json.loads((logs / "resources.json").read_text())["resources"]["mau"]
    stages = report["mau_stages"]
    used = [s for s in stages if s.get("logical_tables")]
    salus = sum(len(s.get("meter_alus", {}).get("meters", [])) for s in stages)
    lines = [f"{chip.target}: {len(used)} of {chip.stages} MAU stages used "
             f"({', '.join(f'{g} {n}' for g, n in sorted(stages_used(out_dir).items()))})",
             f"  SRAM blocks {mau['srams']}, TCAM blocks {mau['tcams']}, map RAMs {mau['map_rams']}, "
             f"logical tables {mau['logical_tables']}",
             f"  stateful ALUs {salus}"]
    for kind in ("normal", "tagalong", "mocha", "dark"):
        for c in metrics["phv"].get(kind, []):
            lines.append(f"  PHV {kind} {c['bit_width']}-bit: {c['containers_occupied']} containers, "
                         f"{c['bits_occupied']} bits occupied")
    return "\n".join(lines)
