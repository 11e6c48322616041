"""Payloads: how a reduction reads its input's chunks and writes back the sums, for each kind of input.

These adapt :mod:`switchagg.codec` to :class:`switchagg.protocol.Payloads` for numpy vectors (and
torch tensors on the CPU, which :mod:`switchagg.torch_payloads` lends as numpy vectors);
:class:`~switchagg.torch_payloads.TorchPayloads` has the same shape for tensors that stay on the GPU.
:func:`switchagg.client.payloads_of` is the one place that looks at what a caller passed and
picks between them. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import codec
from .wire import VALUE_DTYPE, Buffer

_FLOATS = {"float32", "float16", "float64", "bfloat16"}


class FloatPayloads:
    """A float32 vector quantized chunk by chunk with the agreed block exponents."""

    def __init__(self, flat: np.ndarray, out: np.ndarray, k: int, n_workers: int) -> None:
        self.flat, self.out, self.k, self.n = flat, out, k, n_workers
        self._proposals = codec.propose_exponents(flat, k)

    def proposals(self) -> np.ndarray:
        return self._proposals

    def encode(self, chunk: int, exponent: int, out: np.ndarray) -> None:
        codec.quantize(self.flat[chunk * self.k:(chunk + 1) * self.k], exponent, self.n, out)

    def decode(self, chunk: int, exponent: int, sums: Buffer) -> None:
        codec.dequantize(sums, exponent, self.n, self.out[chunk * self.k:(chunk + 1) * self.k])


class Int32Payloads:
    """An int32 vector, sent as it is and summed modulo 2**32."""

    def __init__(self, flat: np.ndarray, out: np.ndarray, k: int) -> None:
        self.flat, self.out, self.k = flat, out, k

    def proposals(self) -> None:
        return None

    def encode(self, chunk: int, exponent: int, out: np.ndarray) -> None:
        codec.encode_int32(self.flat[chunk * self.k:(chunk + 1) * self.k], out)

    def decode(self, chunk: int, exponent: int, sums: Buffer) -> None:
        part = self.out[chunk * self.k:(chunk + 1) * self.k]
        part[:] = np.frombuffer(sums, VALUE_DTYPE, count=part.size)


@dataclass
class Prepared:
    """An allreduce's input made ready: its payloads, how many chunks, and what turns the sums into the result.

    ``native`` says whether the C stream can drive the payloads (the numpy ones); a tensor on a GPU
    takes the Python state machine, whose codec is torch's. ``length`` (values) and ``kind``
    ("float" or "int32") are what the call's descriptor tells the peers (:mod:`switchagg.calls`).
    """

    payloads: Any
    n_chunks: int
    finish: Callable[[], Any]
    native: bool
    length: int
    kind: str


def check_op(op: str) -> None:
    if op not in ("sum", "mean"):
        raise ValueError(f"op={op!r}: use 'sum' or 'mean'")


def array_payloads(x: Any, k: int, n_workers: int, op: str, out: Any = None) -> Prepared:
    """The payloads of ``x`` (a numpy array, or anything numpy takes) for an allreduce of ``op``
    ("sum" or "mean") among ``n_workers``, K = ``k``.

    Raises here, in the caller, on what cannot be reduced: an unsupported dtype or op.
    """
    arr = np.asarray(x)
    shape, dtype = arr.shape, arr.dtype

    def restore(result: np.ndarray, out: Any) -> np.ndarray:
        shaped = result.reshape(shape)
        if out is None:
            return shaped.astype(dtype, copy=False)
        if not np.may_share_memory(out, shaped):  # not already written in place
            np.copyto(out, shaped, casting="unsafe")
        return out

    flat = arr.reshape(-1)
    if arr.dtype.name == "bfloat16":
        flat = flat.astype(np.float32)
    return flat_payloads(flat, restore, arr.dtype.name, k, n_workers, op, out)


def flat_payloads(flat: np.ndarray, restore: Callable[[np.ndarray, Any], Any], dtype_name: str, k: int,
                  n_workers: int, op: str, out: Any = None) -> Prepared:
    """The payloads of a flat vector whose caller's type was ``dtype_name``; ``restore`` turns the
    sums back into that type (into ``out`` if given)."""
    check_op(op)
    kind = kind_of(dtype_name)
    if op == "mean" and kind != "float":
        raise ValueError("op='mean' needs a floating-point tensor; int32 supports op='sum'")
    if kind == "float":
        flat = np.ascontiguousarray(flat, dtype=np.float32)
        result = _result_buffer(out, flat)
        payloads: FloatPayloads | Int32Payloads = FloatPayloads(flat, result, k, n_workers)
    else:
        flat = np.ascontiguousarray(flat, dtype=np.int32)
        result = np.empty_like(flat)
        payloads = Int32Payloads(flat, result, k)

    def finish() -> Any:
        if op == "mean":
            np.divide(result, n_workers, out=result)
        return restore(result, out)

    return Prepared(payloads, -(-flat.size // k), finish, native=True, length=flat.size, kind=kind)


def kind_of(dtype_name: str) -> str:
    """How a dtype travels: "float" (quantized with block exponents) or "int32" (as it is)."""
    if dtype_name in _FLOATS:
        return "float"
    if dtype_name == "int32":
        return "int32"
    raise TypeError(f"cannot allreduce dtype {dtype_name}: use float32, float16, bfloat16, "
                    "float64 (reduced at float32 precision) or int32")


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor, without importing torch."""
    return type(x).__module__.startswith("torch")


def _result_buffer(out: Any, flat: np.ndarray) -> np.ndarray:
    """Where the float32 sums go: straight into ``out`` when it can hold them.

    That saves a pass and an allocation (memory the process never touched costs a
    page fault per 4 KiB, more than the codec's pass over it). ``out`` may be the
    input itself: a chunk is read for the last time before its sum is written
    (retransmissions end with the result), so summing in place is safe; any other
    overlap is not.
    """
    if is_tensor(out) and out.device.type == "cpu" and str(out.dtype) == "torch.float32":
        out = out.detach().numpy()  # the tensor's own memory
    if (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.flags.c_contiguous
            and out.size == flat.size and (not np.may_share_memory(out, flat) or _same_memory(out, flat))):
        return out.reshape(-1)
    return np.empty_like(flat)


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.nbytes == b.nbytes
