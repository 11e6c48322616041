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
(C, one pass each) on the fastest path the CPU has: AVX-512, AVX2 or scalar, chosen at
import (``SWITCHAGG_CODEC_PATH`` caps it; ``_native.codec_path()`` says which, and
switches). Every path computes the same bits: ``tests/test_codec.py`` holds each to the
scalar one and to a plain numpy statement of this arithmetic.

Non-finite values propagate as allreduce does, and never stop one rank alone
(which would pair its next call with the others' current one). A block holding
NaN, an infinity, or a magnitude of at least ``2**126`` (past the range a block
exponent can scale) proposes :data:`~switchagg.wire.EXP_NONFINITE`, the largest
exponent, so the switch's maximum hands the mark to every rank. A chunk so
marked travels as *class codes* instead of values: ``0`` finite, ``1`` +inf,
``1 << 16`` -inf, ``1 | 1 << 16`` NaN. +inf counts in the low 16 bits and -inf
in the high 16, a NaN in both (as +inf plus -inf would), so the int32 sum of up
to 65,535 contributors' codes keeps both counts exact, with no carry from one
half into the other and no wrap, and an aggregation tree may add partial sums
at any level. A position decodes to +inf or -inf where only that half counted,
and to NaN everywhere else: where both did, and where neither did (every
contributor was finite there, and their finite sum cannot share the packet).
Every rank thus gets inf/NaN in that chunk and finite sums elsewhere, which is
what ``torch.amp.GradScaler`` looks for to skip a step.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import _native
from .wire import EXP_NONE, EXP_NONFINITE, Buffer

MIN_EXPONENT = -127  # below this float32 has only denormals; a larger e is still safe
MAX_EXPONENT = EXP_NONFINITE - 1  # 126: the largest a finite block proposes; 127 is the mark
NONFINITE_FROM = 2.0**MAX_EXPONENT  # a magnitude from here on cannot be scaled: its block is marked
# The class codes of a marked chunk (EXP_NONFINITE): +inf counts in the low 16 bits, -inf in the high
# 16, NaN in both, so the sums of up to 65,535 contributors' codes stay apart (module docstring).
CLASS_POS, CLASS_NEG = 1, 1 << 16
CLASS_NAN = CLASS_POS | CLASS_NEG


def ceil_log2(n: int) -> int:
    """Bits of headroom that a sum over ``n`` workers needs."""
    return (n - 1).bit_length()


@functools.cache
def scale_shift(exponent: int, n_workers: int) -> int:
    """``k`` with scale ``2**k`` for a block whose agreed exponent is ``exponent``."""
    e = MIN_EXPONENT if exponent == EXP_NONE else exponent
    return 31 - e - ceil_log2(n_workers)


def error_bound(exponent: int, n_workers: int) -> float:
    """Largest quantization error of a summed element: ``n * 0.5 / s``; none (inf) for a marked chunk,
    whose positions all decode to inf or NaN."""
    if exponent == EXP_NONFINITE:
        return math.inf
    return n_workers * 0.5 * 2.0 ** -scale_shift(exponent, n_workers)


def propose_exponents(flat: np.ndarray, k: int) -> np.ndarray:
    """One proposed exponent per block of ``k`` values of a float32 vector.

    Never raises for the values: a block holding NaN, an infinity or a magnitude
    of at least ``2**126`` proposes :data:`~switchagg.wire.EXP_NONFINITE`, so that
    every rank's call goes on and gets inf/NaN there (an error raised here, on
    one rank only, would leave the ranks' calls paired wrongly from then on).
    """
    exps = np.empty(-(-flat.size // k), dtype=np.int8)
    _native.propose(flat, k, exps)  # max|x| per block, then its exponent, in one pass (no temporaries)
    return exps


def quantize(block: np.ndarray, exponent: int, n_workers: int, out: np.ndarray) -> np.ndarray:
    """Float32 ``block`` into ``out``, K big-endian int32 (the packet's values, zero-padded).

    One pass, no temporaries (:mod:`switchagg._native`): ``out`` is usually the
    very buffer the packet is sent from. Under :data:`~switchagg.wire.EXP_NONFINITE`
    the values are the block's class codes instead (module docstring).
    """
    if exponent == EXP_NONFINITE:
        _native.encode_nonfinite(block, out)
    else:
        _native.quantize(block, out, scale_shift(exponent, n_workers))
    return out


def dequantize(sums: Buffer, exponent: int, n_workers: int, out: np.ndarray) -> np.ndarray:
    """Summed big-endian int32 into float32 ``out`` (its size picks how many), in one pass.

    Under :data:`~switchagg.wire.EXP_NONFINITE` the sums are class counts, which
    decode to +inf, -inf or NaN (module docstring).
    """
    if exponent == EXP_NONFINITE:
        _native.decode_nonfinite(sums, out)
    else:
        _native.dequantize(sums, out, scale_shift(exponent, n_workers))
    return out


def encode_int32(block: np.ndarray, out: np.ndarray) -> np.ndarray:
    """int32 tensors travel as they are (the switch sums them modulo 2**32): into ``out``, zero-padded."""
    out[: block.size] = block
    out[block.size:] = 0
    return out
