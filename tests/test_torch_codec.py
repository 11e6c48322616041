"""The torch codec (the GPU path) puts the same bits on the wire as the numpy codec, a window at a time,
waiting for its device once per window, never in the caller's thread."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from switchagg import calls, codec
from switchagg.payloads import FloatPayloads, Request
from switchagg.switch.model import SwitchModel
from switchagg.window import Window
from switchagg.wire import EXP_NONFINITE, VALUE_DTYPE, datagram_size

from .simnet import IMPLEMENTATIONS, Agreed, Impairment, Job, SimNet
from .test_codec import many_contributors, tree_sum

torch = pytest.importorskip("torch")
from switchagg import torch_payloads  # noqa: E402
from switchagg.torch_payloads import Device, TorchPayloads  # noqa: E402

NO_CUDA = "no CUDA device here (the GPU path runs on a GPU machine; on the CPU the same code runs in the other tests)"


def devices():
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    return out


def through_windows(got: TorchPayloads, exponents: np.ndarray, sums: dict[int, np.ndarray], slots: int = 8) -> None:
    """Quantize every chunk of ``got`` with ``exponents`` (as the switch would have agreed them), then take
    ``sums`` (chunk -> its K summed int32, for the chunks this rank receives) back, window by window."""
    red = Agreed(exponents, slots)
    got.advance(red, 0.0)
    assert red.prepared == len(exponents)
    for chunk, summed in sums.items():
        got.decode(chunk, int(exponents[chunk]), summed.astype(VALUE_DTYPE).tobytes())
    red.summed = len(exponents)
    got.advance(red, 0.0)


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
    agreed = ref.proposals().astype(np.int16) + 1  # any agreed exponent at least the proposal
    sums = {}
    for chunk, e in enumerate(agreed.tolist()):
        wire = np.empty(k, VALUE_DTYPE)
        ref.encode(chunk, e, wire)
        sums[chunk] = (wire.astype(np.int64) * n).astype(np.int32)
        ref.decode(chunk, e, sums[chunk].astype(VALUE_DTYPE))
    through_windows(got, agreed, sums)
    for chunk in range(len(agreed)):
        wire, mine = np.empty(k, VALUE_DTYPE), np.full(k, -1, VALUE_DTYPE)
        ref.encode(chunk, int(agreed[chunk]), wire)
        got.encode(chunk, int(agreed[chunk]), mine)
        assert np.array_equal(mine, wire)
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
    wires = [[np.empty(k, VALUE_DTYPE) for _ in agreed] for _ in refs]
    for ref, rows in zip(refs, wires, strict=True):
        for chunk, e in enumerate(agreed.tolist()):
            ref.encode(chunk, e, rows[chunk])
    sums = {chunk: np.sum([rows[chunk] for rows in wires], axis=0, dtype=np.int64).astype(np.int32)
            for chunk in range(len(agreed))}
    for ref, got, rows in zip(refs, gots, wires, strict=True):
        through_windows(got, agreed, sums)
        assert np.array_equal(got.rows, np.array(rows, np.int32))  # the same values on the wire
        for chunk, e in enumerate(agreed.tolist()):
            ref.decode(chunk, e, sums[chunk].astype(VALUE_DTYPE))
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


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("n", [300, 1024, 65_535])
def test_class_codes_of_up_to_65535_contributors_are_the_same_bits_on_both_paths(device, n):
    """The device's class codes of many contributors are the numpy codec's, and their sums over a tree
    (past 32,768 in the high half: negative int32) decode on the device as the numpy codec decodes them."""
    x, expected = many_contributors(n)
    codes = torch_payloads._encode_classes(torch.from_numpy(x).to(device)).cpu().numpy()
    ref = codec.quantize(x.reshape(-1), EXP_NONFINITE, n, np.empty(x.size, VALUE_DTYPE)).astype(np.int32)
    assert codes.dtype == np.int32 and np.array_equal(codes.reshape(-1), ref)
    total = tree_sum(codes)
    out = torch_payloads._decode_classes(torch.from_numpy(total).to(device)).cpu().numpy()
    assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))


def staged_run(impl: str, *, seed: int, loss: float, collective: str = "allreduce", size: int = 999):
    """Three ranks' call of ``size`` float32 through simnet, staged (TorchPayloads on the CPU) or not:
    each rank's result, every packet sent, and each rank's payloads."""
    job = Job(n=3, slots=8, k=8)
    bad = Impairment(loss=loss, dup=loss, latency=0.001, jitter=0.003)
    rng = np.random.default_rng(seed)
    xs = [(rng.standard_normal(size) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32) for _ in range(3)]
    xs[1][size // 2] = np.inf  # a marked chunk among them
    runs = {}
    for staged in (False, True):
        model = SwitchModel(16)
        model.add_job(job.entry())
        net = SimNet(model, bad, bad, seed=seed, impl=impl)
        ws = [net.add_worker(job, r) for r in range(3)]
        for w, x in zip(ws, xs, strict=True):
            net.start(w, x, collective=collective, staged=staged)
        net.run()
        assert all(w.error is None and w.red.done and w.red.marked for w in ws)
        runs[staged] = ([w.out.copy() for w in ws], net.sent_log, [w.payloads for w in ws])
    return runs


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter"])
def test_the_windowed_gpu_path_sums_bit_for_bit_as_the_numpy_path_and_sends_the_same_packets(collective):
    """Through the C stream, the staged payloads (quantized a window at a time, as on a GPU) give every
    rank the numpy path's bits, and put the same packets on the wire (later: each chunk waits for its
    window)."""
    runs = staged_run("native", seed=3, loss=0.0, collective=collective)
    for plain, staged in zip(runs[False][0], runs[True][0], strict=True):
        assert plain.tobytes() == staged.tobytes()
    packets = {run: sorted({(who, data) for _, who, data in runs[run][1]}) for run in runs}
    assert packets[True] == packets[False]


@pytest.mark.parametrize("seed", range(3))
def test_both_implementations_send_a_staged_call_alike(seed):
    """The Python Reduction and the C stream gate a staged call's chunks on their windows alike: under
    loss, duplication and reordering, the same bytes at the same times, and the same sums."""
    python, native = staged_run("python", seed=seed, loss=0.1), staged_run("native", seed=seed, loss=0.1)
    assert python[True][1] == native[True][1]
    assert [o.tobytes() for o in python[True][0]] == [o.tobytes() for o in native[True][0]]
    assert [o.tobytes() for o in native[True][0]] == [o.tobytes() for o in native[False][0]]


@pytest.mark.parametrize("loss", [0.0, 0.1])
def test_the_host_waits_once_per_window_not_once_per_chunk(loss):
    """A call of 125 chunks over 8 slots goes in windows of 4: its ranks wait for their device once for
    the proposals and once per window (32), whatever is lost, and never per chunk."""
    (_, _, payloads) = staged_run("native", seed=1, loss=loss)[True]
    n_chunks, window = 125, 8 // 2
    assert [p.work.waits for p in payloads] == [1 + math.ceil(n_chunks / window)] * 3
    assert all(p.work.waits < n_chunks / 3 for p in payloads)


def test_a_clients_tensor_is_quantized_a_window_at_a_time_and_the_callers_thread_never_waits(make_job, monkeypatch):
    """The GPU path end to end through the embedded switch, on CPU tensors: the same bits as the numpy
    path, the client's thread waiting once per window, the caller's (a DDP hook's) not at all."""
    from switchagg import Client

    from .conftest import run_ranks

    cfg = make_job(2, k=64, slot_count=16)
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(20_000, generator=gen) * 100 for _ in range(2)]
    callers: set[int] = set()

    def work(r):
        callers.add(threading.get_ident())
        with Client(cfg, r) as c:
            return c.allreduce(xs[r], op="mean")

    plain = run_ranks(2, work)
    waiters: list[int] = []
    wait = Device.wait

    def counted(self: Device, event) -> None:
        waiters.append(threading.get_ident())
        wait(self, event)

    monkeypatch.setattr(Device, "wait", counted)
    monkeypatch.setattr(torch_payloads, "stays_on_device", lambda t: True)  # CPU tensors take the GPU path
    callers.clear()  # (a finished thread's id may be a later thread's)
    staged = run_ranks(2, work)
    for a, b in zip(plain, staged, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    windows = math.ceil(math.ceil(20_000 / 64) / (16 // 2))
    assert len(waiters) == 2 * (1 + windows)  # each rank: its proposals, and its 40 windows
    assert not callers & set(waiters)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_preparing_a_cuda_tensor_never_waits_for_the_device():
    """What the caller's thread does (a DDP hook's, on autograd's thread) makes the host wait for nothing:
    torch's sync debug mode turns any wait into an error."""
    from switchagg.client import payloads_of

    x = torch.randn(1 << 20, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        prepared = payloads_of(x, Request(64, 4, "mean"), out=x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert prepared.payloads.work.waits == 0
    assert prepared.payloads.proposals().size == calls.Layout(64, x.numel()).n_chunks


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("k", [64, 1024])
def test_a_cuda_bucket_sums_bit_for_bit_as_on_the_cpu(make_job, k):
    """A bucket on the GPU and the same values on the CPU (numpy path) give the same bits, K = 64 too."""
    from switchagg import Client

    from .conftest import run_ranks

    cfg = make_job(2, k=k, slot_count=64)
    xs = [torch.randn(300_001, generator=torch.Generator().manual_seed(r)) for r in range(2)]

    def work(r):
        with Client(cfg, r) as c:
            return c.allreduce(xs[r]), c.allreduce(xs[r].cuda())

    for cpu, gpu in run_ranks(2, work, timeout=120):
        assert torch.equal(cpu.view(torch.int32), gpu.cpu().view(torch.int32))


@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
def test_a_staged_call_sends_a_chunk_only_once_its_window_is_prepared(impl):
    """Both implementations: nothing of a staged call's data goes before prepare(); agreed_upto() grows as
    the results before each chunk on its slot come in, and exponents() gives only those."""
    job = Job(n=1, slots=4, k=8)
    model = SwitchModel(16)
    model.add_job(job.entry())
    x = np.linspace(-3, 3, 40, dtype=np.float32)  # 5 chunks: a call round of 4, chunk 4 on slot 0 again
    payloads = TorchPayloads(torch.from_numpy(x), 8, 1)
    red = IMPLEMENTATIONS[impl](job.params(0), Window(4), payloads, n_chunks=5, first_id=0,
                                copies=np.zeros(4, np.int64), now=0.0, progress_timeout=5.0,
                                call=calls.rows(calls.CallDescriptor(0, 40, "float"), 0, 1, 8))
    rows, lengths = np.empty((8, datagram_size(8)), np.uint8), np.zeros(8, np.uint32)

    def answer() -> list[int]:
        """Send what is due to the switch and its results back; the chunk ids sent."""
        n = red.emit(rows, lengths)
        sums = [e.payload() for row in rows[:n] for e in model.process(row.tobytes(), job.address(0))]
        red.receive_batch(b"".join(sums), (datagram_size(8) * np.arange(len(sums))).astype(np.uint32),
                          np.full(len(sums), datagram_size(8), np.uint32), 0.001)
        return [int.from_bytes(row[8:12], "big") for row in rows[:n]]

    assert red.agreed_upto() == 0 and red.summed_upto() == 0
    with pytest.raises(ValueError, match="agreed"):
        red.exponents(0, 1)
    assert answer() == [0, 1, 2, 3]  # the call round alone
    assert red.agreed_upto() == 4 and answer() == []  # chunks 0-3 agreed (chunk 4 waits for chunk 0), none prepared
    assert np.frombuffer(red.exponents(0, 4), np.int8).tolist() == payloads.proposals()[:4].tolist()
    payloads.advance(red, 0.001)  # a window of two chunks (half the slots), then the other two
    assert red.prepared == 4 and answer() == [4, 5, 6, 7]
    assert red.summed_upto() == 4 and red.agreed_upto() == 5
    payloads.advance(red, 0.002)
    assert answer() == [8] and red.done
    payloads.advance(red, 0.003)  # the last window's sums
    assert payloads.out.numpy().tobytes() == x.tobytes()  # one worker: its own values, exactly (K = 8, n = 1)
