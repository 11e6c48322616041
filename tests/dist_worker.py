"""What each rank of the backend tests runs, in its own spawned process (torch.distributed needs one).

Every function is ``fn(rank, queue, world, env, port, ...)``: it sets the ``SWITCHAGG_*`` variables
``env`` (one dict for every rank, or a list of one per rank: each its own ``SWITCHAGG_NODE``), forms
the group on a TCP store at ``port``, and puts its findings on ``queue`` for the test.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _init(rank: int, world: int, env: dict[str, str] | list[dict[str, str]], port: int, backend: str = "switchagg",
          timeout: timedelta | None = None) -> None:
    os.environ.update(env[rank] if isinstance(env, list) else env)
    import switchagg.distributed  # noqa: F401 - registers the backend

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout)


def _values(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank ``rank``'s input: random, different on every rank, reproducible by the test."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.int32:
        return torch.randint(-(1 << 20), 1 << 20, (n,), generator=g, dtype=torch.int32)
    return (torch.randn(n, generator=g) * 10).to(dtype)


def collectives(rank: int, queue: Any, world: int, env: dict[str, str], port: int, sizes: list[int]) -> None:
    """Each collective through the backend, with what the test compares them to, and what each moved
    through the switch (``moved``: the client's bytes sent and received during the call)."""
    _init(rank, world, env, port)
    pg = dist.group.WORLD
    stats = pg.client.transport_stats
    moved: dict[str, tuple[int, int]] = {}

    def call(name: str, fn: Callable[[], Any]) -> None:
        sent, received = stats.bytes_sent, stats.bytes_received
        fn()
        moved[name] = (stats.bytes_sent - sent, stats.bytes_received - received)

    out: dict[str, Any] = {"job": pg.formed.config.job_id, "moved": moved}
    for i, n in enumerate(sizes):
        for dtype in (torch.int32, torch.float32):
            x = _values(rank, n * world, dtype, i)
            y = x.clone()
            call(f"all_reduce {dtype} {n}", lambda y=y: dist.all_reduce(y))
            out[f"all_reduce {dtype} {n}"] = y.numpy()
            shard = torch.empty(n, dtype=dtype)
            call(f"reduce_scatter {dtype} {n}", lambda shard=shard, x=x: dist.reduce_scatter_single(shard, x))
            out[f"reduce_scatter {dtype} {n}"] = shard.numpy()
            gathered = torch.empty(n * world, dtype=dtype)
            call(f"all_gather {dtype} {n}", lambda gathered=gathered, x=x, n=n: dist.all_gather_single(gathered, x[:n]))
            out[f"all_gather {dtype} {n}"] = gathered.numpy()
    mean = _values(rank, 1000, torch.float32, 99)
    call("avg", lambda: dist.all_reduce(mean, op=dist.ReduceOp.AVG))
    out["avg"] = mean.numpy()
    # Delegated: another op, another dtype, and calls the switch has no part in.
    m = torch.tensor([rank * 1.0, -rank * 1.0])
    call("max", lambda: dist.all_reduce(m, op=dist.ReduceOp.MAX))
    f64 = torch.full((3,), 0.1 * (rank + 1), dtype=torch.float64)
    call("f64", lambda: dist.all_reduce(f64))
    b = torch.tensor([rank])
    call("broadcast", lambda: dist.broadcast(b, src=world - 1))
    objs: list[Any] = [None] * world
    call("objects", lambda: dist.all_gather_object(objs, {"rank": rank}))
    call("barrier", dist.barrier)
    works: list[Any] = []

    def issue_and_wait() -> None:
        works.append(dist.all_reduce(torch.ones(5, dtype=torch.int32), async_op=True))
        works[0].wait()

    call("future", issue_and_wait)
    out.update(max=m.tolist(), f64=f64.tolist(), broadcast=b.tolist(), objects=objs,
               future=works[0].get_future().value()[0].tolist())
    dist.destroy_process_group()
    queue.put((rank, "result", out))


def _model(kind: str, world: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if kind == "compiled ddp":  # the model compiled (aot_eager: no C compiler), DDP's buckets through the switch
        return torch.nn.parallel.DistributedDataParallel(torch.compile(model, backend="aot_eager"))
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def train(rank: int, queue: Any, world: int, env: dict[str, str], port: int, backend: str, kind: str,
          steps: int) -> None:
    """``steps`` of SGD on a fixed regression task, each rank its own batches; puts the losses."""
    _init(rank, world, env, port, backend)
    model = _model(kind, world)
    losses = _steps(model, rank, steps)
    sent = received = 0
    if backend == "switchagg":
        stats = dist.group.WORLD.client.transport_stats
        sent, received = stats.bytes_sent, stats.bytes_received
    dist.destroy_process_group()
    queue.put((rank, "result", {"losses": losses, "sent": sent, "received": received}))


def _steps(model: torch.nn.Module, rank: int, steps: int) -> list[float]:
    """SGD on a fixed regression task, each rank its own batches; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(20, 4, generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 20, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x @ w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def init_only(rank: int, queue: Any, world: int, env: dict[str, str], port: int) -> None:
    """Form the group, and say how that went: the error's type and message, or the job id."""
    try:
        _init(rank, world, env, port)
    except Exception as exc:  # noqa: BLE001 - what the test looks at
        queue.put((rank, "result", {"error": f"{type(exc).__name__}: {exc}"}))
        return
    job = dist.group.WORLD.formed.config.job_id
    dist.destroy_process_group()
    queue.put((rank, "result", {"job": job}))


def two_groups(rank: int, queue: Any, world: int, env: dict[str, str], port: int) -> None:
    """The world group and a second switchagg group over the same ranks, each summing its own values."""
    _init(rank, world, env, port)
    other = dist.new_group(list(range(world)), backend="switchagg")
    jobs = (dist.group.WORLD.formed.config.job_id, other.formed.config.job_id)
    a = torch.full((5000,), rank + 1, dtype=torch.int32)
    b = torch.full((5000,), 100 * (rank + 1), dtype=torch.int32)
    wa = dist.all_reduce(a, async_op=True)
    wb = dist.all_reduce(b, group=other, async_op=True)
    wa.wait()
    wb.wait()
    dist.destroy_process_group()
    queue.put((rank, "result", {"jobs": jobs, "a": sorted(set(a.tolist())), "b": sorted(set(b.tolist()))}))


def fsdp_custom(rank: int, queue: Any, world: int, env: dict[str, str], port: int, steps: int) -> None:
    """FSDP2 over a gloo default group, its reduce-scatter through a switchagg group beside it."""
    _init(rank, world, env, port, "gloo")
    from switchagg.distributed.fsdp import SwitchReduceScatter

    switch = dist.new_group(list(range(world)), backend="switchagg")
    model = _model("fsdp", world)
    for module in model.modules():
        if hasattr(module, "set_custom_reduce_scatter"):
            module.set_custom_reduce_scatter(SwitchReduceScatter(switch))
    losses = _steps(model, rank, steps)
    stats = switch.client.transport_stats
    dist.destroy_process_group()
    queue.put((rank, "result", {"losses": losses, "sent": stats.bytes_sent, "received": stats.bytes_received}))


def fallback_calls(rank: int, queue: Any, world: int, env: dict[str, str], port: int, rounds: int) -> None:
    """Broadcasts left to finish on their own, each followed by a barrier, as Lightning's logging does:
    gloo frees each broadcast's tensors in its own thread, racing the barrier's issue. A deadlock
    there shows as gloo's timeout (20 s here) on a rank, not as a hang."""
    _init(rank, world, env, port, timeout=timedelta(seconds=20))
    for i in range(rounds):
        dist.broadcast(torch.full((1,), float(i)), src=i % world, async_op=True)  # its Work dropped at once
        dist.barrier()
    sent = [torch.tensor([rank])]
    dist.broadcast(sent[0], src=world - 1)
    queue.put((rank, "result", {"rounds": rounds, "last": int(sent[0])}))
    dist.destroy_process_group()


def hierarchical(rank: int, queue: Any, world: int, env: list[dict[str, str]], port: int, sizes: list[int]) -> None:
    """A group whose ranks share nodes: all_reduce and reduce_scatter of each dtype the switch carries,
    SUM and AVG, with the rails' jobs as the switch lists them while the group lives."""
    _init(rank, world, env, port)
    pg = dist.group.WORLD
    out: dict[str, Any] = {"layout": pg.layout.to_json(), "job": pg.formed.config.job_id,
                           "workers": pg.formed.config.n_workers}
    sent = pg.client.transport_stats.bytes_sent
    for i, n in enumerate(sizes):
        for dtype in (torch.int32, torch.float32, torch.float16, torch.bfloat16):
            x = _values(rank, n * world, dtype, i)
            y = x[:n].clone()
            dist.all_reduce(y)
            out[f"all_reduce {dtype} {n}"] = y.float().numpy()
            shard = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(shard, x)
            out[f"reduce_scatter {dtype} {n}"] = shard.float().numpy()
    mean = _values(rank, 1000, torch.float32, 99)
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    out["avg"] = mean.numpy()
    shard = torch.empty(10)
    dist.reduce_scatter_tensor(shard, _values(rank, 10 * world, torch.float32, 98), op=dist.ReduceOp.AVG)
    out["avg_shard"] = shard.numpy()
    works = [dist.all_reduce(torch.full((3000,), rank + i, dtype=torch.int32), async_op=True) for i in range(6)]
    out["in_flight"] = [int(w.get_future().wait()[0][0]) for w in works]  # six calls queued before any is waited
    m = torch.tensor([float(rank)])
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out["max"] = m.item()
    out["sent"] = pg.client.transport_stats.bytes_sent - sent
    if rank == 0:
        from switchagg.targets import TargetOptions, open_target

        out["switch_jobs"] = [open_target("soft", TargetOptions(address=a)).jobs()  # one address per rail, or one
                              for a in env[0]["SWITCHAGG_CONTROL"].split(",")]
    dist.destroy_process_group()
    queue.put((rank, "result", out))


def failing_rail(rank: int, queue: Any, world: int, env: list[dict[str, str]], port: int, own_step: bool) -> None:
    """One rail's switch call fails (the last rank hands its client what it cannot sum, then its step
    before the call raises on that rank alone): every rank's call fails, the next is paired as ever, and
    NaN on one rank reaches every rank as allreduce's does."""
    _init(rank, world, env, port)
    pg = dist.group.WORLD
    sane = pg.client.allreduce_async

    def broken(x: torch.Tensor, op: str, out: torch.Tensor) -> Any:
        raise RuntimeError("this rank's own step failed")

    faults = [lambda x, op, out: sane(x, op="max", out=out)] * 2  # an op the client refuses
    if own_step:  # a hierarchical group's first stage raising on one rank: the rail and the node still hear
        faults[1] = broken
    errors = []
    for fault in faults:
        if rank == world - 1:
            pg.client.allreduce_async = fault
        try:
            dist.all_reduce(torch.ones(4000))
            errors.append("no error")
        except Exception as exc:  # noqa: BLE001 - what the test looks at
            errors.append(type(exc).__name__)
    if rank == world - 1:
        pg.client.allreduce_async = sane
    after = torch.ones(10, dtype=torch.int32)
    dist.all_reduce(after)
    x = torch.ones(4000)
    if rank == world - 1:
        x[-1] = float("nan")  # the last shard: the last local rank's rail
    dist.all_reduce(x)
    dist.destroy_process_group()
    queue.put((rank, "result", {"errors": errors, "after": after.tolist(), "nan": bool(x[-1].isnan()),
                                "finite": float(x[:-64].max())}))


def many_groups(rank: int, queue: Any, world: int, env: dict[str, str], port: int, groups: int) -> None:
    """``groups`` switchagg groups beside the world group, all alive at once, each summing its own values."""
    _init(rank, world, env, port)
    made = [dist.new_group(list(range(world)), backend="switchagg") for _ in range(groups)]
    sums, places = [], []
    for i, g in enumerate(made):
        t = torch.full((2000,), (rank + 1) * (i + 1), dtype=torch.int32)
        dist.all_reduce(t, group=g)
        sums.append(sorted(set(t.tolist())))
        places.append(None if g.formed.client is None else (g.formed.config.slot_base, g.formed.config.slot_count))
    one = dist.new_group([0], backend="switchagg")  # every rank calls new_group; rank 0 alone is in it
    if rank == 0:
        t = torch.ones(5)
        dist.all_reduce(t, group=one)
        places.append(one.formed.fallback)
    dist.destroy_process_group()
    queue.put((rank, "result", {"sums": sums, "places": places}))


def hsdp(rank: int, queue: Any, world: int, env: dict[str, str], port: int, backend: str, steps: int) -> None:
    """FSDP2's HSDP on a 2-D DeviceMesh (replicate x shard): its groups are the backend's subgroups, the
    gradients reduce-scattered on the shard dimension and all-reduced on the replicate one."""
    _init(rank, world, env, port, backend)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = _steps(model, rank, steps)
    sent = 0
    if backend == "switchagg":
        sent = sum(mesh.get_group(d).client.transport_stats.bytes_sent for d in ("replicate", "shard"))
    dist.destroy_process_group()
    queue.put((rank, "result", {"losses": losses, "sent": sent}))


def hold(rank: int, world: int, port: int) -> None:
    """A rank of a program run on its own (``python -c``, the ``SWITCHAGG_*`` variables in its environment): it
    forms the group, says so on stdout and waits for ever, so that only a signal ends it and nothing of
    its own removes the job."""
    _init(rank, world, {}, port)
    print(f"formed job {dist.group.WORLD.formed.config.job_id}", flush=True)
    threading.Event().wait()


def tree_group(rank: int, queue: Any, world: int, env: list[dict[str, str]], port: int, n: int) -> None:
    """A group whose ranks reach two leaf switches under a spine (SWITCHAGG_ROOT): its place in the tree, and an
    int32 all_reduce and reduce_scatter of ``n`` values a rank through it."""
    _init(rank, world, env, port)
    pg = dist.group.WORLD
    cfg = pg.formed.config
    out: dict[str, Any] = {"switch": str(cfg.switch), "parent": str(cfg.parent.address) if cfg.parent else None,
                           "rank": cfg.rank_of(pg.client.rank), "ranks": cfg.ranks}
    x = _values(rank, n * world, torch.int32, 5)
    y = x[:n].clone()
    dist.all_reduce(y)
    shard = torch.empty(n, dtype=torch.int32)
    dist.reduce_scatter_tensor(shard, x)
    out["all_reduce"], out["reduce_scatter"] = y.numpy(), shard.numpy()
    dist.destroy_process_group()
    queue.put((rank, "result", out))
