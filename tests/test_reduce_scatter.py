"""Reduce-scatter on the worker's side: the chunks' layout, the call round's descriptor, and the state
machines (Python and C alike) against the switch model over simulated links.

A reduce-scatter of n * s values among n ranks hands rank r values [r * s, (r + 1) * s) of the sum.
Each shard is cut into ceil(s / K) chunks of its own (no chunk straddles two owners), every data
contribution names its chunk's owner, and the switch sends the owner the sum and every other rank
the RESULT's header alone. End-to-end tests through the embedded switch are at the end.
"""

from __future__ import annotations

import numpy as np
import pytest

from switchagg import QuantizationError, SoftSwitch, calls, codec
from switchagg.calls import CallDescriptor, Layout
from switchagg.errors import PeerFailed
from switchagg.payloads import FloatPayloads, Int32Payloads
from switchagg.switch.model import SwitchModel
from switchagg.window import Window
from switchagg.wire import FLAG_OWNER, PacketType, datagram_size, unpack_header

from .conftest import calls_on_ranks, loopback_config
from .simnet import IMPLEMENTATIONS, Agreed, Impairment, Job, SimNet


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request) -> str:
    return request.param


def data(n: int, size: int, seed: int, dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype == np.int32:
        return [rng.integers(-2**31, 2**31, size, dtype=np.int64).astype(np.int32) for _ in range(n)]
    return [(rng.standard_normal(size) * 10 ** rng.uniform(-3, 3, size)).astype(np.float32) for _ in range(n)]


def shard_bound(xs: list[np.ndarray], layout: Layout, rank: int, n: int) -> np.ndarray:
    """codec's bound for each value of ``rank``'s shard: its chunk's agreed exponent's."""
    own = range(rank * layout.per_shard, (rank + 1) * layout.per_shard)
    exps = [max(int(codec.propose_exponents(x[slice(*layout.source(c))], layout.k)[0]) for x in xs) for c in own]
    return np.concatenate([np.full(layout.target(c)[1] - layout.target(c)[0], codec.error_bound(e, n))
                           for c, e in zip(own, exps, strict=True)] or [np.zeros(0)])


def expected_shard(xs: list[np.ndarray], rank: int) -> np.ndarray:
    s = xs[0].size // len(xs)
    if xs[0].dtype == np.int32:
        return np.sum(np.stack(xs), axis=0, dtype=np.int32)[rank * s:(rank + 1) * s]  # wraps like int32
    return np.sum(np.stack(xs).astype(np.float64), axis=0)[rank * s:(rank + 1) * s]


def check_shards(ws, xs: list[np.ndarray], job: Job) -> None:
    layout = Layout.of(xs[0].size, job.k, job.n, "reduce_scatter")
    for w in ws:
        assert w.error is None and w.red.done and w.red.mismatch is None
        exact = expected_shard(xs, w.rank)
        assert w.out.shape == exact.shape
        if xs[0].dtype == np.int32:
            assert np.array_equal(w.out, exact)
        else:
            bound = shard_bound(xs, layout, w.rank, job.n)
            assert np.all(np.abs(w.out.astype(np.float64) - exact) <= bound + np.abs(exact) * 2.0**-23)


def scatter_net(job: Job, impl: str, up: Impairment | None = None, down: Impairment | None = None,
                seed: int = 0) -> tuple[SimNet, list]:
    model = SwitchModel(64)
    model.add_job(job.entry())
    net = SimNet(model, up or Impairment(), down or Impairment(), seed=seed, impl=impl)
    return net, [net.add_worker(job, r) for r in range(job.n)]


def run_call(net: SimNet, ws: list, xs: list[np.ndarray], collective: str = "reduce_scatter") -> None:
    for w, x in zip(ws, xs, strict=True):
        net.start(w, x, collective=collective)
    net.run()


# ---- the layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("shard", [0, 1, 7, 8, 9, 17, 64])
def test_each_shard_is_cut_apart_and_no_chunk_straddles_two_owners(n, shard):
    layout = Layout.of(n * shard, 8, n, "reduce_scatter")
    assert layout.scatter and layout.shard == shard and layout.per_shard == -(-shard // 8)
    assert layout.n_chunks == n * layout.per_shard
    covered = np.zeros(n * shard, int)
    for c in range(layout.n_chunks):
        start, stop = layout.source(c)
        owner = layout.owner(c)
        assert owner * shard <= start < stop <= (owner + 1) * shard  # inside its owner's shard
        assert 0 < stop - start <= 8
        t0, t1 = layout.target(c)
        assert (t0 + owner * shard, t1 + owner * shard) == (start, stop)  # the same place in the shard
        covered[start:stop] += 1
    assert np.all(covered == 1)


def test_an_allreduce_layout_is_the_plain_chunking():
    layout = Layout.of(20, 8, 3, "allreduce")
    assert not layout.scatter and layout.n_chunks == 3
    assert [layout.source(c) for c in range(3)] == [(0, 8), (8, 16), (16, 20)]
    assert [layout.target(c) for c in range(3)] == [(0, 8), (8, 16), (16, 20)]


def test_a_length_the_ranks_do_not_divide_is_refused_saying_so():
    with pytest.raises(ValueError, match="3 ranks divide evenly.*not 10"):
        Layout.of(10, 8, 3, "reduce_scatter")


# ---- the call round's descriptor -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["float", "int32"])
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter"])
def test_a_descriptor_says_its_collective_and_reads_back_whole(kind, op, collective):
    desc = CallDescriptor(65536 + 7, (1 << 40) + 12345, kind, op, collective=collective)
    back = CallDescriptor.from_words(*desc.words())
    assert back == CallDescriptor(7, (1 << 40) + 12345, kind, op, collective=collective)


def test_an_allreduce_and_a_reduce_scatter_of_the_same_tensor_are_different_calls():
    """The call round compares each rank's descriptor with its own: these must differ in it."""
    a = CallDescriptor(3, 96, "float", "sum")
    b = CallDescriptor(3, 96, "float", "sum", collective="reduce_scatter")
    assert a.words() != b.words()
    _, expect = calls.rows(a, 0, 2, 8)
    mine, _ = calls.rows(b, 1, 2, 8)
    theirs, _ = calls.rows(a, 0, 2, 8)
    summed = (mine.astype(np.int64) + theirs).astype(">i4").tobytes()
    assert summed != expect
    error = calls.mismatch_error(summed, 2, 0)
    assert "rank 0: call #3: 96 float values" in str(error)
    assert "rank 1: call #3: reduce_scatter of 96 float values" in str(error)


@pytest.mark.parametrize("collective, length, n, expect", [
    ("reduce_scatter", 32, 2, 4), ("reduce_scatter", 30, 3, 6), ("reduce_scatter", 3, 3, 3),
    ("reduce_scatter", 0, 2, 1), ("reduce_scatter", 9000, 3, 16), ("allreduce", 30, 3, 4), ("allreduce", 17, 2, 3),
    ("allreduce", 3, 3, 1)])
def test_a_calls_round_covers_its_chunks(collective, length, n, expect):
    """K = 8, 16 slots: a reduce-scatter of 32 values over 2 ranks is 4 chunks (as an allreduce's), of
    30 over 3 is 3 x 2 (an allreduce's 4), of 3 over 3 is 3 chunks of one value (an allreduce's one);
    at most a round per slot. An allreduce's length need not divide."""
    desc = CallDescriptor(0, length, "float", collective=collective)
    assert desc.rounds(8, 16, n) == expect
    row = np.sum([calls.rows(desc, r, n, 8)[0].astype(np.int64) for r in range(n)], axis=0)
    assert calls.footprint(row.astype(">i4").tobytes(), n, 8, 16) == expect


# ---- the state machines, over simulated links -----------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("shard", [0, 1, 5, 16, 17, 40])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_each_rank_gets_its_shard_of_the_sum(n, shard, dtype, impl):
    job = Job(n=n, slots=4, k=16)
    net, ws = scatter_net(job, impl)
    xs = data(n, n * shard, seed=n * 100 + shard, dtype=dtype)
    run_call(net, ws, xs)
    check_shards(ws, xs, job)


def test_every_data_contribution_names_its_owner_and_only_the_owner_gets_the_values(impl):
    job = Job(n=3, slots=4, k=8)
    net, ws = scatter_net(job, impl)
    xs = data(3, 3 * 13, seed=1)  # shards of 13: two chunks each, the second of 5 values
    layout = Layout.of(xs[0].size, job.k, job.n, "reduce_scatter")
    received: dict[int, list] = {r: [] for r in range(job.n)}
    process = net.model.process

    def watch(data, src):
        emits = process(data, src)
        for e in emits:
            received[e.header.worker].append(e.header)
        return emits

    net.model.process = watch
    run_call(net, ws, xs)
    check_shards(ws, xs, job)
    rounds = ws[0].red.rounds
    for _, _, packet in net.sent_log:
        h = unpack_header(packet)
        t = h.chunk  # the first call: ids from 0
        if t < rounds:
            assert h.flags & FLAG_OWNER == 0 and h.owner == 0  # the call round is an ordinary sum
        else:
            assert h.flags & FLAG_OWNER and h.owner == layout.owner(t - rounds)
    for rank, headers in received.items():
        own = {rounds + c for c in range(layout.n_chunks) if layout.owner(c) == rank}
        for h in headers:
            assert h.type == PacketType.RESULT
            whole = h.chunk < rounds or h.chunk in own
            assert h.count == (job.k if whole else 0)
        assert {h.chunk for h in headers} == set(range(rounds + layout.n_chunks))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_loss_duplication_and_reordering_change_no_bit_of_any_shard(seed, dtype, impl):
    job = Job(n=4, slots=6, k=8, ask_first=seed % 2 == 1)
    xs = data(4, 4 * 61, seed=seed, dtype=dtype)
    net, ws = scatter_net(job, impl)
    run_call(net, ws, xs)
    clean = [w.out.copy() for w in ws]
    bad = Impairment(loss=0.12, dup=0.1, latency=0.001, jitter=0.004)
    net, ws = scatter_net(job, impl, bad, bad, seed=seed)
    for _ in range(2):  # a second call too: copies and ids carried over
        run_call(net, ws, xs)
        check_shards(ws, xs, job)
        for w, c in zip(ws, clean, strict=True):
            assert w.out.tobytes() == c.tobytes()
    counters = net.model.counters()["jobs"][job.job_id]
    assert counters["results_unicast"] + counters["duplicate_pending"] > 0  # repeats happened
    assert sum(w.red.retransmissions for w in ws) > 0


def test_reduce_scatters_and_allreduces_interleave_in_one_session(impl):
    """Ids, slot copies and the window carry from one collective to the other."""
    job = Job(n=3, slots=4, k=8)
    net, ws = scatter_net(job, impl, Impairment(loss=0.05), Impairment(loss=0.05), seed=3)
    for i, (size, collective) in enumerate([(30, "reduce_scatter"), (50, "allreduce"), (3, "reduce_scatter"),
                                           (0, "reduce_scatter"), (48, "reduce_scatter"), (7, "allreduce")]):
        xs = data(3, size, seed=i, dtype=np.int32)
        run_call(net, ws, xs, collective)
        total = np.sum(np.stack(xs), axis=0, dtype=np.int32)
        for w in ws:
            assert w.error is None and w.red.done and w.red.mismatch is None
            want = total if collective == "allreduce" else expected_shard(xs, w.rank)
            assert np.array_equal(w.out, want)
    assert net.model.counters()["jobs"][job.job_id]["stale"] == 0


def test_an_allreduce_against_a_reduce_scatter_stops_in_the_call_round_on_every_rank(impl):
    """No data of either goes: every rank reads the same call-round sum, sees both calls, and takes
    the same footprint."""
    job = Job(n=2, slots=4, k=8)
    net, ws = scatter_net(job, impl)
    xs = data(2, 40, seed=5)
    net.start(ws[0], xs[0], collective="allreduce")
    net.start(ws[1], xs[1], collective="reduce_scatter")
    net.run()
    rows = [w.red.mismatch for w in ws]
    assert rows[0] is not None and rows[0] == rows[1]
    descs = calls.read(rows[0], 2)
    assert [d.collective for d in descs] == ["allreduce", "reduce_scatter"]
    assert calls.footprint(rows[0], 2, job.k, job.slots) == 4  # 5 chunks of the allreduce's, 6 of the other's
    data_sent = [unpack_header(p) for _, _, p in net.sent_log if unpack_header(p).chunk >= ws[0].red.rounds]
    assert data_sent == [] and net.model.counters()["jobs"][job.job_id]["results_multicast"] == 4


def test_every_rank_knows_a_marked_chunk_that_another_rank_owns(impl):
    """Rank 2 holds NaN in a value of rank 0's shard: rank 0's shard has NaN in that chunk, and every
    rank's call knows a chunk went marked (from the headers alone), so nonfinite="raise" raises on all."""
    job = Job(n=3, slots=4, k=8)
    net, ws = scatter_net(job, impl)
    xs = [np.ones(3 * 20, np.float32) for _ in range(3)]
    xs[2][3] = np.nan  # rank 0's shard, its first chunk
    run_call(net, ws, xs)
    assert [w.red.marked for w in ws] == [True, True, True]
    assert np.isnan(ws[0].out[:8]).all() and np.all(ws[0].out[8:] == 3.0)
    assert all(np.all(w.out == 3.0) for w in ws[1:])
    run_call(net, ws, [np.ones(3 * 20, np.float32) for _ in range(3)])
    assert [w.red.marked for w in ws] == [False, False, False]


@pytest.mark.parametrize("shard", [0, 5, 16, 70])
def test_the_torch_payloads_cut_a_reduce_scatter_as_the_numpy_ones_do(shard):
    """The GPU path (TorchPayloads, run here on the CPU) proposes, quantizes (a window at a time) and
    dequantizes each chunk of a reduce-scatter's layout bit for bit as the numpy path does, and hands
    back this rank's shard."""
    torch = pytest.importorskip("torch")
    from switchagg.torch_payloads import TorchPayloads

    k, n, rank = 16, 3, 1
    layout = Layout.of(n * shard, k, n, "reduce_scatter")
    x = data(1, n * shard, seed=shard)[0]
    x[:3] = [0.0, np.inf, np.nan][:x.size]  # rank 0's first chunk marked, where there is one
    ref = FloatPayloads(x, np.full(shard, -1, np.float32), k, n, layout)
    got = TorchPayloads(torch.from_numpy(x.copy()), k, n, layout, rank)
    agreed = ref.proposals()
    assert np.array_equal(got.proposals(), agreed) and agreed.size == layout.n_chunks
    red = Agreed(agreed, slots=4)
    got.advance(red, 0.0)  # every chunk quantized, window by window
    assert red.prepared == layout.n_chunks
    for chunk, e in enumerate(agreed.tolist()):
        wire, mine = np.empty(k, ">i4"), np.full(k, -1, ">i4")
        ref.encode(chunk, e, wire)
        got.encode(chunk, e, mine)
        assert np.array_equal(mine, wire)
        if layout.owner(chunk) == rank:
            ref.decode(chunk, e, wire)
            got.decode(chunk, e, wire)
    red.summed = layout.n_chunks
    got.advance(red, 0.0)  # the shard's sums dequantized
    assert got.out.numpy().tobytes() == ref.out.tobytes()
    assert np.all(ref.out != -1) or shard == 0  # every value of the shard was written
    like = torch.zeros(n * shard, dtype=torch.float16)
    assert got.result(like, mean=False, shape=(shard,)).shape == (shard,)


# ---- a switch that gets ownership wrong -----------------------------------------------------------------


def one_call(impl: str, rank: int):
    """Rank ``rank``'s call of a 2-rank reduce-scatter of 2 x 8 int32 (K = 8, a chunk per shard), its
    call round already answered: the data chunks are out, their results to be forged by hand."""
    job = Job(n=2, slots=4, k=8)
    x = np.arange(16, dtype=np.int32)
    layout = Layout.of(16, 8, 2, "reduce_scatter")
    out = np.full(8, -7, np.int32)
    desc = CallDescriptor(0, 16, "int32", collective="reduce_scatter")
    red = IMPLEMENTATIONS[impl](job.params(rank), Window(4), Int32Payloads(x, out, 8, layout), n_chunks=2,
                                first_id=0, copies=np.zeros(4, np.int64), now=0.0, progress_timeout=5.0,
                                started=True, call=calls.rows(desc, rank, 2, 8), layout=layout)
    rows = np.zeros((8, datagram_size(8)), np.uint8)
    lengths = np.zeros(8, np.uint32)
    sent = [rows[i, :lengths[i]].tobytes() for i in range(red.emit(rows, lengths))]
    assert len(sent) == 2  # the call round: a packet per chunk (2 chunks, 4 slots)
    expect = calls.rows(desc, 0, 2, 8)[1]
    for packet in sent:
        h = unpack_header(packet)._replace(type=PacketType.RESULT)
        deliver(red, h.pack() + expect, 0.001)
    sent = [unpack_header(rows[i, :lengths[i]].tobytes()) for i in range(red.emit(rows, lengths))]
    assert [(h.chunk, h.flags & FLAG_OWNER, h.owner) for h in sent] == [(2, FLAG_OWNER, 0), (3, FLAG_OWNER, 1)]
    return red, out, sent


def deliver(red, packet: bytes, now: float) -> int:
    return red.receive_batch(packet, np.zeros(1, np.uint32), np.array([len(packet)], np.uint32), now)


def forged(h, *, count: int, owner: int | None = None, flags: int | None = None) -> bytes:
    h = h._replace(type=PacketType.RESULT, count=count, owner=h.owner if owner is None else owner,
                   flags=h.flags if flags is None else flags)
    return h.pack() + np.full(count, 5, ">i4").tobytes()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_result_in_the_wrong_shape_is_counted_and_ignored_never_decoded(rank, impl):
    red, out, sent = one_call(impl, rank)
    mine, theirs = sent[rank], sent[1 - rank]
    wrong = [forged(mine, count=0),  # the owner's chunk without its values
             forged(theirs, count=8),  # another rank's values
             forged(mine, count=8, owner=1 - rank),  # the owner echoed wrong
             forged(mine, count=8, flags=mine.flags & ~FLAG_OWNER, owner=0),  # as an allreduce's
             forged(theirs, count=0, flags=theirs.flags & ~FLAG_OWNER, owner=0)]
    for i, packet in enumerate(wrong):
        assert deliver(red, packet, 0.002) == 0
        assert red.protocol_errors == i + 1
    assert np.all(out == -7) and not red.done and len(red.pending()) == 2
    assert deliver(red, forged(theirs, count=0), 0.003) == 1  # the right shapes complete the call
    assert deliver(red, forged(mine, count=8), 0.003) == 1
    assert red.done and np.all(out == 5) and red.protocol_errors == len(wrong)
    assert deliver(red, forged(mine, count=8), 0.004) == 0 and red.protocol_errors == len(wrong)  # a duplicate


def test_an_allreduce_result_with_an_owner_is_a_protocol_error(impl):
    job = Job(n=1, slots=4, k=8)
    x = np.arange(8, dtype=np.int32)
    out = np.zeros(8, np.int32)
    red = IMPLEMENTATIONS[impl](job.params(0), Window(4), Int32Payloads(x, out, 8), n_chunks=1, first_id=0,
                                copies=np.zeros(4, np.int64), now=0.0, progress_timeout=5.0, started=True)
    rows, lengths = np.zeros((2, datagram_size(8)), np.uint8), np.zeros(2, np.uint32)
    assert red.emit(rows, lengths) == 1
    h = unpack_header(rows[0].tobytes())
    assert h.flags & FLAG_OWNER == 0 and h.owner == 0
    assert deliver(red, forged(h, count=8, owner=0, flags=h.flags | FLAG_OWNER), 0.001) == 0
    assert red.protocol_errors == 1 and not red.done
    assert deliver(red, forged(h, count=8), 0.001) == 1 and np.all(out == 5)


def test_the_c_stream_refuses_a_reduce_scatter_whose_buffers_do_not_fit():
    from switchagg.protocol import NativeReduction

    job = Job(n=2, slots=4, k=8)
    layout = Layout.of(20, 8, 2, "reduce_scatter")
    x = np.ones(20, np.float32)
    call = calls.rows(CallDescriptor(0, 20, "float", collective="reduce_scatter"), 0, 2, 8)
    for out in (np.empty(20, np.float32), np.empty(9, np.float32)):  # the whole vector, or not a shard
        with pytest.raises(ValueError, match="shard"):
            NativeReduction(job.params(0), Window(4), FloatPayloads(x, out, 8, 2, layout), n_chunks=4, first_id=0,
                            copies=np.zeros(4, np.int64), now=0.0, progress_timeout=5.0, call=call, layout=layout)
    out = np.empty(10, np.float32)
    with pytest.raises(ValueError, match="n_chunks"):
        NativeReduction(job.params(0), Window(4), FloatPayloads(x, out, 8, 2, layout), n_chunks=3, first_id=0,
                        copies=np.zeros(4, np.int64), now=0.0, progress_timeout=5.0, call=call, layout=layout)


# ---- end to end: Clients through the embedded switch ------------------------------------------------


def on_ranks(cfg, per_rank, **client_kw) -> list[list]:
    """Each rank runs its callables ``f(client)`` in order on one Client; each one's value or exception."""
    out = calls_on_ranks(cfg, per_rank, **client_kw)
    assert not any(isinstance(o, BaseException) for o in out), out
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("shard", [0, 1, 100, 256, 1000])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_each_client_gets_its_shard_through_the_embedded_switch(make_job, soft_switch, n, shard, dtype):
    """K = 256: shards shorter than a chunk, of whole chunks, and padded; int32 exact, floats within the
    codec's bound; the switch sent each chunk's sum to its owner alone, and no rank met a protocol error."""
    cfg = make_job(n, k=256, slot_count=4)
    xs = data(n, n * shard, seed=n * 7 + shard, dtype=dtype)

    def call(c):
        shard_out = c.reduce_scatter(xs[c.rank])
        return shard_out, c.protocol_errors

    out = on_ranks(cfg, [[call]] * n)
    layout = Layout.of(n * shard, 256, n, "reduce_scatter")
    for rank, ((got, errors),) in enumerate(out):
        exact = expected_shard(xs, rank)
        assert got.dtype == dtype and got.shape == (shard,) and errors == 0
        if dtype == np.int32:
            assert np.array_equal(got, exact)
        else:
            bound = shard_bound(xs, layout, rank, n)
            assert np.all(np.abs(got.astype(np.float64) - exact) <= bound + np.abs(exact) * 2.0**-23)
    counters = soft_switch.counters()["jobs"][cfg.job_id]
    assert counters["results_to_owner"] == layout.n_chunks


def test_a_rank_receives_its_shards_sums_and_only_headers_of_the_others(make_job):
    """4 ranks, 4 x 64k float32 at K = 1024: a reduce-scatter brings each rank about a quarter of the
    bytes an allreduce of the same tensor does (its 16 chunks' sums, and 48 headers)."""
    n, k = 4, 1024
    cfg = make_job(n, k=k, slot_count=16)
    xs = data(n, n * 16 * k, seed=3)

    def received(c, collective) -> tuple[int, int]:
        before, resent, asked = c.transport_stats.bytes_received, c.retransmissions, c.queries
        getattr(c, collective)(xs[c.rank])
        return c.transport_stats.bytes_received - before, c.retransmissions - resent + c.queries - asked

    calls_ = [lambda c: received(c, "allreduce"), lambda c: received(c, "reduce_scatter")]
    full = 24 + 4 * k
    for (allreduce, _), (scatter, extra) in on_ranks(cfg, [calls_] * n):
        assert allreduce >= (16 + n * 16) * full  # the call round's sums and every chunk's
        assert 16 * full + 16 * full + 48 * 24 <= scatter <= (16 + 16 + extra) * full + 48 * 24
        assert scatter < allreduce / 2


@pytest.mark.parametrize("dtype", ["float16", "float64", "bfloat16"])
def test_dtypes_mean_out_and_async(make_job, dtype):
    torch = pytest.importorskip("torch")
    n = 3
    cfg = make_job(n, k=128, slot_count=4)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(6, 100, generator=gen).to(getattr(torch, dtype)) for _ in range(n)]
    exact = (sum(x.double() for x in xs) / n).reshape(-1)

    def work(c):
        x = xs[c.rank]
        mean = c.reduce_scatter(x, op="mean")
        as_numpy = c.reduce_scatter_async(x.float().numpy().astype(np.float64) if dtype == "float64"
                                          else x.float().numpy(), op="mean").result()
        out = torch.empty(10, 20, dtype=x.dtype)
        into = c.reduce_scatter(x, op="mean", out=out)
        return mean, as_numpy, into is out, out

    for rank, ((mean, as_numpy, same, out),) in enumerate(on_ranks(cfg, [[work]] * n)):
        want = exact[rank * 200:(rank + 1) * 200]
        tol = 2e-2 if dtype != "float64" else 1e-6
        assert mean.dtype == xs[0].dtype and mean.shape == (200,)
        assert torch.allclose(mean.double(), want, rtol=tol, atol=tol)
        assert np.allclose(as_numpy, want.numpy(), rtol=tol, atol=tol)
        assert same and out.shape == (10, 20) and torch.equal(out.reshape(-1), mean)


def test_in_place_into_this_ranks_own_shard_of_the_input(make_job):
    """out may be this rank's own part of x (a chunk is read for the last time before its sum lands):
    numpy and torch alike, and the rest of x is left as it was."""
    torch = pytest.importorskip("torch")
    n = 3
    cfg = make_job(n, k=64, slot_count=4)
    xs = data(n, n * 1000, seed=8)
    exact = [expected_shard(xs, r) for r in range(n)]

    def work(c):
        r = c.rank
        x = xs[r].copy()
        own = x[r * 1000:(r + 1) * 1000]
        got = c.reduce_scatter(x, out=own)
        t = torch.from_numpy(xs[r].copy())
        got_t = c.reduce_scatter(t, out=t[r * 1000:(r + 1) * 1000])
        return got is own, x, got_t, t

    for r, ((same, x, got_t, t),) in enumerate(on_ranks(cfg, [[work]] * n)):
        assert same
        bound = shard_bound(xs, Layout.of(n * 1000, 64, n, "reduce_scatter"), r, n) + np.abs(exact[r]) * 2.0**-23
        assert np.all(np.abs(x[r * 1000:(r + 1) * 1000] - exact[r]) <= bound)
        assert np.all(np.abs(t[r * 1000:(r + 1) * 1000].numpy() - exact[r]) <= bound)
        assert torch.equal(got_t, t[r * 1000:(r + 1) * 1000])
        rest = np.r_[0:r * 1000, (r + 1) * 1000:n * 1000]
        assert np.array_equal(x[rest], xs[r][rest]) and np.array_equal(t.numpy()[rest], xs[r][rest])


def test_a_length_the_ranks_do_not_divide_fails_that_call_on_every_rank(make_job):
    """Rank 0 passes 10 values to 3 ranks: it raises a ValueError saying so, its peers a PeerFailed,
    and the next call sums what every rank passes next."""
    cfg = make_job(3, k=64, slot_count=4)
    per_rank = [[lambda c: c.reduce_scatter(np.ones(10 if c.rank == 0 else 9, np.float32)),
                 lambda c: c.reduce_scatter(np.full(9, c.rank + 1, np.int32))]] * 3
    (first0, next0), (first1, next1), (first2, next2) = on_ranks(cfg, per_rank)
    assert isinstance(first0, ValueError) and "3 ranks divide evenly" in str(first0)
    assert isinstance(first1, PeerFailed) and isinstance(first2, PeerFailed)
    assert [next0.tolist(), next1.tolist(), next2.tolist()] == [[6, 6, 6]] * 3


def test_an_out_of_the_wrong_size_fails_that_call_on_every_rank(make_job):
    cfg = make_job(2, k=64, slot_count=4)
    per_rank = [[lambda c: c.reduce_scatter(np.ones(8, np.float32), out=np.empty(8, np.float32))],
                [lambda c: c.reduce_scatter(np.ones(8, np.float32), out=np.empty(4, np.float32))]]
    (mine,), (theirs,) = on_ranks(cfg, per_rank)
    assert isinstance(mine, ValueError) and "shard" in str(mine) and "4" in str(mine)
    assert isinstance(theirs, PeerFailed)


@pytest.mark.parametrize("nonfinite", ["propagate", "raise"])
def test_a_nan_in_another_ranks_shard_reaches_its_owner_and_raise_raises_on_every_rank(make_job, nonfinite):
    cfg = make_job(3, k=64, slot_count=4)
    xs = [np.ones(3 * 200, np.float32) for _ in range(3)]
    xs[2][70] = np.nan  # rank 0's shard, its second chunk
    per_rank = [[lambda c: c.reduce_scatter(xs[c.rank]), lambda c: c.reduce_scatter(np.ones(3, np.float32))]] * 3
    out = on_ranks(cfg, per_rank, nonfinite=nonfinite)
    for rank, (first, second) in enumerate(out):
        if nonfinite == "raise":
            assert isinstance(first, QuantizationError)
        elif rank == 0:
            assert np.isnan(first[64:128]).all() and np.all(first[:64] == 3) and np.all(first[128:] == 3)
        else:
            assert np.all(first == 3)
        assert second.tolist() == [3.0]


@pytest.mark.skipif("not __import__('torch').cuda.is_available()",
                    reason="no CUDA device here (the GPU path runs on a GPU machine)")
def test_cuda_tensors_reduce_scatter_on_the_device(make_job):
    import torch

    n = 2
    cfg = make_job(n, k=1024, slot_count=4)
    xs = [torch.randn(2 * 5000 + 2, device="cuda", generator=torch.Generator("cuda").manual_seed(r))
          for r in range(n)]
    out = on_ranks(cfg, [[lambda c: c.reduce_scatter(xs[c.rank], op="mean")]] * n)
    exact = (xs[0] + xs[1]) / 2
    for rank, (got,) in enumerate(out):
        assert got.device.type == "cuda" and got.shape == (5001,)
        assert torch.allclose(got, exact[rank * 5001:(rank + 1) * 5001], atol=1e-5)


def test_the_pure_model_serves_the_same_shards_as_the_c_switch():
    """SoftSwitch(native=False) serves with SwitchModel itself: the same bits of every shard come back."""
    n = 3
    xs = data(n, n * 7001, seed=4)
    results = []
    for native in (True, False):
        with SoftSwitch(("127.0.0.1", 0), native=native) as sw:
            cfg = loopback_config(n, switch_port=sw.address[1], k=512, slot_count=8)
            sw.add_job(cfg)
            results.append(on_ranks(cfg, [[lambda c: c.reduce_scatter(xs[c.rank])]] * n))
            assert sw.counters()["jobs"][cfg.job_id]["results_to_owner"] == n * 14 and sw.error is None
    assert [o[0].tobytes() for o in results[0]] == [o[0].tobytes() for o in results[1]]
