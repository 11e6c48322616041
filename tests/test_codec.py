"""Block floating point: the documented error bound holds, int32 never overflows, the C kernels
compute exactly the documented arithmetic (a plain numpy statement of it, here), and non-finite
values mark their chunk, which every rank then decodes to the same inf/NaN."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from switchagg import _native, codec
from switchagg.protocol import NativeReduction
from switchagg.switch.model import SwitchModel
from switchagg.wire import EXP_NONE, EXP_NONFINITE, MAX_WORKERS, VALUE_DTYPE, unpack_header

from . import simnet
from .simnet import Impairment, Job, SimNet

K = 16
_LIM = float(np.float32(1e37))  # 32 workers times this still fits a float32 sum
floats32 = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-_LIM, max_value=_LIM)


def quantized(block: np.ndarray, exponent: int, n: int, k: int) -> np.ndarray:
    return codec.quantize(block, exponent, n, np.empty(k, VALUE_DTYPE))


def roundtrip(xs: list[np.ndarray], k: int = K):
    """Quantize every worker's vector with agreed exponents, sum in int32 like the switch, dequantize."""
    n = len(xs)
    exps = np.max([codec.propose_exponents(x, k) for x in xs], axis=0)
    out = np.empty(xs[0].size, dtype=np.float32)
    bound = np.empty(xs[0].size)
    for b, e in enumerate(exps):
        sl = slice(b * k, (b + 1) * k)
        q = [quantized(x[sl], int(e), n, k).astype(np.int64) for x in xs]
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
    below = np.full(K, np.nextafter(np.float32(2.0**126), np.float32(0)), np.float32)
    assert codec.propose_exponents(below, K)[0] == codec.MAX_EXPONENT == 126  # the largest finite proposal
    out, bound = roundtrip([below, -below, below])
    assert np.all(np.abs(out.astype(np.float64) - float(below[0])) <= bound)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 2.0**126, -(2.0**127), 3e38, -np.float32(np.nan)])
def test_a_block_with_nonfinite_or_unscalable_values_proposes_the_mark(bad):
    """No error on one rank alone (that would shift every later call's pairing): the block is marked,
    and the switch's maximum over the proposals carries the mark to every rank."""
    x = np.ones(3 * K + 5, np.float32)
    x[K + 2] = bad
    x[3 * K + 4] = bad  # the short last block too
    x[2 * K:3 * K] = 0
    assert codec.propose_exponents(x, K).tolist() == [1, EXP_NONFINITE, EXP_NONE, EXP_NONFINITE]
    assert np.max([codec.propose_exponents(np.ones_like(x), K), codec.propose_exponents(x, K)],
                  axis=0).tolist()[1] == EXP_NONFINITE


def test_nan_in_a_block_is_marked_whatever_else_it_holds():
    """block_maxabs compares bit patterns, so a NaN wins over an infinity and over any number."""
    x = np.array([np.inf, np.nan, -3.0, 1e-40], np.float32)
    for order in ([0, 1, 2, 3], [1, 0, 3, 2], [2, 3, 1, 0]):
        maxabs = np.empty(1, np.float32)
        _native.block_maxabs(x[order], 4, maxabs)
        assert np.isnan(maxabs[0])
    assert codec.propose_exponents(x, 4).tolist() == [EXP_NONFINITE]


def test_a_marked_chunk_has_no_error_bound():
    assert codec.error_bound(EXP_NONFINITE, 4) == np.inf and codec.error_bound(codec.MAX_EXPONENT, 4) < np.inf


def test_zero_blocks_quantize_to_zero():
    z = np.zeros(K, np.float32)
    assert not quantized(z, EXP_NONE, 4, K).any()


def test_tail_block_is_zero_padded():
    x = np.arange(1, 6, dtype=np.float32)
    q = codec.quantize(x, 3, 2, np.full(8, -1, VALUE_DTYPE))
    assert q[5:].tolist() == [0, 0, 0] and q[0] != 0


# ---- the kernels against the arithmetic as numpy states it ------------------------------------------


def _times_pow2(x: np.ndarray, k: int) -> np.ndarray:
    if -126 <= k <= 127:
        return x * np.float32(2.0**k)
    return np.ldexp(x, np.int32(k)).astype(np.float32)


