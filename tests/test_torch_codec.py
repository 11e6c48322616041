"""The torch codec (the GPU path) puts the same bits on the wire as the numpy codec."""

from __future__ import annotations

import numpy as np
import pytest

from switchagg.payloads import FloatPayloads
from switchagg.wire import EXP_NONFINITE, VALUE_DTYPE

torch = pytest.importorskip("torch")
from switchagg.torch_payloads import TorchPayloads  # noqa: E402


def devices():
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    return out


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_and_numpy_codecs_agree_bit_for_bit(device, dtype):
    k, n = 64, 3
    gen = torch.Generator().manual_seed(5)
    span = 4 if dtype == "float16" else 30  # magnitudes 1e-span .. 1e+span, all representable
    x = (torch.randn(1000, generator=gen) * torch.logspace(-span, span, 1000)).to(getattr(torch, dtype))
    x[128:192] = 0  # an all-zero block
    ref_in = x.float().numpy()
    ref_out = np.empty_like(ref_in)
    ref = FloatPayloads(ref_in, ref_out, k, n)
    got = TorchPayloads(x.to(device), k, n)
    assert np.array_equal(got.proposals(), ref.proposals())
    for chunk, e in enumerate(ref.proposals()):
        e = int(e) + 1  # any agreed exponent at least the proposal
        wire, mine = np.empty(k, VALUE_DTYPE), np.full(k, -1, VALUE_DTYPE)
        ref.encode(chunk, e, wire)
        got.encode(chunk, e, mine)
        assert np.array_equal(mine, wire)
        summed = (wire.astype(np.int64) * n).astype(">i4")
        ref.decode(chunk, e, summed)
        got.decode(chunk, e, summed)
    assert np.array_equal(got.out.cpu().numpy(), ref_out)
    mean = got.result(x, mean=True)
    assert mean.dtype == x.dtype and mean.device.type == device


def test_empty_tensor_has_no_blocks():
    p = TorchPayloads(torch.zeros(0), 64, 2)
    assert p.proposals().size == 0 and p.result(torch.zeros(0), mean=True).shape == (0,)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_marked_chunks_are_the_same_bits_on_both_paths(device, dtype):
    """Non-finite values (and, in float32, magnitudes past 2**126) mark their block on the torch path
    as on the numpy one: the same proposals, the same class codes on the wire, the same inf/NaN back
    from three workers' summed codes, bit for bit, and finite sums elsewhere."""
    k, n = 64, 3
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(1000, generator=gen) for _ in range(n)]
    xs[0][5] = float("inf")  # chunk 0: only +inf
    xs[1][70] = float("nan")  # chunk 1: NaN
    xs[2][130], xs[0][130], xs[0][131] = float("inf"), float("-inf"), float("-inf")  # chunk 2: both signs
    xs[1][200], xs[2][200] = float("-inf"), float("-inf")  # chunk 3: only -inf, twice
    if dtype == "float32":
        xs[0][300], xs[1][301] = 2.0**126, -(2.0**127)  # chunk 4: past the range, so "inf" of each sign
    xs[2][999] = float("-inf")  # the short last chunk
    xs = [x.to(getattr(torch, dtype)) for x in xs]
    refs = [FloatPayloads(x.float().numpy(), np.empty(1000, np.float32), k, n) for x in xs]
    gots = [TorchPayloads(x.to(device), k, n) for x in xs]
    for ref, got in zip(refs, gots, strict=True):
        assert np.array_equal(got.proposals(), ref.proposals())
    agreed = np.max([ref.proposals() for ref in refs], axis=0)
    marked = [0, 1, 2, 3, 15] + ([4] if dtype == "float32" else [])
    assert sorted(np.flatnonzero(agreed == EXP_NONFINITE).tolist()) == sorted(marked)
    for chunk, e in enumerate(agreed.tolist()):
        total = np.zeros(k, np.int64)
        for ref, got in zip(refs, gots, strict=True):
            wire, mine = np.empty(k, VALUE_DTYPE), np.full(k, -1, VALUE_DTYPE)
            ref.encode(chunk, e, wire)
            got.encode(chunk, e, mine)
            assert np.array_equal(mine, wire)
            total += wire
        summed = total.astype(VALUE_DTYPE)
        for ref, got in zip(refs, gots, strict=True):
            ref.decode(chunk, e, summed)
            got.decode(chunk, e, summed)
    ref_out = refs[0].out
    for ref, got in zip(refs, gots, strict=True):
        assert np.array_equal(got.out.cpu().numpy().view(np.uint32), ref_out.view(np.uint32))
        assert np.array_equal(ref.out.view(np.uint32), ref_out.view(np.uint32))  # every rank the same
    out = ref_out
    assert out[5] == np.inf and np.isnan(out[70]) and np.isnan(out[130]) and out[131] == -np.inf
    assert out[200] == -np.inf and out[999] == -np.inf and np.isnan(out[0]) and np.isnan(out[960])
    if dtype == "float32":
        assert out[300] == np.inf and out[301] == -np.inf
    assert np.isfinite(out[320:960]).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (the GPU path runs on a GPU machine)")
def test_client_keeps_cuda_tensors_on_the_device(make_job):
    from switchagg import Client

    from .conftest import run_ranks

    cfg = make_job(2, k=1024, slot_count=4)
    xs = [torch.randn(5000, device="cuda", generator=torch.Generator("cuda").manual_seed(r)) for r in range(2)]

    def work(r):
        with Client(cfg, r) as c:
            return c.allreduce(xs[r], op="mean")

    out = run_ranks(2, work)
    exact = (xs[0] + xs[1]) / 2
    for o in out:
        assert o.device.type == "cuda"
        assert torch.allclose(o, exact, atol=1e-5)
