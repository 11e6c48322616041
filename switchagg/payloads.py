"""Numpy payloads: how a reduction reads a flat vector's chunks and writes back the sums.

These adapt :mod:`switchagg.codec` to :class:`switchagg.protocol.Payloads`; the
torch module has the same shape for tensors that stay on the GPU.
"""

from __future__ import annotations

import numpy as np

from . import codec
from .wire import VALUE_DTYPE, Buffer


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