def reference_quantize(block: np.ndarray, exponent: int, n: int, k: int) -> np.ndarray:
    wire = np.zeros(k, VALUE_DTYPE)
    wire[: block.size] = np.rint(_times_pow2(block, codec.scale_shift(exponent, n))).astype(np.int32)
    return wire


def reference_dequantize(sums: np.ndarray, exponent: int, n: int) -> np.ndarray:
    return _times_pow2(sums.astype(np.float32), -codec.scale_shift(exponent, n))


def reference_exponents(x: np.ndarray, k: int) -> np.ndarray:
    maxabs = np.array([np.abs(x[i:i + k]).max() for i in range(0, x.size, k)], np.float32)
    exps = np.clip(np.frexp(maxabs)[1], codec.MIN_EXPONENT, 126)
    exps[maxabs == 0] = EXP_NONE
    exps[np.isnan(maxabs) | (maxabs >= 2.0**126)] = EXP_NONFINITE
    return exps


def reference_encode_nonfinite(block: np.ndarray, k: int) -> np.ndarray:
    """The class codes of a marked chunk: 1 for +inf or >= 2**126, 1 << 16 for -inf or <= -2**126,
    1 | 1 << 16 for NaN, 0 for the rest and for the padding."""
    with np.errstate(invalid="ignore"):
        codes = ((block >= 2.0**126) * 1 + (block <= -(2.0**126)) * (1 << 16) + np.isnan(block) * (1 | 1 << 16))
    wire = np.zeros(k, VALUE_DTYPE)
    wire[: block.size] = codes
    return wire


def reference_decode_nonfinite(sums: np.ndarray) -> np.ndarray:
    """Counts into floats: an infinity where only that sign's half was counted, NaN everywhere else."""
    sums = sums.astype(np.int64) & 0xFFFFFFFF  # the int32 as the 32 bits the switch summed
    pos, neg = (sums & 0xFFFF) > 0, (sums >> 16) > 0
    out = np.full(sums.size, np.nan, np.float32)
    out[pos & ~neg] = np.inf
    out[neg & ~pos] = -np.inf
    return out


# Magnitudes from denormals to 2**120 (32 of them still sum to a float32), so every branch of the
# scaling is taken.
wide = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-2.0**120, max_value=2.0**120)


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 40), elements=wide), st.integers(1, 32), st.integers(0, 3),
       st.integers(0, 2), st.integers(0, 3))
def test_kernels_match_the_numpy_arithmetic_bit_for_bit(block, n, pad, raise_by, offset):
    k = block.size + pad
    (e,) = codec.propose_exponents(block, k).tolist()
    if e != EXP_NONE:
        e = min(e + raise_by, codec.MAX_EXPONENT)  # any agreed exponent at least the proposal
    # the values may lie at any byte offset, as they do in a receive buffer
    raw = np.zeros(4 * k + offset, np.uint8)
    wire = raw[offset:].view(VALUE_DTYPE)
    codec.quantize(block, e, n, wire)
    assert np.array_equal(wire, reference_quantize(block, e, n, k))
    summed = (wire.astype(np.int64) * n).astype(np.int32).astype(VALUE_DTYPE)
    out = np.empty(block.size, np.float32)
    codec.dequantize(summed, e, n, out)
    assert np.array_equal(out.view(np.uint32), reference_dequantize(summed[: block.size], e, n).view(np.uint32))


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 200), elements=wide), st.integers(1, 64))
def test_block_exponents_match_numpy(x, k):
    assert codec.propose_exponents(x, k).tolist() == reference_exponents(x, k).tolist()


# Every float32 bit pattern (NaNs of any sign and payload, infinities, the top binade, denormals),
# mostly ordinary values, so that marked and unmarked blocks both come up.
any_bits = st.one_of(st.integers(0, 2**32 - 1),
                     st.sampled_from([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7E800000, 0xFE800000,
                                      0x7E7FFFFF, 0xFE7FFFFF, 0x7F7FFFFF,
                                      # the exponents' edges below: 2**-126, 2**-127 and their neighbours
                                      0x00800000, 0x007FFFFF, 0x00400000, 0x803FFFFF, 0x00000001, 0x80000000]),
                     st.floats(-1e6, 1e6, width=32).map(lambda f: int(np.float32(f).view(np.uint32))))


def bits_array(size) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.uint32, size, elements=any_bits).map(lambda a: a.view(np.float32))


