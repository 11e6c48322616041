"""torch's own distributed test suite against the backend, on an embedded switch (``tests/torch_suite.py``).

Each world size and pass (``switchagg``: the suite as it runs for that name; ``gloo``: the shim
for the tests it gates on the name gloo) is a pytest of its own, because the suite decides its
skips when it is imported. A test that fails there fails here, with that pytest's report.

The default run (CI's) runs every test of the suite at world sizes 2, 3 and 4, about seven minutes
on two cores. ``SWITCHAGG_TORCH_SUITE=quick`` takes, at world size 2 only, the suite's tests of the
calls the backend itself handles (all-reduce in every form, reduce-scatter, all-gather, broadcast,
barrier, DDP): about a minute, for a quick look while working.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests import test_distributed

switch = test_distributed.switch  # the embedded switch, and the variables that point the ranks at it

FULL = os.environ.get("SWITCHAGG_TORCH_SUITE") != "quick"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier_full_group", "barrier_timeout",
           "DistributedDataParallel", "ddp_", "accumulate_gradients", "get_future")


def _counts(xml: Path) -> dict[str, int]:
    """What the suite's pytest did, from its JUnit report."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
    for case in ET.parse(xml).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif (skipped := case.find("skipped")) is not None:
            counts["xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


@pytest.mark.parametrize("as_", ["switchagg", "gloo"])
@pytest.mark.parametrize("world", (2, 3, 4) if FULL else (2,))
def test_torch_s_distributed_suite_passes_on_switchagg(switch, world, as_, tmp_path):
    sw, env = switch
    xml = tmp_path / "suite.xml"
    select = [] if FULL else ["-k", " or ".join(DEFAULT)]
    run_env = {**os.environ, **env, "WORLD_SIZE": str(world), "TEMP_DIR": str(tmp_path),
               "SWITCHAGG_TORCH_SUITE_AS": as_,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.torch_suite",
         f"--junitxml={xml}", str(ROOT / "tests" / "torch_suite.py"), *select],
        env=run_env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    counts = _counts(xml)
    print(f"torch's suite, world size {world}, {as_} pass: {counts}")
    assert done.returncode == 0 and counts["failed"] == 0, done.stdout[-20000:] + done.stderr[-5000:]
    assert counts["passed"] > 0, done.stdout[-5000:]
    assert sw.jobs() == {}, "every group the suite made was removed from the switch"
