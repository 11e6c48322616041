"""Block floating point: floats in, int32 the switch can add, floats back out.

One exponent per packet (a block of K values), SwitchML style. Each worker
*proposes* ``e`` for a block, the smallest integer with ``max|x| < 2**e``; the
switch keeps the maximum over the job's workers, and every worker then
quantizes the block with the same power-of-two scale::

    s = 2**(31 - e_max - ceil(log2 n))

Because ``|x| < 2**e_max``, each quantized value is below ``2**31 / 2**ceil(log2 n)``
in magnitude, so the sum of ``n`` of them never overflows int32. A power of
two makes ``x * s`` exact in float32, so the only quantization error is the
rounding to an integer: at most ``0.5 / s`` per element and worker, and the
sum of ``n`` contributions is off by at most ``n * 0.5 / s`` before the final
float32 rounding of the result. ``docs/protocol.md`` states the same bound and
the property tests check it. The loops over the values run in :mod:`switchagg._native`
(C, one pass each); ``tests/test_codec.py`` holds them to a plain numpy statement
of this arithmetic, bit for bit.
"""

from __future__ import annotations

import functools

import numpy as np

from . import _native
from .errors import QuantizationError
from .wire import EXP_NONE, Buffer

MIN_EXPONENT = -127  # below this float32 has only denormals; a larger e is still safe
MAX_EXPONENT = 127


def ceil_log2(n: int) -> int:
    """Bits of headroom that a sum over ``n`` workers needs."""
    return (n - 1).bit_length()


@functools.cache
def scale_shift(exponent: int, n_workers: int) -> int:
    """``k`` with scale ``2**k`` for a block whose agreed exponent is ``exponent``."""
    e = MIN_EXPONENT if exponent == EXP_NONE else exponent
    return 31 - e - ceil_log2(n_workers)


def error_bound(exponent: int, n_workers: int) -> float:
    """Largest quantization error of a summed element: ``n * 0.5 / s``."""
    return n_workers * 0.5 * 2.0 ** -scale_shift(exponent, n_workers)


def propose_exponents(flat: np.ndarray, k: int) -> np.ndarray:
    """One proposed exponent per block of ``k`` values of a float32 vector.

    Raises :class:`QuantizationError` on NaN or infinity: a gradient like that
    would otherwise become silent garbage in every worker's sum.
    """
    maxabs = np.empty(-(-flat.size // k), dtype=np.float32)
    bad = _native.block_maxabs(flat, k, maxabs)
    if bad >= 0:
        raise QuantizationError(
            f"block {bad} (elements {bad * k}..{min((bad + 1) * k, flat.size) - 1}) holds NaN "
            "or infinity; fix the computation that produced it (e.g. lower the learning rate "
            "or enable gradient clipping) before reducing")
    exps = np.frexp(maxabs)[1]
    if exps.max(initial=MIN_EXPONENT) > MAX_EXPONENT:
        raise QuantizationError(
            "a value of magnitude >= 2**127 cannot be quantized to int32 blocks; "
            "scale the tensor down before reducing")
    np.maximum(exps, MIN_EXPONENT, out=exps)
    exps[maxabs == 0] = EXP_NONE
    return exps.astype(np.int8)


def quantize(block: np.ndarray, exponent: int, n_workers: int, out: np.ndarray) -> np.ndarray:
    """Float32 ``block`` into ``out``, K big-endian int32 (the packet's values, zero-padded).

    One pass, no temporaries (:mod:`switchagg._native`): ``out`` is usually the
    very buffer the packet is sent from.
    """
    _native.quantize(block, out, scale_shift(exponent, n_workers))
    return out


def dequantize(sums: Buffer, exponent: int, n_workers: int, out: np.ndarray) -> np.ndarray:
    """Summed big-endian int32 into float32 ``out`` (its size picks how many), in one pass."""
    _native.dequantize(sums, out, scale_shift(exponent, n_workers))
    return out


def encode_int32(block: np.ndarray, out: np.ndarray) -> np.ndarray:
    """int32 tensors travel as they are (the switch sums them modulo 2**32): into ``out``, zero-padded."""
    out[: block.size] = block
    out[block.size:] = 0
    return out
