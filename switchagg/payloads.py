"""Payloads: how a reduction reads its input's chunks and writes back the sums, for each kind of input.

These adapt :mod:`switchagg.codec` to :class:`switchagg.protocol.Payloads` for numpy vectors (and
torch tensors on the CPU, which :mod:`switchagg.torch_payloads` lends as numpy vectors);
:class:`~switchagg.torch_payloads.TorchPayloads` has the same shape for tensors that stay on the GPU.
:func:`switchagg.client.payloads_of` is the one place that looks at what a caller passed and
picks between them. Nothing here imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import codec
from .calls import Layout
from .wire import VALUE_DTYPE, Buffer

_FLOATS = {"float32", "float16", "float64", "bfloat16"}


class FloatPayloads:
    """A float32 vector quantized chunk by chunk with the agreed block exponents.

    ``layout`` says which values each chunk carries and where its sums go in ``out`` (an allreduce's
    by default: chunk c is values [cK, cK + K) of both); a reduce-scatter's ``out`` is the shard.
    """

    stream_proposes = True  # the C stream may propose each chunk itself as it sends it (one read of the input)

    def __init__(self, flat: np.ndarray, out: np.ndarray, k: int, n_workers: int, layout: Layout | None = None) -> None:
        self.flat, self.out, self.k, self.n = flat, out, k, n_workers
        self.layout = layout or Layout(k, flat.size)
        self._proposals: np.ndarray | None = None  # made when asked: the C stream makes its own as it sends

    def proposals(self) -> np.ndarray:
        if self._proposals is None:
            self._proposals = proposals_of(self.flat, self.layout)
        return self._proposals

    def encode(self, chunk: int, exponent: int, out: np.ndarray) -> None:
        start, stop = self.layout.source(chunk)
        codec.quantize(self.flat[start:stop], exponent, self.n, out)

    def decode(self, chunk: int, exponent: int, sums: Buffer) -> None:
        start, stop = self.layout.target(chunk)
        codec.dequantize(sums, exponent, self.n, self.out[start:stop])


def proposals_of(flat: np.ndarray, layout: Layout) -> np.ndarray:
    """Each data chunk's proposed exponent: one per block of K values of each shard (each shard's last
    block short, as its chunk is)."""
    if layout.shards == 1:
        return codec.propose_exponents(flat, layout.k)
    shard = layout.shard
    return np.concatenate([codec.propose_exponents(flat[r * shard:(r + 1) * shard], layout.k)
                           for r in range(layout.shards)])


class Int32Payloads:
    """An int32 vector, sent as it is and summed modulo 2**32 (``layout`` as :class:`FloatPayloads`'s)."""

    def __init__(self, flat: np.ndarray, out: np.ndarray, k: int, layout: Layout | None = None) -> None:
        self.flat, self.out, self.k = flat, out, k
        self.layout = layout or Layout(k, flat.size)

    def proposals(self) -> None:
        return None

    def encode(self, chunk: int, exponent: int, out: np.ndarray) -> None:
        start, stop = self.layout.source(chunk)
        codec.encode_int32(self.flat[start:stop], out)

    def decode(self, chunk: int, exponent: int, sums: Buffer) -> None:
        start, stop = self.layout.target(chunk)
        part = self.out[start:stop]
        part[:] = np.frombuffer(sums, VALUE_DTYPE, count=part.size)


@dataclass
class Prepared:
    """A call's input made ready: its payloads, its chunks' layout, and what turns the sums into the result.

    The C stream drives every kind of payloads: the numpy ones, and a GPU tensor's
    (:class:`~switchagg.protocol.StagedPayloads`). ``length`` (values), ``kind`` ("float" or "int32")
    and the layout's collective are what the call's descriptor tells the peers (:mod:`switchagg.calls`).
    """

    payloads: Any
    layout: Layout
    finish: Callable[[], Any]
    length: int
    kind: str

    @property
    def n_chunks(self) -> int:
        return self.layout.n_chunks


def check_op(op: str) -> None:
    if op not in ("sum", "mean"):
        raise ValueError(f"op={op!r}: use 'sum' or 'mean'")


@dataclass(frozen=True)
class Request:
    """What a caller asked for: the job's K and ranks, the op, the collective, and the asking rank
    (whose shard a reduce-scatter hands back)."""

    k: int
    n_workers: int
    op: str = "sum"
    collective: str = "allreduce"
    rank: int = 0

    @property
    def scatter(self) -> bool:
        return self.collective == "reduce_scatter"

    def layout(self, length: int) -> Layout:
        """The chunks of a call of ``length`` values; raises where a reduce-scatter's length does not divide."""
        return Layout.of(length, self.k, self.n_workers, self.collective)

    def result_shape(self, shape: tuple[int, ...], out: Any) -> tuple[int, ...]:
        """The result's shape: an allreduce's is the input's; a reduce-scatter's is its shard, flat, or
        ``out``'s shape where given (raising here where ``out`` does not hold the shard's values)."""
        if not self.scatter:
            return shape
        shard = math.prod(shape) // self.n_workers
        if out is None:
            return (shard,)
        if _numel(out) != shard:
            raise ValueError(f"out holds {_numel(out)} values, but this rank's shard of the reduce_scatter has "
                             f"{shard} (the input's {math.prod(shape)} over {self.n_workers} ranks)")
        return tuple(out.shape)


def array_payloads(x: Any, request: Request, out: Any = None) -> Prepared:
    """The payloads of ``x`` (a numpy array, or anything numpy takes) for the call ``request`` asks.

    Raises here, in the caller, on what cannot be reduced: an unsupported dtype or op, a
    reduce-scatter's length that the ranks do not divide, an ``out`` of the wrong size.
    """
    arr = np.asarray(x)
    dtype = arr.dtype

    def restore(result: np.ndarray, out: Any) -> np.ndarray:
        if out is None:
            return result.astype(dtype, copy=False)
        if not np.may_share_memory(out, result):  # not already written in place
            np.copyto(out, result, casting="unsafe")
        return out

    flat = arr.reshape(-1)
    if arr.dtype.name == "bfloat16":
        flat = flat.astype(np.float32)
    return flat_payloads(flat, arr.shape, restore, arr.dtype.name, request, out)


def flat_payloads(flat: np.ndarray, shape: tuple[int, ...], restore: Callable[[np.ndarray, Any], Any],
                  dtype_name: str, request: Request, out: Any = None) -> Prepared:
    """The payloads of a flat vector whose caller's type was ``dtype_name`` and shape ``shape``;
    ``restore`` turns the sums, shaped as the result, back into that type (into ``out`` if given)."""
    check_op(request.op)
    kind = kind_of(dtype_name)
    if request.op == "mean" and kind != "float":
        raise ValueError("op='mean' needs a floating-point tensor; int32 supports op='sum'")
    layout = request.layout(flat.size)
    result_shape = request.result_shape(shape, out)
    own = slice(request.rank * layout.shard, (request.rank + 1) * layout.shard) if layout.scatter else slice(None)
    if kind == "float":
        flat = np.ascontiguousarray(flat, dtype=np.float32)
        result = _result_buffer(out, flat, flat[own])
        payloads: FloatPayloads | Int32Payloads = FloatPayloads(flat, result, request.k, request.n_workers, layout)
    else:
        flat = np.ascontiguousarray(flat, dtype=np.int32)
        result = np.empty(layout.shard if layout.scatter else flat.size, np.int32)
        payloads = Int32Payloads(flat, result, request.k, layout)

    def finish() -> Any:
        if request.op == "mean":
            np.divide(result, request.n_workers, out=result)
        return restore(result.reshape(result_shape), out)

    return Prepared(payloads, layout, finish, length=flat.size, kind=kind)


def kind_of(dtype_name: str) -> str:
    """How a dtype travels: "float" (quantized with block exponents) or "int32" (as it is)."""
    if dtype_name in _FLOATS:
        return "float"
    if dtype_name == "int32":
        return "int32"
    raise TypeError(f"cannot reduce dtype {dtype_name}: use float32, float16, bfloat16, "
                    "float64 (reduced at float32 precision) or int32")


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor, without importing torch."""
    return type(x).__module__.startswith("torch")


def _result_buffer(out: Any, flat: np.ndarray, own: np.ndarray) -> np.ndarray:
    """Where the float32 sums go: straight into ``out`` when it can hold them.

    That saves a pass and an allocation (memory the process never touched costs a
    page fault per 4 KiB, more than the codec's pass over it). ``own`` is the part of the input
    ``flat`` whose sums this rank receives (all of it, but for a reduce-scatter's shard), and
    ``out`` may be that part itself: a chunk is read for the last time before its sum is written
    (retransmissions end with the result), so summing in place is safe; any other overlap with
    the input is not.
    """
    if is_tensor(out) and out.device.type == "cpu" and str(out.dtype) == "torch.float32":
        out = out.detach().numpy()  # the tensor's own memory
    if (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.flags.c_contiguous
            and out.size == own.size and (not np.may_share_memory(out, flat) or _same_memory(out, own))):
        return out.reshape(-1)
    return np.empty_like(own)


def _numel(x: Any) -> int:
    """Values in an array or a tensor."""
    return x.numel() if is_tensor(x) else int(np.size(x))


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.nbytes == b.nbytes
