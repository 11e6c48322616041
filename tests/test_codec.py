"""Block floating point: the documented error bound holds and int32 never overflows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from switchagg import codec
from switchagg.errors import QuantizationError
from switchagg.wire import EXP_NONE

K = 16
_LIM = float(np.float32(1e37))  # 32 workers times this still fits a float32 sum
floats32 = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-_LIM, max_value=_LIM)


def roundtrip(xs: list[np.ndarray], k: int = K):
    """Quantize every worker's vector with agreed exponents, sum in int32 like the switch, dequantize."""
    n = len(xs)
    exps = np.max([codec.propose_exponents(x, k) for x in xs], axis=0)
    out = np.empty(xs[0].size, dtype=np.float32)
    bound = np.empty(xs[0].size)
    for b, e in enumerate(exps):
        sl = slice(b * k, (b + 1) * k)
        q = [codec.quantize(x[sl], int(e), n, k).astype(np.int64) for x in xs]
        total = np.sum(q, axis=0)
        assert np.all(np.abs(total) <= 2**31 - 1), "the int32 sum must never overflow"
        codec.dequantize(total.astype(">i4"), int(e), n, out[sl])
        bound[sl] = codec.error_bound(int(e), n)
    return out, bound


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 32).flatmap(lambda n: st.lists(
    hnp.arrays(np.float32, st.shared(st.integers(1, 50), key="size"), elements=floats32),
    min_size=n, max_size=n)))
def test_sum_is_within_documented_bound(xs):
    out, bound = roundtrip(xs)
    exact = np.sum(np.stack(xs).astype(np.float64), axis=0)
    # n * 0.5 / s from quantization, then one float32 rounding of the result
    assert np.all(np.abs(out.astype(np.float64) - exact) <= bound + np.abs(exact) * 2.0**-23 + 1e-45)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 31, 32])
def test_extremes_fill_but_never_overflow(n):
    top = np.float32(np.nextafter(np.float32(2.0**10), np.float32(0)))  # just below a power of two
    xs = [np.full(K, top, np.float32) for _ in range(n)]
    xs[0][1] = -top
    out, _ = roundtrip(xs)
    assert np.allclose(out[0], n * float(top), rtol=1e-6)


def test_exponents_follow_the_largest_magnitude():
    x = np.array([0.0] * K + [0.75] + [0.0] * (K - 1) + [-3.0, 1.0, 5e-39] + [0.0] * (K - 3), np.float32)
    exps = codec.propose_exponents(x, K)
    assert exps.tolist() == [EXP_NONE, 0, 2]  # 0.75 < 2**0, 3 < 2**2


def test_denormals_and_huge_values():
    tiny = np.full(K, 1e-44, np.float32)
    assert codec.propose_exponents(tiny, K)[0] == codec.MIN_EXPONENT
    out, bound = roundtrip([tiny, tiny])
    assert np.all(np.abs(out - 2e-44) <= bound + 1e-45)
    huge = np.full(K, 2e38, np.float32)  # >= 2**127
    with pytest.raises(QuantizationError, match="2\\*\\*127"):
        codec.propose_exponents(huge, K)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_clear_errors(bad):
    x = np.ones(3 * K, np.float32)
    x[K + 2] = bad
    with pytest.raises(QuantizationError, match="block 1 .*NaN or infinity"):
        codec.propose_exponents(x, K)


def test_zero_blocks_quantize_to_zero():
    z = np.zeros(K, np.float32)
    assert not codec.quantize(z, EXP_NONE, 4, K).any()


def test_tail_block_is_zero_padded():
    x = np.arange(1, 6, dtype=np.float32)
    q = codec.quantize(x, 3, 2, 8)
    assert q[5:].tolist() == [0, 0, 0] and q[0] != 0
