"""The ``switchagg`` process group: sums through the switch, everything else through gloo or NCCL.

It is a ``torch.distributed.ProcessGroup`` written in Python, as torch's own
``test/distributed/test_c10d_pypg.py`` shows: the collectives the switch does are methods here
that return torch Work objects over the call's Future; everything else goes to the *fallback* backends registered on the
group itself (gloo for CPU tensors, NCCL for CUDA ones where there is a GPU), built from the same
store, so that any torch program runs unchanged. What goes where:

* ``all_reduce`` with SUM or AVG of float32, float16, bfloat16 (through the codec, within its
  bound) or int32 (exact): the switch. Other ops, dtypes (float64 keeps its precision on the
  fallback) and non-contiguous tensors: the fallback. AVG of integers is NCCL's: the sum (the
  switch's for int32, the fallback's for the others), then division truncating toward zero.
* ``all_reduce_coalesced`` (and a ``_coalescing_manager`` block's all-reduces) on the same terms,
  the tensors flattened into one call.
* ``reduce_scatter_tensor`` on the same terms: the switch, and each rank receives only its shard's
  sums (``docs/protocol.md``, section 4b); on Tofino, whose program lacks that yet, the fallback.
* ``all_gather_into_tensor``: the fallback unless ``Options.all_gather == "switch"`` (which sums
  each rank's bytes into place among zeros: exact, but every rank sends the whole output).
* broadcast, barrier, send/recv, gather/scatter, all_to_all, object collectives: the fallback.

Which path a call takes depends only on what every rank passes alike (op, dtype, layout), so
every rank takes the same one.
"""

from __future__ import annotations

import atexit
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..torch_futures import FutureWork, failed_future, torch_future
from .hierarchy import Hierarchy
from .options import Options
from .rendezvous import Formed, finish, form
from .topology import Layout

_CARRIED = {torch.float32, torch.float16, torch.bfloat16, torch.int32}
_INTEGERS = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}  # AVG: a sum, then C's division
_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean"}
# Targets whose program has no owner-only delivery yet (docs/tofino.md): their reduce-scatters go to the fallback
_NO_OWNER_DELIVERY = ("tofino", "tofino2")


