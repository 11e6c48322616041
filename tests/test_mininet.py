"""The mininet topology: BMv2 with switchagg and two hosts, a checking worker on each."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bmv2_env.testbed import missing_prerequisites
from switchagg.targets.p4c import build

from .conftest import need

pytestmark = pytest.mark.bmv2
ROOT = Path(__file__).resolve().parents[1]


def test_mininet_topology_runs_an_allreduce():
    need("bmv2", missing_prerequisites())
    probe = subprocess.run(["/usr/bin/python3", "-c", "import mininet.net"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("Debian's mininet is not installed (apt-get install mininet)")
    build(ROOT / "build" / "bmv2")
    out = subprocess.run(["/usr/bin/python3", str(ROOT / "bmv2_env" / "mininet_topo.py"), "--workers", "2", "--run"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("within the bound") == 6  # 3 rounds on each of the 2 hosts
