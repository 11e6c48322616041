"""switchagg.Client workers in namespaces, allreducing through BMv2 running the P4 program.

Also with nftables loss and duplication on the hosts' links, and a short DDP training whose gloo
traffic crosses the P4 program's L2 forwarding. Required where CI found root and the toolchain.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from bmv2_env.testbed import TestBed, missing_prerequisites
from switchagg import netns

from .conftest import assert_segmented, need
from .impair import nft_impair
from .netns_worker import check_sums, inputs

pytestmark = pytest.mark.bmv2
ROOT = Path(__file__).resolve().parents[1]
N, ROUNDS, SIZE = 3, 2, 3000
ENV = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="eth0")


@pytest.fixture(scope="module")
def bed():
    need("bmv2", missing_prerequisites())
    with TestBed(N, prefix="sae", subnet=77) as bed:
        yield bed


@pytest.fixture(scope="module")
def job(bed, tmp_path_factory):
    from switchagg.targets import bmv2

    cfg = bed.job(list(range(N)), job_id=7, slot_count=32)
    path = cfg.write(tmp_path_factory.mktemp("job") / "job.toml")
    bmv2.Bmv2Target(bed.grpc_addr).deploy(cfg)
    return cfg, path


def run_workers(bed, argv_for, timeout=300):
    procs = [bed.exec(r, [sys.executable, "-m", *argv_for(r)], cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True)
             for r in range(N)]
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]


def allreduce_run(bed, path, out: Path) -> list[dict]:
    out.mkdir()
    run_workers(bed, lambda r: ["tests.netns_worker", str(path), str(r), str(out / f"{r}.npz"), str(ROUNDS),
                                str(SIZE)])
    return [dict(np.load(out / f"{r}.npz")) for r in range(N)]


def assert_same_under_loss(bed, clean: list[dict], run: Callable[[], list[dict]]) -> None:
    """``run`` again with 5% loss and 5% duplication on every host (nftables): it must lose packets and
    give every rank exactly what the clean run gave."""
    for i in range(N):
        nft_impair(bed.host(i), loss=5, dup=5, dup_to=bed.switch_ip)
    try:
        lossy = run()
    finally:
        for i in range(N):
            netns.sh("nft", "delete", "table", "ip", "sa", ns=bed.host(i), check=False)
    assert sum(int(r["timeouts"]) for r in lossy) > 0
    for r in range(N):
        for key in clean[r]:
            if key != "timeouts":
                assert np.array_equal(clean[r][key], lossy[r][key]), key


def test_allreduce_through_bmv2_exact_even_with_loss_and_duplication(bed, job, tmp_path):
    _, path = job
    clean = allreduce_run(bed, path, tmp_path / "clean")
    for r in clean:
        assert_segmented(str(r["backend"]))
    check_sums(clean, N, ROUNDS, SIZE)
    # A restart with no reset (the same installed generation): the new run joins a session of its own,
    # so the P4 program's copies of the last run serve it nothing (issue 27).
    assert_same_under_loss(bed, clean, lambda: allreduce_run(bed, path, tmp_path / "lossy"))
    status = subprocess.run([sys.executable, "-m", "switchagg", "status", "--target", "bmv2", "--config", str(path),
                             "--address", bed.grpc_addr], capture_output=True, text=True, env=ENV, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "job 7: generation" in status.stdout and "results_multicast" in status.stdout
    assert "duplicate_pending" in status.stdout


def reduce_scatter_run(bed, path, out: Path) -> list[dict]:
    out.mkdir()
    run_workers(bed, lambda r: ["tests.rs_netns_worker", str(path), str(r), str(out / f"{r}.npz"), str(ROUNDS),
                                str(SIZE)])
    return [dict(np.load(out / f"{r}.npz")) for r in range(N)]


def test_reduce_scatter_through_bmv2_exact_even_with_loss_and_duplication(bed, job, tmp_path):
    """Each rank gets its shard of every sum, the P4 program sending the other ranks' chunks as headers alone
    (docs/protocol.md section 4b); under loss and duplication the header-only repeats recover lost results,
    and every value is what the clean run got."""
    from switchagg.targets import bmv2

    cfg, path = job
    before = bmv2.Bmv2Target(bed.grpc_addr).status(cfg.job_id).counters
    clean = reduce_scatter_run(bed, path, tmp_path / "clean")
    for rnd in range(ROUNDS):
        s = SIZE + rnd
        ints = np.sum([inputs(w, rnd, N * s)[1].astype(np.int64) for w in range(N)], axis=0).astype(np.int32)
        floats = np.sum([inputs(w, rnd, N * s)[0].astype(np.float64) for w in range(N)], axis=0)
        for r in range(N):
            assert np.array_equal(clean[r][f"i{rnd}"], ints[r * s:(r + 1) * s])
            assert np.array_equal(clean[r][f"a{rnd}"], ints)
            assert np.allclose(clean[r][f"f{rnd}"], floats[r * s:(r + 1) * s], rtol=1e-5,
                               atol=1e-6 * np.abs(floats).max())
    counted = bmv2.Bmv2Target(bed.grpc_addr).status(cfg.job_id).counters
    assert counted["results_to_owner"] > before["results_to_owner"] and counted["bad_owner"] == 0
    assert_same_under_loss(bed, clean, lambda: reduce_scatter_run(bed, path, tmp_path / "lossy"))


def test_ddp_training_through_bmv2(bed, job, tmp_path):
    pytest.importorskip("torch")
    from switchagg.targets import bmv2

    cfg, path = job
    bmv2.Bmv2Target(bed.grpc_addr).reset(cfg.job_id)
    master = f"{bed.host_ip(0)}:29517"
    run_workers(bed, lambda r: ["tests.ddp_netns_worker", str(path), str(r), master, str(tmp_path / f"{r}.npz")])
    runs = [np.load(tmp_path / f"{r}.npz") for r in range(N)]
    for r in runs[1:]:
        assert np.array_equal(r["switchagg_params"], runs[0]["switchagg_params"])
    final, ref = runs[0]["switchagg_losses"][-1], runs[0]["default_losses"][-1]
    assert abs(final - ref) <= 0.01 * abs(ref)


def test_a_dead_worker_is_named_by_the_p4_program(bed, job, tmp_path):
    """The last rank stops after the first round: the others raise within their stall timeout and name
    it, from the P4 program's PENDING answers to their QUERYs (BMv2 has no control port to ask)."""
    from switchagg.targets import bmv2

    cfg, path = job
    assert cfg.control is None
    bmv2.Bmv2Target(bed.grpc_addr).reset(cfg.job_id)
    procs = [bed.exec(r, [sys.executable, "-m", "tests.netns_worker", str(path), str(r), str(tmp_path / f"{r}.npz"),
                          str(1 if r == N - 1 else 2), str(SIZE)], cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True)
             for r in range(N)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert procs[N - 1].returncode == 0, errs[N - 1][-3000:]
    for r in range(N - 1):
        assert procs[r].returncode != 0 and "StallError" in errs[r], errs[r][-3000:]
        assert f"waits for workers [{N - 1}]" in errs[r], errs[r][-3000:]


def test_mismatched_calls_raise_on_every_rank_through_the_p4_program(bed, job, tmp_path):
    """The last rank allreduces one value more than the others: every rank raises CallMismatch, naming
    both lengths, from the P4 program's sum of the call round (issue 27)."""
    cfg, path = job
    procs = [bed.exec(r, [sys.executable, "-m", "tests.netns_worker", str(path), str(r), str(tmp_path / f"{r}.npz"),
                          "1", str(SIZE + (r == N - 1))], cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True)
             for r in range(N)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    for r in range(N):
        assert procs[r].returncode != 0 and "CallMismatch" in errs[r], errs[r][-3000:]
        assert f"{SIZE} " in errs[r] and f"{SIZE + 1} " in errs[r], errs[r][-3000:]


def test_the_torch_backend_deploys_its_own_job_on_bmv2_and_trains(bed, job, tmp_path):
    """init_process_group("switchagg") with SWITCHAGG_TARGET=bmv2: rank 0 reads the deployed jobs over
    P4Runtime, deploys its own beside the fixture's, the ranks sum and train through the P4 program, and
    destroy_process_group removes the job again."""
    pytest.importorskip("torch")
    from switchagg.targets import bmv2

    from .nsforward import NamespaceForwarder

    cfg, _ = job
    target = bmv2.Bmv2Target(bed.grpc_addr)
    before = target.jobs()
    assert before == {cfg.job_id: (cfg.slot_base, cfg.slot_count)}
    port = int(bed.grpc_addr.rpartition(":")[2])
    with NamespaceForwarder(bed.host(0), ("127.0.0.1", port)) as p4runtime:
        def env(r: int) -> dict[str, str]:
            w = cfg.workers[r]
            return dict(ENV, SWITCHAGG_TARGET="bmv2", SWITCHAGG_SWITCH=str(cfg.switch),
                        SWITCHAGG_CONTROL=f"127.0.0.1:{p4runtime.port}", SWITCHAGG_SLOTS="32",
                        SWITCHAGG_MAC=w.mac, SWITCHAGG_SWITCH_PORT=str(w.switch_port))

        master = f"{bed.host_ip(0)}:29518"
        procs = [bed.exec(r, [sys.executable, "-m", "tests.bmv2_backend_worker", str(r), str(N), master,
                              str(tmp_path / f"{r}.npz")], cwd=ROOT, env=env(r), stderr=subprocess.PIPE, text=True)
                 for r in range(N)]
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
    runs = [np.load(tmp_path / f"{r}.npz") for r in range(N)]
    job_id, slots = int(runs[0]["job"]), tuple(runs[0]["slots"])
    assert job_id != cfg.job_id and slots == (cfg.slot_base + cfg.slot_count, 32)  # beside the fixture's job
    expected = np.arange(3000, dtype=np.int32) * sum(range(1, N + 1))
    for r in runs:
        assert np.array_equal(r["ints"], expected)
        assert np.array_equal(r["params"], runs[0]["params"])
        assert r["losses"][-1] < r["losses"][0]
    assert target.jobs() == before  # destroy_process_group removed it