@settings(max_examples=100, deadline=None)
@given(bits_array(st.integers(1, 200)), st.integers(1, 64))
def test_block_exponents_match_numpy_for_any_bits(x, k):
    assert codec.propose_exponents(x, k).tolist() == reference_exponents(x, k).tolist()


@settings(max_examples=300, deadline=None)
@given(bits_array(st.integers(0, 40)), st.integers(0, 3), st.integers(0, 3))
def test_class_codes_match_the_numpy_statement_bit_for_bit(block, pad, offset):
    k = block.size + pad
    raw = np.full(4 * k + offset, 0xAB, np.uint8)  # at any byte offset, as in a send buffer
    wire = raw[offset:].view(VALUE_DTYPE)
    codec.quantize(block, EXP_NONFINITE, 3, wire)
    assert np.array_equal(wire, reference_encode_nonfinite(block, k))  # the padding included


@settings(max_examples=300, deadline=None)
@given(st.integers(1, MAX_WORKERS).flatmap(lambda n: st.lists(
    bits_array(st.shared(st.integers(1, 40), key="size")), min_size=n, max_size=n)), st.integers(0, 3))
def test_summed_class_codes_decode_as_the_numpy_statement(xs, offset):
    """n workers' codes, summed in int32 like the switch, decode bit for bit as numpy states it,
    into the same NaN (0x7fc00000) on every machine."""
    k = xs[0].size
    total = np.sum([codec.quantize(x, EXP_NONFINITE, len(xs), np.empty(k, VALUE_DTYPE)) for x in xs], axis=0)
    raw = np.zeros(4 * k + offset, np.uint8)
    sums = raw[offset:].view(VALUE_DTYPE)
    sums[:] = total
    out = np.empty(k, np.float32)
    codec.dequantize(sums, EXP_NONFINITE, len(xs), out)
    assert np.array_equal(out.view(np.uint32), reference_decode_nonfinite(total).view(np.uint32))
    assert set(out[np.isnan(out)].view(np.uint32).tolist()) <= {0x7FC00000}


def _classes(**counts: int) -> np.ndarray:
    """One position's summed code: counts of +inf, -inf and NaN contributors, wrapped to int32 as summed."""
    total = counts.get("pos", 0) + (counts.get("neg", 0) << 16) + counts.get("nan", 0) * (1 | 1 << 16)
    return np.array([total], np.uint32).astype(VALUE_DTYPE)


@pytest.mark.parametrize(("counts", "expected"), [
    ({}, np.nan),  # every worker finite: the finite sum was not carried
    ({"pos": 1}, np.inf),
    ({"pos": MAX_WORKERS}, np.inf),
    ({"neg": 3}, -np.inf),
    ({"neg": MAX_WORKERS}, -np.inf),
    ({"nan": 1}, np.nan),
    ({"nan": MAX_WORKERS}, np.nan),
    ({"pos": 1, "neg": 1}, np.nan),  # inf + -inf
    ({"pos": 2, "nan": 1}, np.nan),
    ({"neg": 1, "nan": 1}, np.nan),
    ({"pos": 10, "neg": 11, "nan": 11}, np.nan),
    ({"pos": 256}, np.inf),  # one byte per class carried here
    ({"neg": 256}, -np.inf),
    ({"pos": 65_535}, np.inf),  # the most contributors the halves count
    ({"neg": 65_535}, -np.inf),  # the sum's sign bit set: negative as int32
    ({"nan": 65_535}, np.nan),  # all 32 bits set
    ({"pos": 65_534, "nan": 1}, np.nan),
    ({"neg": 65_534, "nan": 1}, np.nan),
])
def test_decode_rules(counts, expected):
    out = codec.dequantize(_classes(**counts), EXP_NONFINITE, MAX_WORKERS, np.empty(1, np.float32))
    assert out.view(np.uint32)[0] == np.float32(expected).view(np.uint32)


# Per position, how many contributors hold +inf, -inf and NaN (the rest are finite), and what the
# position decodes to. 256 of a sign is where one byte per class carried into the next class.
MANY_CONTRIBUTORS = [
    (lambda n: (0, 0, 0), np.nan),  # every contributor finite: the finite sum was not carried
    (lambda n: (n, 0, 0), np.inf),
    (lambda n: (0, n, 0), -np.inf),
    (lambda n: (0, 0, n), np.nan),
    (lambda n: (256, 0, 0), np.inf),
    (lambda n: (0, 256, 0), -np.inf),
    (lambda n: (n - 1, 1, 0), np.nan),  # inf + -inf
    (lambda n: (1, n - 1, 0), np.nan),
    (lambda n: (n - 1, 0, 1), np.nan),
    (lambda n: (0, n - 1, 1), np.nan),
]