class SwitchAggProcessGroup(dist.ProcessGroup):
    """A process group whose sums the switch does; built by ``init_process_group("switchagg")``."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, options: Options) -> None:
        super().__init__(rank, size)
        self.options = options
        self._store = store
        gloo = ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        if dist.is_nccl_available() and torch.cuda.is_available():
            nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size)
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self.formed: Formed | None = form(store, rank, size, options, timeout)
        self._hierarchy: Hierarchy | None = None
        if self.formed.client is not None and self.formed.layout.hierarchical:
            try:
                self._hierarchy = Hierarchy(store, self.formed.prefix, self.formed.layout, rank, self.formed.client,
                                            timeout)
            except BaseException:  # the node's groups did not form: remove the jobs, stop renewing them
                self.shutdown()
                raise
        atexit.register(_shut_down, weakref.ref(self))  # a program that never calls destroy_process_group

    @property
    def client(self) -> Any:
        """This rank's :class:`~switchagg.client.Client` (its counters, its session): in a hierarchical
        group, its rail's."""
        if self.formed is None:
            raise RuntimeError("this switchagg process group was shut down: create a new one")
        if self.formed.client is None:
            raise RuntimeError(f"this switchagg process group sums through its fallback backend, not the switch: "
                               f"{self.formed.fallback}")
        return self.formed.client

    @property
    def layout(self) -> Layout | None:
        """Which ranks share a node and which job (a rail's, or the one flat job) each is a worker of."""
        return None if self.formed is None else self.formed.layout

    def _on_switch(self) -> bool:
        """Whether this group's sums go through the switch (not shut down, not fallen back)."""
        return self.formed is not None and self.formed.client is not None

    def getBackendName(self) -> str:  # noqa: N802 - torch's name for it
        return "switchagg"

    # ---- through the switch ----------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = _allreduce_options(opts)
        if _op(opts.reduceOp) == dist.ReduceOp.AVG and {t.dtype for t in tensors} <= _INTEGERS:
            return self._average_integers(tensors, self.allreduce(tensors, _summing(opts, dist.AllreduceOptions())))
        op = _switch_op(opts.reduceOp, tensors) if len(tensors) == 1 and self._on_switch() else None  # one a call
        if op is None:
            return self._fallback(tensors[0]).allreduce(tensors, opts)
        t = tensors[0]
        if self._hierarchy is not None:
            hierarchy = self._hierarchy
            return self._work(t, lambda: hierarchy.allreduce(t, op == "mean"), lambda _: [t])
        return self._work(t, lambda: self.client.allreduce_async(t, op=op, out=t), lambda _: [t])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts or dist.ReduceScatterOptions()
        if _op(opts.reduceOp) == dist.ReduceOp.AVG and {output.dtype, input.dtype} <= _INTEGERS:
            return self._average_integers(
                [output], self.reduce_scatter_single(output, input, _summing(opts, dist.ReduceScatterOptions())))
        op = _switch_op(opts.reduceOp, [output, input]) if self._on_switch() else None
        if op is None or input.numel() != output.numel() * self.size() or self.options.target in _NO_OWNER_DELIVERY:
            return self._fallback(input)._reduce_scatter_base(output, input, opts)
        if self._hierarchy is not None:
            hierarchy = self._hierarchy
            return self._work(output, lambda: hierarchy.reduce_scatter(output, input, op == "mean"), lambda _: [output])
        return self._work(output, lambda: self.client.reduce_scatter_async(input, op=op, out=output),
                          lambda _: [output])

    _reduce_scatter_base = reduce_scatter_single  # the name torch's C++ side calls it by

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """Several tensors as one call through the switch (``_coalescing_manager``, ``all_reduce_coalesced``),
        where they share a dtype the switch sums; else the fallback's."""
        opts = opts or dist.AllreduceCoalescedOptions()
        op = _switch_op(opts.reduceOp, tensors) if self._on_switch() else None
        if op is None:
            return self._fallback(tensors[0]).allreduce_coalesced(tensors, opts)
        flat = _flatten_dense_tensors(tensors)

        def place(_: Any) -> list[torch.Tensor]:
            for t, summed in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
                t.copy_(summed)
            return tensors

        if self._hierarchy is not None:
            hierarchy = self._hierarchy
            return self._work(flat, lambda: hierarchy.allreduce(flat, op == "mean"), place)
        return self._work(flat, lambda: self.client.allreduce_async(flat, op=op, out=flat), place)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts or dist.AllgatherOptions()
        if (self.options.all_gather != "switch" or not self._on_switch() or self._hierarchy is not None
                or output.dtype != input.dtype or not _dense(output, input)
                or output.numel() != input.numel() * self.size()):
            return self._fallback(input)._allgather_base(output, input, opts)
        return self._gather_through_switch(output, input)

    _allgather_base = all_gather_single

    # ---- through the fallback, issued without the GIL -----------------------------------------------
    # torch issues a Python group's collectives that the group does not define itself with the GIL
    # held (PyProcessGroup's WORK_OVERRIDE calls the base class inside its GIL scope). Gloo's worker
    # thread frees a finished Work while holding the lock that issuing a collective takes, and
    # freeing a tensor Python knew takes the GIL: a deadlock, both ranks stuck in the next collective
    # (Lightning's barrier after a broadcast hung about one run in fifteen). The backends' own Python
    # methods release the GIL, so every call that goes to the fallback goes through one of them.

    def barrier(self, opts: Any = None) -> Any:
        opts = opts or dist.BarrierOptions()
        return self._get_backend(opts.device or torch.device("cpu")).barrier(opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._fallback(tensors[0]).broadcast(tensors, opts or dist.BroadcastOptions())

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._fallback(inputs[0]).allgather(outputs, inputs, opts or dist.AllgatherOptions())


    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> Any:
        return self._fallback(input).alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                                   opts or dist.AllToAllOptions())

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        return self._fallback(outputs[0]).reduce_scatter(outputs, inputs, opts or dist.ReduceScatterOptions())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        return self._fallback(tensors[0]).send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self._fallback(tensors[0]).recv(tensors, src, tag)

    def shutdown(self) -> None:
        """Close the client and remove the job from the switch (``destroy_process_group`` calls this)."""
        if self.formed is not None:
            formed, self.formed = self.formed, None
            if self._hierarchy is not None:
                self._hierarchy.close()
            finish(self._store, self.rank(), self.size(), formed)

    # ---- helpers ---------------------------------------------------------------------------------

    def _fallback(self, tensor: torch.Tensor) -> Any:
        return self._get_backend(tensor.device)

    def _work(self, tensor: torch.Tensor, start: Any, value: Any) -> dist.Work:
        """torch's Work over the call's Future: ``wait()`` raises its error, DDP chains on ``get_future()``."""
        try:
            done = start()
        except BaseException as exc:  # noqa: BLE001 - e.g. a closed client: wait() raises it
            return FutureWork(failed_future(exc, tensor.device))
        return FutureWork(torch_future(done, tensor.device, value))

    def _average_integers(self, results: list[torch.Tensor], summed: dist.Work) -> dist.Work:
        """Integer AVG as NCCL does it: the exact (wrapping) sum, then C's division, which truncates
        toward zero. gloo refuses it ("result type Float can't be cast"), yet Lightning's
        ``self.log(..., sync_dist=True)`` sends it for int64 to any backend not named "gloo".
        ``summed`` is the sum's call, issued; ``results`` are the tensors it sums into."""
        n, averaged = self.size(), torch.futures.Future()

        def divide(total: torch.futures.Future) -> None:
            try:
                total.value()  # the sum's own error, as the caller would have it from the sum
                for t in results:
                    t.div_(n, rounding_mode="trunc")
            except Exception as exc:  # noqa: BLE001 - wait() raises it
                averaged.set_exception(exc)
                return
            averaged.set_result(results)

        try:
            summed.get_future().add_done_callback(divide)
        except RuntimeError:  # gloo's reduce-scatter Work has none ("Work::getFuture not implemented")
            summed.wait()  # its error, if any, raised here as gloo's own call would at its wait
            divide(_done(results))
        return FutureWork(averaged)

    def _gather_through_switch(self, output: torch.Tensor, input: torch.Tensor) -> dist.Work:
        """All-gather as an int32 sum: each rank's bytes in its own words, zeros in everyone else's."""
        n, rank, nbytes = self.size(), self.rank(), input.numel() * input.element_size()
        words = -(-nbytes // 4)
        buf = torch.zeros(n * words, dtype=torch.int32)
        buf.view(torch.uint8)[rank * words * 4:rank * words * 4 + nbytes] = input.reshape(-1).view(torch.uint8).cpu()

        def place(_: Any) -> list[torch.Tensor]:
            rows = buf.view(torch.uint8).view(n, words * 4)[:, :nbytes]
            output.reshape(-1).view(torch.uint8).copy_(rows.reshape(-1))
            return [output]

        return self._work(output, lambda: self.client.allreduce_async(buf, op="sum", out=buf), place)


def _shut_down(group: weakref.ref[SwitchAggProcessGroup]) -> None:
    """At exit: remove the job of a group still alive (Lightning and accelerate do not destroy theirs)."""
    pg = group()
    if pg is not None:
        pg.shutdown()


def _allreduce_options(opts: Any) -> dist.AllreduceOptions:
    if isinstance(opts, dist.AllreduceOptions):
        return opts
    out = dist.AllreduceOptions()
    if opts is not None:
        out.reduceOp = opts
    return out


def _done(value: Any) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


def _summing(opts: Any, total: Any) -> Any:
    """``total`` (a fresh options object of the call's kind) set to SUM, with ``opts``'s timeout."""
    total.reduceOp, total.timeout = dist.ReduceOp.SUM, opts.timeout
    return total


def _op(reduce_op: Any) -> Any:
    """The RedOpType of a ReduceOp object (as C++ passes it) or of a RedOpType."""
    return getattr(reduce_op, "op", reduce_op)


def _switch_op(reduce_op: Any, tensors: list[torch.Tensor]) -> str | None:
    """The switch's op for this call ("sum", "mean"), or None where the fallback must do it."""
    op = _OPS.get(_op(reduce_op))
    if op is None or not _dense(*tensors):
        return None
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or not dtypes <= _CARRIED or (op == "mean" and torch.int32 in dtypes):
        return None
    return op


def _dense(*tensors: torch.Tensor) -> bool:
    return all(t.is_contiguous() and t.layout == torch.strided and t.device == tensors[0].device
               for t in tensors)
