"""Workers and the embedded switch in network namespaces, with real kernel loss, duplication and reordering.

Workers talk to the switch over veths through a relay namespace; nftables rules in each worker's
namespace drop and duplicate packets, the relay reorders them. The results must be bit-exact
against a loss-free run. Needs root, ip, nft and ethtool (required where CI found them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from switchagg.config import Endpoint, JobConfig, WorkerSpec

from .conftest import assert_segmented, need
from .impair import ReorderRelay, nft_impair
from .netns_worker import inputs

pytestmark = pytest.mark.netns
N = 3
ROUNDS = 3
SIZE = 20_000
ROOT = Path(__file__).resolve().parents[1]


def missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    for tool in ("ip", "nft", "ethtool"):
        if shutil.which(tool) is None:
            return f"needs `{tool}`"
    return None


@pytest.fixture(scope="module")
def topology():
    need("netns", missing())
    from switchagg import netns

    prefix = "san"
    for ns in netns.namespaces(prefix):
        netns.delete_namespace(ns)
    sw, mid = f"{prefix}-sw", f"{prefix}-mid"
    try:
        for ns in (sw, mid, *(f"{prefix}-w{i}" for i in range(N))):
            netns.add_namespace(ns)
        netns.sh("ip", "link", "add", "br0", "type", "bridge", ns=sw)
        netns.quiet_link("br0", sw)
        netns.sh("ip", "addr", "add", "10.79.0.254/24", "dev", "br0", ns=sw)
        for i in range(N):
            w = f"{prefix}-w{i}"
            netns.veth_between(w, "eth0", mid, f"a{i}")
            netns.veth_between(mid, f"b{i}", sw, f"s{i}")
            netns.sh("ip", "link", "set", f"s{i}", "master", "br0", ns=sw)
            netns.sh("ip", "addr", "add", f"10.79.0.{i + 1}/24", "dev", "eth0", ns=w)
        cfg = JobConfig(switch=Endpoint("10.79.0.254", 16711), job_id=5, key=0xFEED, slot_base=0, slot_count=8,
                        values_per_packet=256,
                        workers=tuple(WorkerSpec(Endpoint(f"10.79.0.{i + 1}", 45000)) for i in range(N)))
        yield prefix, cfg
    finally:
        for ns in netns.namespaces(prefix):
            netns.delete_namespace(ns)


def run_job(prefix: str, cfg: JobConfig, tmp: Path, jitter: float, seed: int) -> list[dict[str, np.ndarray]]:
    path = cfg.write(tmp / "job.toml")
    relay = ReorderRelay(f"{prefix}-mid", [(f"a{i}", f"b{i}") for i in range(N)], jitter=jitter, seed=seed)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    switch = subprocess.Popen(["ip", "netns", "exec", f"{prefix}-sw", sys.executable, "-m", "switchagg", "switch",
                               "--config", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env)
    try:
        assert "switchagg switch on" in switch.stdout.readline() + switch.stdout.readline()
        workers = [subprocess.Popen(["ip", "netns", "exec", f"{prefix}-w{r}", sys.executable, "-m",
                                     "tests.netns_worker", str(path), str(r), str(tmp / f"r{r}.npz"), str(ROUNDS),
                                     str(SIZE)], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
                   for r in range(N)]
        for w in workers:
            _, err = w.communicate(timeout=240)
            assert w.returncode == 0, err[-3000:]
    finally:
        switch.terminate()
        switch.wait(10)
        relay.stop()
    return [dict(np.load(tmp / f"r{r}.npz")) for r in range(N)], relay


def test_loss_duplication_and_reordering_leave_results_bit_exact(topology, tmp_path):
    prefix, cfg = topology
    (tmp_path / "clean").mkdir()
    (tmp_path / "bad").mkdir()
    clean, _ = run_job(prefix, cfg, tmp_path / "clean", jitter=0.0, seed=1)
    for r in clean:
        assert_segmented(str(r["backend"]))
    for i in range(N):
        nft_impair(f"{prefix}-w{i}", loss=5, dup=5, dup_to=cfg.switch.host)
    try:
        impaired, relay = run_job(prefix, cfg, tmp_path / "bad", jitter=0.003, seed=2)
    finally:
        from switchagg import netns

        for i in range(N):
            netns.sh("nft", "delete", "table", "ip", "sa", ns=f"{prefix}-w{i}", check=False)
    assert relay.reordered > 0
    assert sum(int(r["timeouts"]) for r in impaired) > 0  # packets really were lost
    for r in range(N):
        for key in clean[r]:
            if key != "timeouts":
                assert np.array_equal(clean[r][key], impaired[r][key]), key
    for rnd in range(ROUNDS):  # and the int32 sums are exact against numpy
        expect = np.sum([inputs(w, rnd, SIZE + rnd)[1].astype(np.int64) for w in range(N)], axis=0)
        assert np.array_equal(clean[0][f"i{rnd}"], expect.astype(np.int32))


def test_the_loss_bench_measures_a_lossy_run_against_a_lossless_one(capsys, tmp_path):
    need("netns", missing())
    pytest.importorskip("matplotlib")
    from switchagg.benchmarks.loss import run_loss_bench

    plot = tmp_path / "loss.png"
    assert run_loss_bench(worker_counts=(2,), rates=(0.0, 1.0), rounds=2, plot=str(plot)) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^ +2 +(resend|query) +1 +1 +([\d.]+) +[\d.]+ +([\d.]+) +([\d.]+)-([\d.]+) +(\d+) +(\d+) +(\d+) "
                      r"+\S+ +\S+ +(yes|NO)$", out, re.M)
    assert [r[:2] for r in rows] == [("resend", "0"), ("resend", "1"), ("query", "0"), ("query", "1")], out
    assert all(r[8] == "yes" for r in rows), out
    assert all(float(r[3]) <= float(r[2]) <= float(r[4]) for r in rows), out  # the median within the rounds' range
    assert len(re.findall(r"^2 workers, \w+, [\d.]+% loss, runs 1, round 2:", out, re.M)) == 4, out
    for lossless, lossy in (rows[:2], rows[2:]):  # no resend without loss (its rule drops none); under loss
        assert lossless[2] == "1.00" and lossless[5] == lossless[7] == "0" and int(lossy[7]) > 0  # nft did
    assert plot.read_bytes()[:4] == b"\x89PNG"
