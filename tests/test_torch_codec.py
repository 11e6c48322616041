"""The torch codec (the GPU path) puts the same bits on the wire as the numpy codec."""

from __future__ import annotations

import numpy as np
import pytest

from switchagg.payloads import FloatPayloads
from switchagg.wire import VALUE_DTYPE

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


def test_nan_on_the_torch_path_is_a_clear_error():
    from switchagg.errors import QuantizationError

    x = torch.ones(300)
    x[100] = float("inf")
    with pytest.raises(QuantizationError, match="block 1"):
        TorchPayloads(x, 64, 2)


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
