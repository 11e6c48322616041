"""DDP with the switchagg comm hook, on CPU, against the default allreduce."""

from __future__ import annotations

import socket

import pytest

torch = pytest.importorskip("torch")
import torch.multiprocessing as tmp  # noqa: E402

from switchagg.loopback import free_ports  # noqa: E402

from .conftest import loopback_config  # noqa: E402
from .ddp_worker import train  # noqa: E402


def spawn(world, cfg, steps, **kw):
    ctx = tmp.get_context("spawn")
    queue = ctx.Queue()
    (port,) = free_ports(1, socket.SOCK_STREAM)
    go = kw.pop("go", None)
    procs = [ctx.Process(target=train, args=(r, world, cfg.to_toml(), port, steps, queue),
                         kwargs=dict(kw, go=go), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    return procs, queue


def collect(queue, count, timeout=120):
    out = {}
    while len(out) < count:
        rank, kind, value = queue.get(timeout=timeout)
        assert kind != "error", value
        out.setdefault(rank, []).append((kind, value))
        if kind == "ready":
            out.pop(rank)
            return rank, kind, value, out
        out[rank] = (kind, value)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_training_matches_default_allreduce(soft_switch, world):
    cfg = loopback_config(world, switch_port=soft_switch.address[1], k=256, slot_count=8)
    soft_switch.add_job(cfg)
    procs, queue = spawn(world, cfg, steps=6)
    results = collect(queue, world)
    for p in procs:
        p.join(30)
    runs = [results[r][1] for r in range(world)]
    for r in runs:
        assert r["switchagg"]["ok"], "a reduced gradient left the codec bound"
        assert len(r["switchagg"]["buckets"]) >= 3  # several buckets of uneven sizes
    ref = runs[0]["switchagg"]["params"]
    for r in runs[1:]:
        assert (r["switchagg"]["params"] == ref).all()  # bit-identical across ranks
    final_sw, final_ref = runs[0]["switchagg"]["losses"][-1], runs[0]["default"]["losses"][-1]
    assert abs(final_sw - final_ref) <= 0.01 * abs(final_ref)
    assert runs[0]["switchagg"]["losses"][-1] < runs[0]["switchagg"]["losses"][0]  # it trains


def test_stopped_peer_fails_backward_instead_of_hanging(soft_switch):
    cfg = loopback_config(2, switch_port=soft_switch.address[1], k=256, slot_count=8,
                          control=soft_switch.control_address[1])
    soft_switch.add_job(cfg)
    procs, queue = spawn(2, cfg, steps=5, stop_after=2)
    rank, kind, (message, took) = queue.get(timeout=120)
    assert (rank, kind) == (0, "failed")
    assert "no result for" in message and "waits for workers [1]" in message
    assert took < 8
    for p in procs:
        p.join(30)


def test_dead_switch_fails_backward(soft_switch):
    cfg = loopback_config(2, switch_port=soft_switch.address[1], k=256, slot_count=8)
    soft_switch.add_job(cfg)
    go = tmp.get_context("spawn").Event()
    procs, queue = spawn(2, cfg, steps=5, stop_after=2, go=go)
    ready = {queue.get(timeout=120)[0] for _ in range(2)}
    assert ready == {0, 1}
    soft_switch.remove_job(cfg.job_id)  # the switch stops answering this job
    go.set()
    for _ in range(2):
        rank, kind, (message, took) = queue.get(timeout=60)
        assert kind == "failed" and "switch stopped answering" in message and took < 8
        assert "answered none of" in message  # the QUERYs about the stuck chunks went unanswered too
    for p in procs:
        p.join(30)


def test_unreachable_switch_fails_state_creation_on_every_rank():
    cfg = loopback_config(2, switch_port=9)
    procs, queue = spawn(2, cfg, steps=1, stop_after=0, go=None, probe_timeout=2.0)
    msgs = [queue.get(timeout=120) for _ in range(2)]
    for _, kind, value in msgs:
        assert kind == "error" and "cannot start this job, so no rank uses it" in value
    for p in procs:
        p.join(30)


class _Bucket:
    """What the hook reads of a dist.GradBucket."""

    def __init__(self, tensor):
        self._tensor = tensor

    def buffer(self):
        return self._tensor


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_hook_returns_the_mean_in_the_bucket_dtype(make_job, dtype):
    from switchagg import Client
    from switchagg.ddp import SwitchAggState, allreduce_hook

    from .conftest import run_ranks

    cfg = make_job(2, k=128, slot_count=4)
    grads = [torch.randn(1000, generator=torch.Generator().manual_seed(r)).to(getattr(torch, dtype)) for r in range(2)]

    def rank(r):
        with Client(cfg, r) as client:
            return allreduce_hook(SwitchAggState(client, 2), _Bucket(grads[r])).wait()

    out = run_ranks(2, rank)
    exact = (grads[0].float() + grads[1].float()) / 2
    tol = 1e-6 if dtype == "float32" else 1e-2
    for o in out:
        assert not isinstance(o, BaseException), o
        assert o.dtype == getattr(torch, dtype) and o.shape == (1000,)
        assert torch.allclose(o.float(), exact, rtol=tol, atol=tol)


def test_grad_scaler_skips_a_step_whose_gradients_overflowed_on_one_rank(soft_switch):
    """Rank 0's gradient holds an inf at step 2 (an fp16 overflow under AMP): through the hook every rank
    gets it, so torch.amp.GradScaler skips that step on every rank and lowers its scale, as with gloo;
    the steps after it train on finite sums."""
    from .ddp_worker import amp_skip

    world = 2
    cfg = loopback_config(world, switch_port=soft_switch.address[1], k=256, slot_count=8)
    soft_switch.add_job(cfg)
    ctx = tmp.get_context("spawn")
    queue = ctx.Queue()
    (port,) = free_ports(1, socket.SOCK_STREAM)
    procs = [ctx.Process(target=amp_skip, args=(r, world, cfg.to_toml(), port, 5, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results = collect(queue, world)
    for p in procs:
        p.join(30)
    for r in range(world):
        run = results[r][1]
        assert run["switchagg"]["skipped"] == run["default"]["skipped"] == [False, False, True, False, False]
        assert run["switchagg"]["scales"] == run["default"]["scales"]
        assert (run["switchagg"]["params"] == results[0][1]["switchagg"]["params"]).all()
