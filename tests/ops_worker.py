"""What each rank of ``tests/test_distributed_ops.py`` runs, in its own spawned process.

Every function is ``fn(rank, queue, world, env, port, backend)``: it forms a ``backend`` group (gloo,
or switchagg on the switch the ``SWITCHAGG_*`` variables ``env`` name) on a TCP store at ``port``
and puts what each call gave on ``queue``: the tensor (as its dtype and list), or the error as
``"Type: message"``; on switchagg, with the bytes the call sent to the switch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tests.dist_worker import _init

N = 700  # more than one packet's values (K = 64) on every rank: several chunks, a ragged last one


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the outcome compared with gloo's
        return f"{type(exc).__name__}: {exc}"


def closed_client(rank: int, queue: Any, world: int, env: dict[str, str], port: int, backend: str) -> None:
    """All-reduces through the switch after this rank's client was closed: each must raise, not pass."""
    _init(rank, world, env, port, backend)
    dist.group.WORLD.client.close()
    out = {"sync": _outcome(lambda: dist.all_reduce(torch.ones(N))),
           "async": _outcome(lambda: dist.all_reduce(torch.ones(N), async_op=True).wait())}
    dist.destroy_process_group()
    queue.put((rank, "result", out))
