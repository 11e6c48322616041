"""torch's own distributed test suite against the backend, on an embedded switch (``tests/torch_suite.py``).

The default run takes the tests whose calls go through the switch or through the group's own
methods (collectives, DDP), at world size 2: about a minute on two cores. ``SWITCHAGG_TORCH_SUITE=full``
runs every test of the suite at world sizes 2, 3 and 4, as upstream runs it for gloo.
Each world size is a pytest of its own (the suite decides its skips when imported); a test that
fails there fails here, with pytest's report of it.
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

FULL = os.environ.get("SWITCHAGG_TORCH_SUITE") == "full"
ROOT = Path(__file__).resolve().parent.parent

# The default run: the suite's tests whose calls reach the switch (all-reduce SUM and AVG of the
# types it carries, DDP's gradients), and those that go through the group's methods to the fallback.
DEFAULT = [
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_sum_complex", "test_all_reduce_avg",
    "test_all_reduce_max", "test_all_reduce_result_cuda", "test_all_reduce_coalesced_sum",
    "test_all_reduce_full_group_sum", "test_all_reduce_group_sum", "test_reduce_scatter_tensor",
    "test_all_gather", "test_all_gather_into_tensor_ops", "test_broadcast", "test_barrier", "test_send_recv",
    "test_DistributedDataParallel", "test_ddp_comm_hook_logging", "test_accumulate_gradients_no_sync",
    "test_ddp_grad_div_uneven_inputs", "test_ddp_uneven_inputs",
]


def _counts(xml: Path) -> dict[str, int]:
    suite = ET.parse(xml).getroot().find("testsuite")
    assert suite is not None
    total, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    return {"passed": total - failed - errors - skipped, "failed": failed + errors, "skipped": skipped}


@pytest.mark.parametrize("world", (2, 3, 4) if FULL else (2,))
def test_torch_s_distributed_suite_passes_on_switchagg(switch, world, tmp_path):
    _, env = switch
    xml = tmp_path / "suite.xml"
    select = [] if FULL else ["-k", " or ".join(DEFAULT)]
    run_env = {**os.environ, **env, "WORLD_SIZE": str(world), "TEMP_DIR": str(tmp_path),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={xml}",
         str(ROOT / "tests" / "torch_suite.py"), *select],
        env=run_env, cwd=ROOT, capture_output=True, text=True, timeout=3000 if FULL else 600)
    counts = _counts(xml)
    print(f"torch's suite at world size {world}: {counts}")
    assert counts["failed"] == 0 and done.returncode == 0, done.stdout[-20000:]
    assert counts["passed"] > 0
    assert switch[0].jobs() == {}, "every group the suite made was removed from the switch"
