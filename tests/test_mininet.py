"""The mininet topologies: BMv2 with two hosts, and a tree of three BMv2s; a checking worker on each host."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bmv2_env.testbed import missing_prerequisites
from switchagg.targets.p4c import build

from .conftest import need

pytestmark = pytest.mark.bmv2
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def topology():
    """Runs ``bmv2_env/mininet_topo.py`` with the given arguments (Debian's python3, the program compiled)."""
    need("bmv2", missing_prerequisites())
    probe = subprocess.run(["/usr/bin/python3", "-c", "import mininet.net"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("Debian's mininet is not installed (apt-get install mininet)")
    build(ROOT / "build" / "bmv2")

    def run(*args: str) -> str:
        out = subprocess.run(["/usr/bin/python3", str(ROOT / "bmv2_env" / "mininet_topo.py"), *args, "--run"],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out.stdout
    return run


def test_mininet_topology_runs_an_allreduce(topology):
    assert topology("--workers", "2").count("within the bound") == 6  # 3 rounds on each of the 2 hosts


def test_mininet_tree_of_three_bmv2_switches_runs_an_allreduce(topology):
    """--tree 2x2: a spine over two leaf BMv2s, one tree file deployed on all three, each host's worker checking
    every sum of the four."""
    assert topology("--tree", "2x2").count("within the bound") == 12  # 3 rounds on each of the 4 hosts
