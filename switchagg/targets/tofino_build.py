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
    """A Tofino generation: its compiler target and architecture, stages, recirculation port of pipe 0, and
    whether its program serves trees (``SA_TREES``: a level of a tree takes two stages more than Tofino 1's
    twelve, docs/tofino.md)."""

    TOFINO = ("tofino", "tna", 12, 68, False)
    TOFINO2 = ("tofino2", "t2na", 20, 6, True)

    def __init__(self, target: str, arch: str, stages: int, recirculation_port: int, trees: bool) -> None:
        self.target, self.arch, self.stages, self.recirculation_port = target, arch, stages, recirculation_port
        self.trees = trees

    def defines(self) -> list[str]:
        """The preprocessor definitions ``p4/tna`` is compiled with for this chip."""
        return ["-DSA_TREES"] if self.trees else []


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
    # Absolute, because the compiler writes the paths it was given into switchagg.conf, and
    # bf_switchd resolves relative ones under $SDE_INSTALL, not where the build is.
    out = Path(out_dir).resolve()
    made = {"BfRt schema": out / "bfrt.json", "context": out / "pipe" / "context.json",
            "binary": out / "pipe" / f"{chip.target}.bin", "bf_switchd conf": out / f"{PROGRAM}.conf"}
    stamp = out / "sources.sha256"
    digest = f"{source_digest()} {chip.target} {' '.join(chip.defines())} {bf_p4c}"
    if all(p.exists() for p in made.values()) and stamp.exists() and stamp.read_text() == digest:
        return made
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([bf_p4c, "-g", "--target", chip.target, "--arch", chip.arch, *chip.defines(),
                           "--program-name", PROGRAM, "-o", str(out), str(MAIN)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SwitchAggError(f"bf-p4c failed on {MAIN} for {chip.target}:\n{(proc.stderr or proc.stdout).strip()}")
    if not made["bf_switchd conf"].exists():  # the open driver does not run p4c-gen-conf itself
        _gen_conf(chip, out)
    missing = [str(p) for p in made.values() if not p.exists()]
    if missing:
        raise SwitchAggError(f"bf-p4c succeeded but did not write {', '.join(missing)}: is it the open Tofino "
                             "compiler with its assembler (bfas)?")
    stamp.write_text(digest)
    return made


def _gen_conf(chip: Chip, out: Path) -> None:
    """bf_switchd's configuration of the build in ``out``, by the compiler's own p4c-gen-conf."""
    gen = find_tool("p4c-gen-conf", TOOL_DIRS)
    if gen is None:
        raise SwitchAggError("p4c-gen-conf, which comes with bf-p4c, was not found: reinstall the Tofino compiler")
    proc = subprocess.run([gen, "--conf-type", "BF-RT", "--name", PROGRAM, "--device", chip.target, "--outputdir",
                           str(out), "--bfrt-name", str(out / "bfrt.json"), "--p4-version", "p4-16", "--pipe", "pipe"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SwitchAggError(f"p4c-gen-conf failed for {out}:\n{(proc.stderr or proc.stdout).strip()}")


def _logs(out_dir: Path) -> Path:
    logs = Path(out_dir) / "pipe" / "logs"
    if not (logs / "resources.json").exists() or not (logs / "metrics.json").exists():
        raise SwitchAggError(f"no resource report in {logs}: build first (`switchagg build-p4 --target ...`)")
    return logs


def _stages(out_dir: Path) -> list[dict]:
    return json.loads((_logs(out_dir) / "resources.json").read_text())["resources"]["mau"]["mau_stages"]


def stages_used(out_dir: Path) -> int:
    """MAU stages that hold a table of the program, from the compiler's resources.json."""
    return sum(1 for s in _stages(out_dir) if s["logical_tables"]["ids"])


def resources(chip: Chip, out_dir: Path) -> str:
    """The compiler's resource report of a build in ``out_dir``, as lines a person reads.

    Stages bound the program (a 13th stage does not exist on Tofino 1); stateful ALUs (4 a stage)
    bound the values summed per pass; SRAM holds the registers and exact tables, TCAM the ternary
    checks; PHV holds the headers and metadata of a packet in flight.
    """
    stages = _stages(out_dir)
    metrics = json.loads((_logs(out_dir) / "metrics.json").read_text())
    srams = sum(len(s["rams"]["srams"]) for s in stages)
    tcams = sum(len(s["tcams"]["tcams"]) for s in stages)
    salus = [len(s["meter_alus"]["meters"]) for s in stages]
    one = stages[0]  # every stage of a chip has the same blocks; the report lists only those it placed
    sram_cap = chip.stages * one["rams"]["nColumns"] * one["rams"]["nRows"]
    tcam_cap = chip.stages * one["tcams"]["nColumns"] * one["tcams"]["nRows"]
    salu_cap = chip.stages * one["meter_alus"]["nAlus"]
    lines = [f"{chip.target}: {stages_used(out_dir)} of {chip.stages} MAU stages used",
             f"  stateful ALUs  {sum(salus)} of {salu_cap} ({' '.join(map(str, salus))} by stage)",
             f"  SRAM blocks    {srams} of {sram_cap}",
             f"  TCAM blocks    {tcams} of {tcam_cap}",
             f"  logical tables {metrics['mau']['logical_tables']}, latency "
             + ", ".join(f"{g['gress']} {g['cycles']} cycles" for g in metrics["mau"]["latency"])]
    for kind, usage in metrics["phv"].items():
        lines.append(f"  PHV {kind:<8} " + ", ".join(f"{u['containers_occupied']} x {u['bit_width']}-bit"
                                                      for u in usage)
                     + f" ({sum(u['bits_occupied'] for u in usage)} bits occupied)")
    return "\n".join(lines)
