"""End to end on loopback: Clients through the embedded switch."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from switchagg import Client, ConfigError, JobConfig, JobNotStarted, SoftSwitch, StallError
from switchagg.config import Endpoint, WorkerSpec
from switchagg.transport import BATCHED_AVAILABLE, UdpSocket
from switchagg.wire import PacketType, make_header, unpack_header

from .conftest import loopback_config, run_ranks


def inputs(n, size, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == np.int32:
        return [rng.integers(-10**6, 10**6, size).astype(np.int32) for _ in range(n)]
    return [rng.standard_normal(size).astype(dtype) for _ in range(n)]


def once(cfg, rank, x, **kw):
    with Client(cfg, rank) as c:
        return c.allreduce(x, **kw)


def tolerance(xs, n):
    scale = max(float(np.max(np.abs(x.astype(np.float64)))) for x in xs) if xs[0].size else 0
    return n * scale * 2.0**-24 * 4 + 1e-30


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_allreduce_matches_numpy(make_job, n):
    cfg = make_job(n, k=512, slot_count=8)
    xs = inputs(n, 10_000 + n, seed=n)
    out = run_ranks(n, lambda r: once(cfg, r, xs[r]))
    exact = np.sum(np.stack(xs).astype(np.float64), axis=0)
    for o in out:
        assert not isinstance(o, BaseException), o
        assert o.dtype == np.float32 and o.shape == xs[0].shape
        assert np.max(np.abs(o - exact)) <= tolerance(xs, n)
        assert np.array_equal(o, out[0])


@pytest.mark.parametrize("size", [0, 1, 511, 512, 513, 4097])
def test_lengths_not_multiple_of_k(make_job, size):
    cfg = make_job(3, k=512, slot_count=4)
    xs = inputs(3, size, seed=size)
    out = run_ranks(3, lambda r: once(cfg, r, xs[r].reshape(-1, 1) if size else xs[r]))
    exact = np.sum(np.stack(xs).astype(np.float64), axis=0)
    for o in out:
        assert not isinstance(o, BaseException), o
        assert o.size == size
        assert np.max(np.abs(o.reshape(-1) - exact), initial=0) <= tolerance(xs, 3)


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32])
def test_dtypes_mean_out_and_async(make_job, dtype):
    n = 4
    cfg = make_job(n, k=256, slot_count=4)
    xs = inputs(n, 3000, dtype=dtype, seed=7)

    def work(rank):
        with Client(cfg, rank) as c:
            s = c.allreduce(xs[rank])
            out = np.empty_like(xs[rank])
            if dtype == np.int32:
                with pytest.raises(ValueError, match="mean"):
                    c.allreduce(xs[rank], op="mean")
                m = c.allreduce_async(xs[rank], out=out).result()
            else:
                m = c.allreduce_async(xs[rank], op="mean", out=out).result()
            assert m is out
            return s, m

    out = run_ranks(n, work)
    exact = np.sum(np.stack(xs).astype(np.float64), axis=0)
    for o in out:
        assert not isinstance(o, BaseException), o
        s, m = o
        assert s.dtype == dtype
        if dtype == np.int32:
            assert np.array_equal(s, exact.astype(np.int32)) and np.array_equal(m, s)
        else:
            rtol = 2e-3 if dtype == np.float16 else 1e-6
            assert np.allclose(s, exact, rtol=rtol, atol=tolerance(xs, n) + rtol)
            assert np.allclose(m, exact / n, rtol=rtol, atol=tolerance(xs, n) + rtol)


def test_torch_tensors_keep_dtype_and_shape(make_job):
    torch = pytest.importorskip("torch")
    cfg = make_job(2, k=128, slot_count=4)
    ts = [torch.randn(7, 33, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16) for r in range(2)]
    out = run_ranks(2, lambda r: once(cfg, r, ts[r], op="mean"))
    exact = (ts[0].float() + ts[1].float()) / 2
    for o in out:
        assert not isinstance(o, BaseException), o
        assert o.dtype == torch.bfloat16 and o.shape == (7, 33)
        assert torch.allclose(o.float(), exact, rtol=1e-2, atol=1e-2)


def test_sums_in_place_and_into_an_overlapping_out(make_job):
    """out=x sums in place (the DDP hook does); an out that overlaps x at an offset still gets the exact sum."""
    torch = pytest.importorskip("torch")
    cfg = make_job(3, k=128, slot_count=4)
    xs = inputs(3, 5000, seed=7)
    exact = np.sum(np.stack(xs).astype(np.float64), axis=0)

    def work(rank):
        with Client(cfg, rank) as c:
            x = xs[rank].copy()
            same = c.allreduce(x, out=x)
            t = torch.from_numpy(xs[rank].copy())
            same_t = c.allreduce(t, op="mean", out=t)
            buf = np.zeros(5001, np.float32)
            buf[1:] = xs[rank]
            c.allreduce(buf[1:], out=buf[:-1])
            return same is x and same_t is t, x, t.numpy(), buf[:-1]

    for o in run_ranks(3, work):
        assert not isinstance(o, BaseException), o
        ok, x, mean, shifted = o
        assert ok
        assert np.max(np.abs(x - exact)) <= tolerance(xs, 3)
        assert np.max(np.abs(mean - exact / 3)) <= tolerance(xs, 3) / 3 + 1e-6
        assert np.max(np.abs(shifted - exact)) <= tolerance(xs, 3)


def test_the_pure_model_serves_the_same_sums_as_the_c_switch():
    """SoftSwitch(native=False) serves with SwitchModel itself: the same bits come back."""
    xs = inputs(3, 20_000, seed=7)
    results = []
    for native in (True, False):
        with SoftSwitch(("127.0.0.1", 0), native=native) as sw:
            cfg = loopback_config(3, switch_port=sw.address[1], k=512, slot_count=8)
            sw.add_job(cfg)
            out = run_ranks(3, lambda r, cfg=cfg: once(cfg, r, xs[r]))
            assert not any(isinstance(o, BaseException) for o in out), out
            results.append(out[0])
            assert sw.counters()["jobs"][1]["results_multicast"] > 0 and sw.error is None
    assert np.array_equal(results[0], results[1])


@pytest.mark.skipif(not BATCHED_AVAILABLE, reason="UDP segmentation offload is a Linux feature")
def test_segmented_and_plain_transports_give_the_same_bits():
    """K = 64 through GSO/GRO sockets and through one datagram per message: the same sums, float and int32."""
    xs, ints = inputs(3, 70_001, seed=11), inputs(3, 30_011, np.int32, seed=12)
    results = []
    for segmentation in (None, False):
        with SoftSwitch(("127.0.0.1", 0), segmentation=segmentation) as sw:
            cfg = loopback_config(3, switch_port=sw.address[1], k=64, slot_count=256)
            sw.add_job(cfg)

            def both(rank, cfg=cfg, segmentation=segmentation):
                with Client(cfg, rank, segmentation=segmentation) as c:
                    assert ("GSO" in c.backend) == (segmentation is None), c.backend
                    return c.allreduce(xs[rank]), c.allreduce(ints[rank])

            out = run_ranks(3, both)
            assert not any(isinstance(o, BaseException) for o in out), out
            assert ("GRO" in sw.backend) == (segmentation is None)
            results.append(out)
    for (f0, i0), (f1, i1) in zip(*results, strict=True):
        assert np.array_equal(f0, f1) and np.array_equal(i0, i1)
    assert np.array_equal(results[0][0][1], np.sum(np.stack(ints), axis=0, dtype=np.int32))


@pytest.mark.skipif(not BATCHED_AVAILABLE, reason="UDP segmentation offload is a Linux feature")
def test_a_short_segment_in_a_coalesced_buffer_is_one_counted_drop(soft_switch):
    """Ten contributions and a 10-byte runt in one segmented send: ten results, one malformed, nothing else lost."""
    cfg = loopback_config(1, switch_port=soft_switch.address[1], k=64, slot_count=16)
    soft_switch.add_job(cfg)
    with Client(cfg, 0) as c:
        generation = c.probe()
    contributions = [make_header(PacketType.CONTRIB, job=cfg.job_id, worker=0, slot=s, chunk=s + 1,
                                 generation=generation, key=cfg.key, count=64).pack() + bytes(256) for s in range(10)]
    with UdpSocket(cfg.workers[0].address.tuple, peer=cfg.switch.tuple, batch=16, max_datagram=280) as w:
        assert w.gso
        assert w.send([((data,), None) for data in contributions] + [((b"0123456789",), None)]) == 0
        assert w.stats.send_calls == 1  # one message: ten full segments and the short last one
        results = []
        deadline = time.monotonic() + 5
        while len(results) < 10 and time.monotonic() < deadline:
            results += [unpack_header(bytes(v)) for v, _ in w.recv(0.2)]
    assert sorted(h.slot for h in results) == list(range(10))
    assert all(h.type == PacketType.RESULT for h in results)
    counters = soft_switch.counters()
    assert counters["global"]["malformed"] == 1
    assert counters["jobs"][cfg.job_id]["results_multicast"] == 10


def test_several_jobs_on_one_switch_are_isolated(make_job):
    a = make_job(3, job_id=1, slot_base=0, slot_count=4, k=256)
    b = make_job(2, job_id=2, slot_base=4, slot_count=4, k=128)
    xa, xb = inputs(3, 5000, seed=1), inputs(2, 3000, seed=2)

    def work(i):
        cfg, xs, rank = (a, xa, i) if i < 3 else (b, xb, i - 3)
        with Client(cfg, rank) as c:
            return [c.allreduce(xs[rank]) for _ in range(3)]

    out = run_ranks(5, work)
    for i, o in enumerate(out):
        assert not isinstance(o, BaseException), o
        xs = xa if i < 3 else xb
        exact = np.sum(np.stack(xs).astype(np.float64), axis=0)
        for r in o:
            assert np.max(np.abs(r - exact)) <= tolerance(xs, len(xs))


def test_foreign_sender_and_fuzzed_headers_change_no_result(make_job, soft_switch):
    cfg = make_job(2, k=256, slot_count=4)
    xs = inputs(2, 20_000, seed=3)
    clean = run_ranks(2, lambda r: once(cfg, r, xs[r]))
    soft_switch.reset_job(cfg.job_id)
    rng = np.random.default_rng(9)
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    target = soft_switch.address
    stop = []

    def fuzz(_):
        sent = 0
        while not stop and sent < 20000:
            kind = sent % 4
            if kind == 0:  # random bytes
                data = rng.bytes(int(rng.integers(0, 400)))
            else:  # well-formed contributions from the wrong sender, worker ids and keys of the job
                h = make_header(PacketType.CONTRIB, job=cfg.job_id, worker=int(rng.integers(0, 2)),
                                slot=int(rng.integers(0, 4)), copy=int(rng.integers(0, 2)),
                                chunk=int(rng.integers(0, 200)), key=cfg.key if kind == 1 else 1,
                                exponent=100, count=256)
                data = h.pack() + rng.integers(-2**31, 2**31, 256).astype(">i4").tobytes()
            attacker.sendto(data, target)
            sent += 1
        return sent

    def work(r):
        if r == 2:
            return fuzz(r)
        with Client(cfg, r) as c:
            res = c.allreduce(xs[r])
        stop.append(True)
        return res

    out = run_ranks(3, work)
    attacker.close()
    for r in range(2):
        assert np.array_equal(out[r], clean[r])
    g = soft_switch.counters()["global"]
    assert g["not_admitted"] + g["malformed"] + g["bad_version"] > 0


@pytest.mark.parametrize("recovery", ["resend", "query"])
@pytest.mark.parametrize("ask", ["control port", "query"])
def test_killed_worker_makes_others_fail_fast(make_job, recovery, ask):
    """The survivors raise within the stall timeout and name the dead rank: as the embedded switch's
    control port tells it, or (as on BMv2 or Tofino, which have none) as the switch answers a QUERY."""
    cfg = dataclasses.replace(make_job(3, k=256, slot_count=4), loss_recovery=recovery)
    if ask == "query":
        cfg = dataclasses.replace(cfg, control=None)
    xs = inputs(3, 200_000)

    def work(r):
        c = Client(cfg, r, stall_timeout=2.0)
        c.allreduce(xs[r][:1000])  # the job starts
        if r == 2:
            c._sock.close()  # dies: its socket is gone, it sends nothing more
            return "dead"
        t = time.monotonic()
        try:
            c.allreduce(xs[r])
        except StallError as exc:
            return exc, time.monotonic() - t
        finally:
            c.close()

    out = run_ranks(3, work, timeout=30)
    for o in out[:2]:
        exc, took = o
        assert isinstance(exc, StallError)
        assert took < 5.0
        assert "waits for workers [2]" in str(exc)


@pytest.mark.parametrize("recovery", ["resend", "query"])
def test_a_worker_paused_for_two_seconds_is_waited_for_not_failed(soft_switch, tmp_path, recovery):
    """SIGSTOP for 2 s, then SIGCONT: the others retransmit and wait (the stall timeout is 5 s), and
    every rank finishes every call with a correct sum. Faster loss recovery must not turn a slow
    peer into a dead one."""
    cfg = loopback_config(3, switch_port=soft_switch.address[1], control=soft_switch.control_address[1], k=64)
    soft_switch.add_job(cfg)
    path = dataclasses.replace(cfg, loss_recovery=recovery).write(tmp_path / "job.toml")
    workers = [subprocess.Popen([sys.executable, "-m", "switchagg", "worker", "--config", str(path), "--rank",
                                 str(r), "--size", "300000", "--rounds", "40"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for r in range(3)]
    try:
        first = workers[1].stdout.readline()  # rank 1 has finished a call: the job runs
        assert first.startswith("round 0:"), first
        workers[1].send_signal(signal.SIGSTOP)
        time.sleep(2.0)
        workers[1].send_signal(signal.SIGCONT)
        outputs = [first + w.communicate(timeout=120)[0] for w in workers[1:2]]
        outputs += [w.communicate(timeout=120)[0] for w in (workers[0], workers[2])]
    finally:
        for w in workers:
            w.kill()
    assert [w.returncode for w in workers] == [0, 0, 0], outputs
    for out in outputs:
        assert out.count("within the bound") == 40, out


def test_no_switch_means_job_not_started_quickly():
    cfg = loopback_config(2, switch_port=9)  # discard port: nothing answers
    with Client(cfg, 0, start_timeout=1.0) as c:
        t = time.monotonic()
        with pytest.raises(JobNotStarted, match="did not answer a probe"):
            c.allreduce(np.ones(10, np.float32))
        assert time.monotonic() - t < 3
        with pytest.raises(Exception, match="earlier call"):  # a failed client refuses further calls
            c.allreduce(np.ones(10, np.float32))


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_the_client_thread_runs_under_sched_batch_unless_told_not_to_and_nothing_else_does():
    """A woken worker thread must not preempt the one whose send woke it (switchagg.scheduling); the
    caller's threads keep their policy."""
    cfg = loopback_config(2, switch_port=9)
    before = os.sched_getscheduler(0)
    with Client(cfg, 0) as c:
        assert c.submit(lambda: os.sched_getscheduler(0)).result() == os.SCHED_BATCH
    with Client(cfg, 1, batch_scheduling=False) as c:
        assert c.submit(lambda: os.sched_getscheduler(0)).result() == before
    assert os.sched_getscheduler(0) == before


