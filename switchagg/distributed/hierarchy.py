"""A hierarchical group's sums: reduce inside the node, sum each shard through its rail's switch job,
gather inside the node (NCCL CollNet's shape; :mod:`.topology` says why).

``all_reduce``: the node's ranks reduce-scatter the tensor (exactly, in float32 for the float types,
so the switch's headroom and error bound count nodes, not ranks), local rank ``r`` all-reduces its
shard through rail ``r``, and the node all-gathers the shards. ``reduce_scatter_tensor``: each
rank's output is summed over every rank, so the node reduce-scatters the rows that rail ``r``'s
ranks own to local rank ``r``, and the rail's switch job reduce-scatters them among its nodes:
each rank receives only its own rows, and nothing is gathered.

Each call runs in three stages, each on its own thread and each taken in call order on every
rank, so that consecutive calls overlap: the node's reduce-scatter (on one intra-node group), the
rail's switch call (the client's own thread), and the node's gather (on a second intra-node group,
so that it never waits behind a later call's reduce-scatter). A call that fails in one rail fails on
every rank of every node: the gather carries each local rank's outcome beside its shard.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ProcessGroupGloo

from ..client import Client
from ..errors import PeerFailed
from .topology import Layout


class Hierarchy:
    """This rank's side of a hierarchical group: its node's two intra-node groups and its rail's client."""

    def __init__(self, store: dist.Store, prefix: str, layout: Layout, rank: int, client: Client,
                 timeout: timedelta) -> None:
        node = layout.node_of(rank)
        self.layout, self.client = layout, client
        self.local_rank, self.local_size = node.index(rank), len(node)
        self.size = sum(map(len, layout.nodes))
        self.node_index = layout.nodes.index(node)
        # Two intra-node groups per device type: one for the reduce-scatters, one for the gathers.
        self._node: dict[str, tuple[Any, Any]] = {}
        stores = [dist.PrefixStore(f"{prefix}node/{self.node_index}/{stage}/", store) for stage in ("in", "out")]
        self._node["cpu"] = tuple(ProcessGroupGloo(dist.PrefixStore("gloo/", s), self.local_rank, self.local_size,
                                                   timeout) for s in stores)  # type: ignore[assignment]
        if dist.is_nccl_available() and torch.cuda.is_available():
            self._node["cuda"] = tuple(dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", s), self.local_rank,
                                                             self.local_size) for s in stores)  # type: ignore
        self._in = ThreadPoolExecutor(1, thread_name_prefix="switchagg-node-in")
        self._out = ThreadPoolExecutor(1, thread_name_prefix="switchagg-node-out")

    def close(self) -> None:
        """Let the calls queued finish, then stop the stages' threads and the node's groups (here, while
        the interpreter is whole: left to its exit, a backend's threads may outlive what they use)."""
        self._in.shutdown(wait=True)
        self._out.shutdown(wait=True)
        for groups in self._node.values():
            for group in groups:
                group.shutdown()
        self._node.clear()

    # ---- the collectives --------------------------------------------------------------------------

    def allreduce(self, t: torch.Tensor, mean: bool) -> Future:
        """Sum (or average over every rank, ``mean``) ``t`` in place over the group; the Future holds ``t``."""
        flat, n, width = t.view(-1), t.numel(), self.local_size
        s = -(-n // width)
        dtype = _exact(t.dtype)

        def reduce_in_node() -> Future:
            buf = torch.zeros(width * s, dtype=dtype, device=t.device)
            buf[:n].copy_(flat)
            _wait(self._groups(t)[0]._reduce_scatter_base(shard[:s], buf, _sum()), t)
            return self.client.allreduce_async(shard[:s], op="sum", out=shard[:s])

        def gather_in_node(switch: Future) -> torch.Tensor:
            error = _outcome(switch)
            shard[s] = 0 if error else 1
            rows = torch.empty(width, s + 1, dtype=dtype, device=t.device)
            _wait(self._groups(t)[1]._allgather_base(rows.view(-1), shard, AllgatherOptions()), t)
            self._raise_if_failed(error, rows[:, s])
            total = rows[:, :s].reshape(-1)[:n]
            flat.copy_(total / self.size if mean else total)
            return t

        shard = torch.empty(s + 1, dtype=dtype, device=t.device)  # the last value: this rail's outcome
        return self._staged(t, reduce_in_node, gather_in_node)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, mean: bool) -> Future:
        """``output`` := this rank's rows of the sum (or mean) of ``input`` over the group; the Future holds it."""
        m, width, nodes = output.numel(), self.local_size, len(self.layout.nodes)
        dtype = _exact(input.dtype)
        order = torch.tensor([r for rail in self.layout.jobs for r in rail], device=input.device)

        def reduce_in_node() -> Future:
            rows = input.reshape(self.size, m).index_select(0, order).to(dtype)  # rail by rail, node by node
            mine = torch.empty(nodes * m, dtype=dtype, device=input.device)
            _wait(self._groups(input)[0]._reduce_scatter_base(mine, rows.view(-1), _sum()), input)
            return self.client.reduce_scatter_async(mine, op="sum", out=shard)

        def agree_in_node(switch: Future) -> torch.Tensor:
            error = _outcome(switch)
            flags = torch.empty(width, dtype=torch.int32, device=input.device)
            mine = torch.full((1,), 0 if error else 1, dtype=torch.int32, device=input.device)
            _wait(self._groups(input)[1]._allgather_base(flags, mine, AllgatherOptions()), input)
            self._raise_if_failed(error, flags)
            output.view(-1).copy_(shard / self.size if mean else shard)
            return output

        shard = torch.empty(m, dtype=dtype, device=input.device)
        return self._staged(input, reduce_in_node, agree_in_node)

    # ---- helpers ---------------------------------------------------------------------------------

    def _groups(self, t: torch.Tensor) -> tuple[Any, Any]:
        return self._node[t.device.type]

    def _staged(self, t: torch.Tensor, first: Callable[[], Future], last: Callable[[Future], torch.Tensor]) -> Future:
        """Run ``first`` (the node's reduce-scatter, then the rail's call, whose Future it returns) on the
        first stage and ``last`` on the second; the Future holds ``last``'s value.

        Every stage runs on every rank whatever fails before it, so the calls stay paired: where
        ``first`` fails on this rank alone, the rail's call is still taken part in, as a rank that
        cannot (its peers fail it), and the node's gather still carries this rank's outcome. On a GPU
        the stages run one after the other on one thread (two NCCL communicators issued from two
        threads could be issued in different orders on different ranks), after the caller's stream
        has produced ``t``.
        """
        result: Future = Future()
        ready = None
        if t.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(t.device))

        def run_last(switch: Future) -> None:
            try:
                result.set_result(last(switch))
            except BaseException as exc:  # noqa: BLE001 - the call's outcome
                result.set_exception(exc)

        def run_first() -> None:
            try:
                if ready is not None:
                    ready.synchronize()
                switch = first()
            except BaseException as exc:  # noqa: BLE001 - this rank's alone, perhaps: its rail still hears of it
                switch = self._failed(exc)
            if ready is None:
                self._out.submit(run_last, switch)
            else:
                run_last(switch)

        self._in.submit(run_first)
        return result

    def _failed(self, error: BaseException) -> Future:
        """This rank's part in its rail's call, where it has nothing to send: the peers' call fails too."""
        try:
            return self.client.fail_async(error)
        except BaseException as exc:  # noqa: BLE001 - a closed client: the call's outcome here
            failed: Future = Future()
            failed.set_exception(exc)
            return failed

    def _raise_if_failed(self, error: BaseException | None, outcomes: torch.Tensor) -> None:
        """Raise on every local rank where any rail's call failed: this rank's own error, or which rails failed."""
        if error is not None:
            raise error
        failed = [r for r, ok in enumerate(outcomes.tolist()) if not ok]
        if failed:
            raise PeerFailed(f"this call failed in rail(s) {failed} (local ranks {failed} of every node, summing "
                             "their shards through the switch), so no rank of the group uses its result")


def _exact(dtype: torch.dtype) -> torch.dtype:
    """What the node sums in: float32 for every float type (fp16's and bf16's own sums would round), int32 as is."""
    return dtype if dtype == torch.int32 else torch.float32


def _sum() -> dist.ReduceScatterOptions:
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return opts


def _wait(work: Any, t: torch.Tensor) -> None:
    """Wait for an intra-node collective; on a GPU, until its kernel is done (the next stage reads its output)."""
    work.wait()
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()


def _outcome(call: Future) -> BaseException | None:
    try:
        call.result()
    except BaseException as exc:  # noqa: BLE001 - handed to every local rank
        return exc
    return None
