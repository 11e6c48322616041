"""What each rank of ``tests/test_distributed_ops.py`` runs, in its own spawned process.

Every function is ``fn(rank, queue, world, env, port, backend)``: it forms a ``backend`` group (gloo,
or switchagg on the switch the ``SWITCHAGG_*`` variables ``env`` name) on a TCP store at ``port``
and puts what each call gave on ``queue``: the tensor (as its dtype and list), or the error as
``"Type: message"``; on switchagg, with the bytes the call sent to the switch.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.dist_worker import _init

OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64)
N = 700  # more than one packet's values (K = 64) on every rank: several chunks, a ragged last one


def values(rank: int, dtype: torch.dtype, n: int = N) -> torch.Tensor:
    """Rank ``rank``'s input: mixed signs, odd sums (so truncation and flooring differ), sums that
    wrap around 8-bit types, exact in every floating type."""
    g = torch.Generator().manual_seed(41 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    low, high = (0, 256) if dtype == torch.uint8 else (-128, 128) if dtype == torch.int8 else (-1000, 1000)
    return torch.randint(low, high, (n,), generator=g).to(dtype)


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the outcome compared with gloo's
        return f"{type(exc).__name__}: {exc}"


def _sent(backend: str) -> Callable[[], int]:
    if backend != "switchagg":
        return lambda: 0
    return lambda: dist.group.WORLD.client.transport_stats.bytes_sent


def all_reduce_ops(rank: int, queue: Any, world: int, env: dict[str, str], port: int, backend: str) -> None:
    """``all_reduce`` of every op on every dtype, issued async and waited on (as DDP and Lightning do)."""
    _init(rank, world, env, port, backend)
    sent = _sent(backend)
    out: dict[tuple[str, str], Any] = {}
    for op in OPS:
        for dtype in DTYPES:
            x = values(rank, dtype)
            before = sent()

            def call(x: torch.Tensor = x, op: str = op) -> torch.Tensor:
                dist.all_reduce(x, op=getattr(dist.ReduceOp, op), async_op=True).wait()
                return x.dtype, x.tolist()  # a tensor's storage would go by file descriptor, gone with this process

            out[op, str(dtype)] = (_outcome(call), sent() - before)
    dist.destroy_process_group()
    queue.put((rank, "result", out))


def closed_client(rank: int, queue: Any, world: int, env: dict[str, str], port: int, backend: str) -> None:
    """All-reduces through the switch after this rank's client was closed: each must raise, not pass."""
    _init(rank, world, env, port, backend)
    dist.group.WORLD.client.close()
    out = {"sync": _outcome(lambda: dist.all_reduce(torch.ones(N))),
           "async": _outcome(lambda: dist.all_reduce(torch.ones(N), async_op=True).wait()),
           "int AVG": _outcome(lambda: dist.all_reduce(torch.ones(N, dtype=torch.int32), op=dist.ReduceOp.AVG))}
    dist.destroy_process_group()
    queue.put((rank, "result", out))


def monitored_barrier(rank: int, queue: Any, world: int, env: dict[str, str], port: int, backend: str) -> None:
    """torch's ``dist.monitored_barrier`` refuses the group; the group's own (gloo's) passes when all
    arrive, and names the rank that does not: the last, which waits on the store instead (a gloo
    group that timed out is closed, so that comes last)."""
    _init(rank, world, env, port, backend)
    pg, store = dist.group.WORLD, dist.distributed_c10d._get_default_store()
    out = {"torch's": _outcome(lambda: dist.monitored_barrier(timeout=timedelta(seconds=30))),
           "all": _outcome(lambda: pg.monitored_barrier(timedelta(seconds=30), wait_all_ranks=True))}
    if rank == world - 1:
        store.wait(["missed"])
    else:
        out["missing"] = _outcome(lambda: pg.monitored_barrier(timedelta(seconds=2), wait_all_ranks=True))
        store.set("missed", "")
    dist.destroy_process_group()
    queue.put((rank, "result", out))


def switch_calls(rank: int, queue: Any, world: int, env: dict[str, str], port: int, backend: str) -> None:
    """The calls torch's suite sends nowhere near the switch on CPU: reduce_scatter_tensor and
    all_gather_into_tensor of each type, coalesced all-reduces (both of torch's ways)."""
    _init(rank, world, env, port, backend)
    sent = _sent(backend)
    out: dict[str, Any] = {}

    def record(name: str, call: Callable[[], list[torch.Tensor]]) -> None:
        before = sent()
        got = _outcome(call)
        out[name] = (got if isinstance(got, str) else [(t.dtype, t.tolist()) for t in got], sent() - before)

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        for op in ("SUM", "AVG"):
            def scatter(dtype: torch.dtype = dtype, op: str = op) -> list[torch.Tensor]:
                shard = torch.empty(N, dtype=dtype)
                dist.reduce_scatter_tensor(shard, values(rank, dtype, N * world), op=getattr(dist.ReduceOp, op))
                return [shard]

            record(f"reduce_scatter_tensor {op} {dtype}", scatter)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8):
        def gather(dtype: torch.dtype = dtype) -> list[torch.Tensor]:
            whole = torch.empty(N * world, dtype=dtype)
            dist.all_gather_into_tensor(whole, values(rank, dtype))
            return [whole]

        record(f"all_gather_into_tensor {dtype}", gather)
    for dtype in (torch.float32, torch.bfloat16):
        for op in ("SUM", "AVG"):
            def manager(dtype: torch.dtype = dtype, op: str = op) -> list[torch.Tensor]:
                xs = [values(rank, dtype, n) for n in (N, 3, 2 * N)]
                with dist._coalescing_manager():
                    for x in xs:
                        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
                return xs

            def coalesced(dtype: torch.dtype = dtype, op: str = op) -> list[torch.Tensor]:
                xs = [values(rank, dtype, n) for n in (N, 3, 2 * N)]
                dist.all_reduce_coalesced(xs, op=getattr(dist.ReduceOp, op))
                return xs

            record(f"_coalescing_manager {op} {dtype}", manager)
            record(f"all_reduce_coalesced {op} {dtype}", coalesced)
    dist.destroy_process_group()
    queue.put((rank, "result", out))