def many_contributors(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` contributors' values, one row each, laid out per :data:`MANY_CONTRIBUTORS`, and what each
    position decodes to. Every other infinity is a magnitude of at least 2**126, which counts as one."""
    x = np.ones((n, len(MANY_CONTRIBUTORS)), np.float32)
    for j, (counts, _) in enumerate(MANY_CONTRIBUTORS):
        pos, neg, nan = counts(n)
        x[:pos, j] = np.inf
        x[:pos:2, j] = 2.0**126
        x[pos:pos + neg, j] = -np.inf
        x[pos:pos + neg:2, j] = -(2.0**127)
        x[pos + neg:pos + neg + nan, j] = np.nan
    return x, np.array([expected for _, expected in MANY_CONTRIBUTORS], np.float32)


def tree_sum(codes: np.ndarray, fan_in: int = MAX_WORKERS) -> np.ndarray:
    """Rows of int32 summed as an aggregation tree sums them: ``fan_in`` at a time, level by level, each
    sum in int32 wrapping as the switch's does."""
    while len(codes) > 1:
        codes = np.concatenate([codes, np.zeros((-len(codes) % fan_in, codes.shape[1]), np.int32)])
        codes = codes.reshape(-1, fan_in, codes.shape[1]).sum(axis=1, dtype=np.int32)
    return codes[0]


@pytest.mark.parametrize("n", [300, 1024, 65_535])
def test_class_codes_of_up_to_65535_contributors_decode_right(n):
    """A tree sums the codes of up to 65,535 contributors: each class's count must stay in its own half of
    the int32 sum (one byte per class carried from 256 on), flat or summed level by level."""
    x, expected = many_contributors(n)
    codes = codec.quantize(x.reshape(-1), EXP_NONFINITE, n, np.empty(x.size, VALUE_DTYPE))  # elementwise
    codes = codes.astype(np.int32).reshape(x.shape)
    for total in (codes.sum(axis=0, dtype=np.int32), tree_sum(codes)):
        out = codec.dequantize(total.astype(VALUE_DTYPE), EXP_NONFINITE, n, np.empty(total.size, np.float32))
        assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))


def test_marked_chunks_reach_every_rank_and_the_rest_stay_finite():
    """Four ranks, one with an inf, one with a NaN, one with a huge value, in different blocks: every
    rank decodes the same result, inf/NaN in the marked chunks' positions, bounded sums elsewhere."""
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(5 * K + 3).astype(np.float32) for _ in range(4)]
    xs[0][3] = np.inf  # chunk 0: only +inf
    xs[1][K + 1] = np.nan  # chunk 1: NaN
    xs[2][2 * K] = -(2.0**127)  # chunk 2: only "-inf", from a value past the range
    xs[3][5 * K + 2] = np.inf  # the short last chunk: +inf and ...
    xs[0][5 * K + 2] = -np.inf  # ... -inf at the same position
    out, bound = roundtrip(xs)
    exps = np.max([codec.propose_exponents(x, K) for x in xs], axis=0)
    assert exps[[0, 1, 2, 5]].tolist() == [EXP_NONFINITE] * 4 and max(exps[3:5]) <= codec.MAX_EXPONENT
    expected = np.full(out.size, np.nan, np.float32)
    expected[3] = np.inf
    expected[2 * K] = -np.inf
    finite = slice(3 * K, 5 * K)
    exact = np.sum([x[finite].astype(np.float64) for x in xs], axis=0)
    expected[finite] = exact
    assert np.array_equal(np.isnan(out), np.isnan(expected))
    assert out[3] == np.inf and out[2 * K] == -np.inf and np.isnan(out[5 * K + 2])
    assert np.all(np.abs(out[finite] - exact) <= bound[finite] + np.abs(exact) * 2.0**-23)
    assert np.all(bound[:3 * K] == np.inf) and np.all(bound[5 * K:] == np.inf)


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.int32, st.integers(1, 40)), hnp.arrays(np.int32, st.integers(1, 40)))
def test_switch_add_wraps_like_int32(a, b):
    size = min(a.size, b.size)
    acc = a[:size].astype(VALUE_DTYPE)
    _native.add_be(acc, b[:size].astype(VALUE_DTYPE))
    assert np.array_equal(acc, (a[:size].astype(np.int64) + b[:size]).astype(np.int32))


def test_kernels_refuse_buffers_that_do_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        codec.quantize(np.ones(9, np.float32), 1, 2, np.empty(8, VALUE_DTYPE))
    with pytest.raises(ValueError, match="cannot fill"):
        codec.dequantize(np.ones(4, VALUE_DTYPE), 1, 2, np.empty(8, np.float32))
    with pytest.raises(ValueError, match="encode_nonfinite: .*do not fit"):
        codec.quantize(np.ones(9, np.float32), EXP_NONFINITE, 2, np.empty(8, VALUE_DTYPE))
    with pytest.raises(ValueError, match="decode_nonfinite: .*cannot fill"):
        codec.dequantize(np.ones(4, VALUE_DTYPE), EXP_NONFINITE, 2, np.empty(8, np.float32))
    with pytest.raises(ValueError, match="added"):
        _native.add_be(np.zeros(4, VALUE_DTYPE), np.zeros(3, VALUE_DTYPE))
    frozen = np.zeros(4, VALUE_DTYPE)
    frozen.setflags(write=False)
    with pytest.raises((BufferError, ValueError), match="read-only|not writable"):
        codec.quantize(np.ones(4, np.float32), 1, 2, frozen)


# ---- every path of the loops, forced one at a time ----------------------------------------------------

PATHS = ("scalar", "avx2", "avx512")


def runs(name: str) -> None:
    """Skip, saying why, where this CPU cannot run path ``name``: never a pass that ran nothing."""
    if name not in _native.codec_paths():
        pytest.skip(f"this CPU cannot run the codec's {name} loops (it runs {', '.join(_native.codec_paths())})")


@contextlib.contextmanager
def forced(name: str):
    """The codec's loops switched to path ``name`` for the whole process, and back to what was chosen."""
    chosen = _native.codec_path()
    _native.codec_path(name)
    try:
        yield
    finally:
        _native.codec_path(chosen)


@pytest.fixture(params=PATHS)
def path(request) -> str:
    runs(request.param)
    return request.param


def raised(e: int) -> int:
    """An agreed exponent above this rank's proposal (another rank's was larger), as quantization meets them."""
    return e if e in (EXP_NONE, EXP_NONFINITE) else min(e + 1, codec.MAX_EXPONENT)


def every_kernel(block: np.ndarray, nxt: np.ndarray, sums: np.ndarray, n: int, shift: int, offset: int,
                 skew: int = 0) -> dict:
    """What each kernel makes of these inputs on the path in use, as bytes: maxima and exponents, the
    block quantized (class codes where it is marked), sums dequantized (also at ``shift``, which may be
    past a float32 scale, and as the stream stores them, past the cache, ``skew`` floats into a cache
    line) and decoded as class counts, the switch's add, and quantize_propose's proposal and values.
    The wire side lies at byte ``offset``, as in a packet buffer."""
    k = block.size + 3
    wire = np.zeros(4 * k + offset, np.uint8)[offset:].view(VALUE_DTYPE)
    e = raised(int(codec.propose_exponents(block, k)[0])) if block.size else EXP_NONE
    out = np.empty(sums.size, np.float32)
    got = {"propose": codec.propose_exponents(block, 7).tobytes() + codec.propose_exponents(nxt, 16).tobytes(),
           "quantize": codec.quantize(block, e, n, wire).tobytes(),
           "dequantize": codec.dequantize(sums, e, n, out).tobytes(),
           "decode": codec.dequantize(sums, EXP_NONFINITE, n, out).tobytes()}
    _native.dequantize(sums, out, shift)
    got["dequantize_shift"] = out.tobytes()
    lines = np.full(sums.size + 32, np.nan, np.float32)
    at = (-lines.ctypes.data % 64) // 4 + skew
    _native.dequantize(sums, lines[at:at + sums.size], shift, True)
    around = np.concatenate([lines[:at], lines[at + sums.size:]])
    got["dequantize_past_cache"] = (lines[at:at + sums.size].tobytes(), bool(np.isnan(around).all()))
    acc = sums.copy()
    _native.add_be(acc, sums[::-1].copy())
    got["add_be"] = acc.tobytes()
    if block.size:
        maxabs = np.empty(1, np.float32)
        _native.block_maxabs(block, block.size, maxabs)
        got["maxabs"] = maxabs.tobytes()
    if e not in (EXP_NONE, EXP_NONFINITE):
        wire[:] = -1
        proposal = _native.quantize_propose(block, wire, codec.scale_shift(e, n), nxt)
        got["quantize_propose"] = (proposal, wire.tobytes())
    return got


def numpy_kernels(block: np.ndarray, nxt: np.ndarray, sums: np.ndarray, n: int, shift: int) -> dict:
    """every_kernel's results as the numpy statement of the arithmetic makes them."""
    k = block.size + 3
    e = raised(int(reference_exponents(block, k)[0])) if block.size else EXP_NONE
    quantized = reference_encode_nonfinite(block, k) if e == EXP_NONFINITE else reference_quantize(block, e, n, k)
    expected = {"propose": np.concatenate([reference_exponents(block, 7), reference_exponents(nxt, 16)]
                                          ).astype(np.int8).tobytes(),
                "quantize": quantized.tobytes(),
                "dequantize": (reference_decode_nonfinite(sums) if e == EXP_NONFINITE
                               else reference_dequantize(sums, e, n)).tobytes(),
                "decode": reference_decode_nonfinite(sums).tobytes(),
                "add_be": (sums.astype(np.int64) + sums[::-1]).astype(np.int32).astype(VALUE_DTYPE).tobytes()}
    expected["dequantize_shift"] = _times_pow2(sums.astype(np.float32), -shift).tobytes()
    expected["dequantize_past_cache"] = (expected["dequantize_shift"], True)  # the floats around it untouched
    if block.size:  # the largest |x| as bits: a NaN (any payload) above infinity above every number
        expected["maxabs"] = np.abs(block).view(np.uint32).max().view(np.float32).tobytes()
    if e not in (EXP_NONE, EXP_NONFINITE):
        proposal = int(reference_exponents(nxt, nxt.size)[0]) if nxt.size else EXP_NONE
        expected["quantize_propose"] = (proposal, quantized.tobytes())
    return expected


# Sizes from none to a few vectors of 16 lanes and a tail, so that every loop's body and remainder run;
# any float32 bits for the exponents and the class codes, values in the codec's range for quantization.
sums32 = hnp.arrays(np.int32, st.integers(0, 70)).map(lambda a: a.astype(VALUE_DTYPE))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(bits_array(st.integers(0, 70)), hnp.arrays(np.float32, st.integers(0, 70), elements=wide)),
       bits_array(st.integers(0, 70)), sums32, st.integers(1, 32), st.integers(-140, 170), st.integers(0, 3),
       st.integers(0, 15))
def test_every_path_computes_the_scalar_loops_and_the_numpy_statements_bits(path, block, nxt, sums, n, shift,
                                                                            offset, skew):
    """Each path this CPU runs, forced in turn, against the scalar loops and against numpy, bit for bit:
    max-abs and exponents (NaN, infinities, the top binade, denormals), quantization, class codes,
    dequantization (also at scales past a float32's), decoding, the switch's add, and quantize_propose."""
    block = np.concatenate([np.zeros(skew, np.float32), block])[skew:]  # any 4-byte alignment
    with forced(path):
        got = every_kernel(block, nxt, sums, n, shift, offset, skew)
    with forced("scalar"):
        scalar = every_kernel(block, nxt, sums, n, shift, offset, skew)
    assert got == scalar
    with np.errstate(over="ignore"):  # random sums at the largest scales overflow: to inf, as in C
        assert got == numpy_kernels(block, nxt, sums, n, shift)


class _Proposes(_native.Stream):
    """The C stream told to propose each chunk itself as it sends (proposals=True: one read of the input)."""

    def __init__(self, window, x, out, proposals, *rest, **kw) -> None:
        super().__init__(window, x, out, None if proposals is None else True, *rest, **kw)


class ProposingReduction(NativeReduction, _Proposes):
    """NativeReduction whose stream makes the proposals as it sends, instead of taking the payloads'."""


def _calls_under_loss(impl: str) -> tuple[list, list]:
    """Three workers' calls (allreduces and reduce-scatters, short last chunks, a NaN that marks a chunk)
    over links that lose, duplicate and reorder both ways: every packet sent, and every result."""
    job = Job(n=3, slots=5, k=40)  # 40: two vectors of 16 lanes and a tail, five of 8
    bad = Impairment(loss=0.15, dup=0.1, latency=0.001, jitter=0.006)
    rng = np.random.default_rng(11)
    sizes = [(4001, "allreduce"), (1590, "reduce_scatter"), (7, "allreduce"), (0, "reduce_scatter"), (403, "allreduce")]
    # each value in a binade of its own choosing, so that a chunk's largest is anywhere in it and alone in
    # its binade: a max-abs that missed any value (a lane, the tail, the last) proposes another exponent
    xs = [([(rng.standard_normal(size) * 2.0 ** rng.integers(-40, 40, size)).astype(np.float32) for _ in range(3)],
           kind) for size, kind in sizes]
    xs[0][0][1][250] = np.nan  # rank 1's chunk 6 is marked on every rank
    model = SwitchModel(16)
    model.add_job(job.entry())
    net = SimNet(model, up=bad, down=bad, seed=4, impl=impl)
    workers = [net.add_worker(job, rank) for rank in range(3)]
    results = []
    for call, kind in xs:
        for w, x in zip(workers, call, strict=True):
            net.start(w, x, collective=kind)
        net.run()
        assert all(w.error is None for w in workers)
        results.append([w.out.tobytes() for w in workers])
    return net.sent_log, results


def test_the_stream_proposing_as_it_sends_puts_the_same_bytes_on_the_wire_on_every_path(path, monkeypatch):
    """The stream's fused send (chunk d quantized, chunk d + S's max-abs read beside it) against the
    proposals made beforehand, under loss, duplication and reordering, resends included: on each path,
    the very packets and results that the scalar loops send and get with the payloads' proposals."""
    monkeypatch.setitem(simnet.IMPLEMENTATIONS, "proposing", ProposingReduction)
    with forced("scalar"):
        sent, results = _calls_under_loss("native")
    with forced(path):
        assert _calls_under_loss("proposing") == (sent, results)
    assert any(unpack_header(packet).exponent == EXP_NONFINITE for _, _, packet in sent)  # a chunk went marked


@pytest.mark.parametrize("name", PATHS[1:])
def test_a_path_this_cpu_lacks_cannot_be_chosen(name):
    if name in _native.codec_paths():
        pytest.skip(f"this CPU runs the {name} loops: there is no missing path to refuse")
    with pytest.raises(ValueError, match="cannot run"):
        _native.codec_path(name)


def test_an_unknown_path_is_refused():
    with pytest.raises(ValueError, match="no codec path"):
        _native.codec_path("sse2")
    assert _native.codec_paths()[0] == "scalar"  # every machine has the scalar loops


_PATH_RUN = "from switchagg import _native; print(_native.codec_path(), _native.SIMD)"


@pytest.mark.parametrize(("env", "most"), [({}, "avx512"), ({"SWITCHAGG_CODEC_PATH": "avx512"}, "avx512"),
                                           ({"SWITCHAGG_CODEC_PATH": "avx2"}, "avx2"),
                                           ({"SWITCHAGG_CODEC_PATH": "scalar"}, "scalar"),
                                           ({"SWITCHAGG_NO_SIMD": "1"}, "scalar"),
                                           ({"SWITCHAGG_CODEC_PATH": "neon"}, "avx512")])
def test_the_import_chooses_the_best_path_the_cpu_has_up_to_what_the_environment_allows(env, most):
    """What a process starts with (and SIMD, 1 for vector loops): the best path this CPU runs, at most
    SWITCHAGG_CODEC_PATH's; scalar under SWITCHAGG_NO_SIMD; an unknown name is warned about, not obeyed."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith("SWITCHAGG_")}
    run = subprocess.run([sys.executable, "-c", _PATH_RUN], capture_output=True, text=True, env={**clean, **env},
                         check=True)
    have = _native.codec_paths()
    expected = [name for name in PATHS[:PATHS.index(most) + 1] if name in have][-1]
    assert run.stdout.split() == [expected, str(int(expected != "scalar"))]
    assert ("RuntimeWarning" in run.stderr) == (env.get("SWITCHAGG_CODEC_PATH") == "neon")