def test_probe_reports_generation_and_checks_config(make_job, soft_switch):
    cfg = make_job(2)
    gen = soft_switch.jobs()[cfg.job_id].generation
    with Client(cfg, 1) as c:
        assert c.probe(2.0) == gen
    with Client(cfg.with_generation(gen ^ 1), 1) as c, pytest.raises(ConfigError, match="generation"):
        c.probe(2.0)


def test_loss_recovery_is_read_written_and_checked(make_job, tmp_path):
    cfg = dataclasses.replace(make_job(2), loss_recovery="query")
    assert JobConfig.from_file(cfg.write(tmp_path / "job.toml")).loss_recovery == "query"
    auto = dataclasses.replace(cfg, loss_recovery="auto")
    assert "loss_recovery" not in auto.to_toml()  # the default
    assert JobConfig.from_file(auto.write(tmp_path / "auto.toml")).loss_recovery == "auto"
    with pytest.raises(ConfigError, match='"auto".*"resend".*"query"'):
        dataclasses.replace(cfg, loss_recovery="ask")


def test_auto_loss_recovery_asks_first_where_every_worker_resending_would_cost_more_than_three_per_loss(
        make_job):
    """Every worker resending costs (n + 1) / 2 resends per packet lost: up to 3 with 5 workers."""
    two = make_job(2)
    assert two.loss_recovery == "auto" and not two.asks_first
    five, six = (dataclasses.replace(two, workers=tuple(WorkerSpec(Endpoint("127.0.0.1", 40000 + r)) for r in range(n)))
                 for n in (5, 6))
    assert not five.asks_first and six.asks_first
    assert not dataclasses.replace(six, loss_recovery="resend").asks_first
    assert dataclasses.replace(two, loss_recovery="query").asks_first


def test_packets_larger_than_an_ipv4_datagram_are_refused_by_the_config(make_job):
    make_job(1, k=16370)  # 24 + 4 * 16370 bytes: the largest UDP payload of IPv4
    with pytest.raises(ConfigError, match="1..16370"):
        make_job(1, k=16371)
