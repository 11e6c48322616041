"""The embedded switch on several cores: one register table served by several shards (threads, each with
its own socket in an SO_REUSEPORT group, steered by job or by slot) gives every sum, packet and counter
that one core gives, whichever shard a datagram reaches; and the kernel steers as the switch counts."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from switchagg import Client, ConfigError, SoftSwitch
from switchagg.switch.model import SwitchModel
from switchagg.switch.native import MAX_SHARDS, NativeSwitch
from switchagg.switch.server import STEERING, home_shard, steering_program
from switchagg.transport import BATCHED_AVAILABLE, sockaddr_in
from switchagg.wire import HEADER_SIZE, PacketType, make_header, unpack_header, values_of

from . import simnet
from .conftest import loopback_config, run_ranks

# tests/test_client.py's and tests/test_reduce_scatter.py's end-to-end tests, collected here again: they run
# against this module's soft_switch, the embedded switch on two cores (steered by job, then by slot)
from .test_client import test_allreduce_matches_numpy as test_allreduce_matches_numpy_on_two_cores
from .test_client import test_dtypes_mean_out_and_async as test_dtypes_mean_out_and_async_on_two_cores
from .test_client import (
    test_foreign_sender_and_fuzzed_headers_change_no_result as test_foreign_sender_and_fuzzed_headers_on_two_cores,
)
from .test_client import test_lengths_not_multiple_of_k as test_lengths_not_multiple_of_k_on_two_cores
from .test_client import (
    test_several_jobs_on_one_switch_are_isolated as test_several_jobs_on_one_switch_are_isolated_on_two_cores,
)
from .test_reduce_scatter import (
    test_each_client_gets_its_shard_through_the_embedded_switch as test_each_client_gets_its_shard_on_two_cores,
)
from .test_switch_model import Out, job, pkt, random_traffic, src

__all__ = ["test_allreduce_matches_numpy_on_two_cores", "test_dtypes_mean_out_and_async_on_two_cores",
           "test_each_client_gets_its_shard_on_two_cores", "test_foreign_sender_and_fuzzed_headers_on_two_cores",
           "test_lengths_not_multiple_of_k_on_two_cores", "test_several_jobs_on_one_switch_are_isolated_on_two_cores"]

needs_linux = pytest.mark.skipif(not BATCHED_AVAILABLE, reason="several cores need Linux's batched sockets")


def home_of(data: bytes, shards: int, steer: str) -> int:
    """Where the steering program sends ``data``: shard 0 when the field it reads is past the datagram's end."""
    if len(data) < (6 if steer == "job" else 8):
        return 0
    job_id, slot = struct.unpack_from(">HH", data.ljust(8, b"\0"), 4)
    return home_shard(job_id, slot, shards, steer)


# ---- the table, shard by shard, without sockets -------------------------------------------------


@pytest.mark.parametrize(("shards", "steer"), [(2, "slot"), (3, "slot"), (3, "job"), (4, "job")])
@pytest.mark.parametrize("served_by", ["home", "another"])
def test_shards_serving_random_traffic_at_once_give_the_one_core_model_s_packets_counters_and_registers(
        shards, steer, served_by):
    """Each thread serves the datagrams its steering gives it (or each its neighbour's: steered wrongly),
    all threads at once. A copy's datagrams reach one thread in the order sent, as a socket's would,
    so every datagram makes the very packets it makes in the model, and the counters summed over the
    shards and every register are the model's. A datagram served off its shard is counted, per shard."""
    rng = np.random.default_rng(20260730 + shards)
    ref, native = SwitchModel(8), NativeSwitch(8, shards, steer)
    for m in (ref, native):
        m.add_job(job(job_id=1, n=3, base=0, slots=2, gen=5))
        m.add_job(job(job_id=7, n=5, base=2, slots=3, gen=6, k=6))
    traffic = list(random_traffic(rng, 6000))
    shift = 0 if served_by == "home" else 1
    served = [0] * shards
    for phase in (traffic[:3000], traffic[3000:]):
        per_shard = [[] for _ in range(shards)]
        for i, (data, _) in enumerate(phase):
            per_shard[(home_of(data, shards, steer) + shift) % shards].append(i)
        # the model's packets as bytes at once: it keeps a result's values for RESULTS_KEPT packets
        want = [[(e.dst, e.payload()) for e in ref.process(data, source)] for data, source in phase]
        got: list[list | None] = [None] * len(phase)

        def serve(shard: int, mine: list[int], phase=phase, got=got) -> None:
            for i in mine:
                got[i] = [(e.dst, e.payload()) for e in native.process(phase[i][0], phase[i][1], shard)]

        run_ranks(shards, lambda s: serve(s, per_shard[s]))  # noqa: B023 - run before the next phase
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            assert g == w, f"datagram {i}"
        for s in range(shards):
            served[s] += len(per_shard[s])
        for m in (ref, native):  # a reset between the phases: every shard sees the new generation
            m.set_generation(1, 8)
    assert native.counters() == ref.counters()
    assert all(native.registers(i) == ref.registers(i) for i in range(16))
    by_shard = [native.counters(s) for s in range(shards)]
    for job_id in (1, 7):
        for name, total in ref.counters()["jobs"][job_id].items():
            assert sum(c["jobs"][job_id][name] for c in by_shard) == total
    for name, total in ref.counters()["global"].items():
        assert sum(c["global"][name] for c in by_shard) == total
    stats = native.shard_stats()
    assert [s["datagrams"] for s in stats] == served and sum(served) == len(traffic)
    assert [s["off_home"] for s in stats] == ([0] * shards if served_by == "home" else served)
    assert sum(1 for n in served if n) >= 2  # the traffic really was spread


def test_a_copy_served_by_two_shards_at_once_counts_every_contribution_once():
    """Two threads serve the same copies at the same time, each a shuffled half of 32 workers'
    contributions, in batches: every copy completes exactly once with the exact sum. Without the
    copy's lock the shards' stages interleave and counts, bitmaps and sums get lost."""
    n, k, slots, rounds = 32, 256, 32, 12
    native = NativeSwitch(slots, 2)
    entry = job(n=n, slots=slots, k=k, gen=3)
    native.add_job(entry)
    rng = np.random.default_rng(7)
    names = np.array([np.frombuffer(sockaddr_in(src(w)), np.uint8) for w in range(n)])
    width = HEADER_SIZE + 4 * k
    for r in range(rounds):
        values = rng.integers(-(2**31), 2**31, (n, 2 * slots, k)).astype(np.int32)
        order = rng.permutation([(w, c) for w in range(n) for c in range(2 * slots)])
        halves = (order[0::2], order[1::2])
        got: list[list[tuple[bytes, bytes]]] = [[], []]

        def serve(shard: int, halves=halves, got=got, values=values, r=r) -> None:
            mine = halves[shard]
            buf = np.frombuffer(b"".join(pkt(int(w), r + 1, values[w, c], slot=int(c) // 2, copy=int(c) % 2,
                                             gen=3, k=k) for w, c in mine), np.uint8)
            offsets = (width * np.arange(len(mine))).astype(np.uint32)
            lengths = np.full(len(mine), width, np.uint32)
            in_names = names[mine[:, 0]]
            out = Out(64, 64 * width)
            start = 0
            while start < len(mine):
                start, made = native.process_batch(buf, offsets, lengths, in_names, start, len(mine), *out.arrays(),
                                                   shard)
                got[shard] += out.packets(made)

        run_ranks(2, serve)
        results = got[0] + got[1]
        assert len(results) == n * 2 * slots  # each copy's result, once, to each of the n workers
        sums = values.sum(axis=0, dtype=np.int64).astype(np.int32)  # wrapping, as the switch adds
        for name, payload in results:
            h = unpack_header(payload)
            assert h.type == PacketType.RESULT and h.chunk == r + 1 and name == sockaddr_in(src(h.worker))
            assert np.array_equal(values_of(payload, k), sums[2 * h.slot + h.copy])
        counters = native.counters()["jobs"][1]
        assert counters["contributions"] == (r + 1) * n * 2 * slots
        assert counters["results_multicast"] == (r + 1) * 2 * slots
        assert counters["duplicate_pending"] == counters["stale"] == 0


@pytest.mark.parametrize("shards", [1, 2])
def test_a_control_operation_waits_for_the_batch_in_progress(shards):
    """A reset during a batch takes effect after it: every probe of the batch is answered with the generation
    the job had when the batch began, and the next probe with the new one. So no packet sees a job half
    installed. (The batch runs without the GIL; the reset is made once its first answer is out.)"""
    native = NativeSwitch(8, shards)
    native.add_job(job(n=2, gen=5))
    count = 1_000_000  # tens of milliseconds: long enough for a loaded host to run this thread meanwhile
    probe = make_header(PacketType.PROBE, job=1, worker=0, key=0x5EED).pack()
    buf = np.frombuffer(probe * count, np.uint8)
    offsets = (HEADER_SIZE * np.arange(count)).astype(np.uint32)
    lengths = np.full(count, HEADER_SIZE, np.uint32)
    names = np.tile(np.frombuffer(sockaddr_in(src(0)), np.uint8), (count, 1))
    caught_mid_batch, batches = False, 0
    while batches < 10 and not caught_mid_batch:
        batches += 1
        out = Out(count + 2, (count + 2) * HEADER_SIZE)
        old = native.jobs[1].generation
        new = old + 1
        batch = threading.Thread(target=native.process_batch, args=(
            buf, offsets, lengths, names, 0, count, *out.arrays(), shards - 1))
        batch.start()
        while not out.lengths[0]:  # the batch's first answer is written: it holds the table now
            assert batch.is_alive(), "the batch failed before it answered"
        running = not out.lengths[count - 1]
        native.set_generation(1, new)
        batch.join()
        generations = out.buf.reshape(-1, HEADER_SIZE)[:count, 12:16].copy().view(">u4").ravel()
        assert (generations == old).all(), f"{(generations != old).sum()} probes saw the reset"
        assert native.process(probe, src(0))[0].header.generation == new
        caught_mid_batch = running
    assert caught_mid_batch, "the reset never came while the batch ran: the test showed nothing"
    assert native.counters()["jobs"][1]["probes"] == batches * (count + 1)


class ShardedSwitch:
    """A SimNet switch: each datagram to the native switch's shard that the steering names (or its neighbour)."""

    def __init__(self, native: NativeSwitch, shift: int) -> None:
        self.native, self.shift = native, shift

    def process(self, data, src):
        data = bytes(data)
        return self.native.process(data, src, (home_of(data, self.native.shards, self.native.steer) + self.shift)
                                   % self.native.shards)


@pytest.mark.parametrize(("shards", "steer", "shift"), [(2, "slot", 0), (3, "slot", 1), (3, "job", 2)])
@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_under_loss_and_duplication_a_sharded_switch_serves_what_one_core_serves(shards, steer, shift, dtype):
    """Workers under 5% loss and 3% duplication each way (the simulated network, seeded): through a switch
    whose datagrams are served by shards, every packet on the wire, every result bit and every counter
    is what one core gives."""
    n, size = 4, 3000
    rng = np.random.default_rng(5)
    xs = [(rng.integers(-10**6, 10**6, size) if dtype == np.int32 else rng.standard_normal(size)).astype(dtype)
          for _ in range(n)]
    sim_job = simnet.Job(n=n, slots=8, k=16)
    lossy = simnet.Impairment(loss=0.05, dup=0.03, jitter=0.0005)
    runs = []
    for native in (NativeSwitch(64), NativeSwitch(64, shards, steer)):
        native.add_job(sim_job.entry())
        model = native if native.shards == 1 else ShardedSwitch(native, shift)
        results, net = simnet.reduce_all(xs, sim_job, up=lossy, down=lossy, seed=11, rounds=2, model=model,
                                         impl="native")
        runs.append((results, net.sent_log, native.counters(), native.shard_stats()))
    (one, log_one, counters_one, _), (many, log_many, counters_many, stats) = runs
    assert log_many == log_one and counters_many == counters_one
    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for ra, rb in zip(one, many, strict=True)
               for a, b in zip(ra, rb, strict=True))
    if dtype == np.int32:
        assert np.array_equal(one[0][0], np.sum(xs, axis=0, dtype=np.int32))
    jobs = counters_one["jobs"][sim_job.job_id]
    assert jobs["results_unicast"] + jobs["duplicate_pending"] > 0  # loss and duplication were recovered from
    assert sum(1 for s in stats if s["datagrams"]) >= (2 if steer == "slot" else 1)
    assert (sum(s["off_home"] for s in stats) == 0) == (shift == 0)


# ---- through sockets: the shards' threads and the kernel's steering ----------------------------------


def wait_for(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@needs_linux
@pytest.mark.parametrize("steer", STEERING)
def test_the_kernel_steers_each_datagram_where_the_switch_counts_it_home(steer):
    """Lone datagrams reach the shard that home_shard names (the BPF program, home_shard and _switch.c agree);
    a datagram too short for the field reaches shard 0; a segmented message of datagrams of several jobs
    and slots reaches one shard whole, and its datagrams for other shards are counted off home."""
    shards = 3
    with SoftSwitch(("127.0.0.1", 0), cores=shards, steer=steer) as sw, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        expected = [0] * shards
        for job_id in range(1, 5):
            for slot in range(40):
                data = make_header(PacketType.PROBE, job=job_id, worker=0, slot=slot).pack()  # no such job
                tx.sendto(data, sw.address)
                expected[home_shard(job_id, slot, shards, steer)] += 1
        tx.sendto(b"abc", sw.address)
        expected[0] += 1
        sent = sum(expected)
        wait_for(lambda: sum(s["datagrams"] for s in sw.shard_stats()) == sent, "the lone datagrams")
        assert [s["datagrams"] for s in sw.shard_stats()] == expected
        assert [s["off_home"] for s in sw.shard_stats()] == [0] * shards
        assert sw.counters()["global"]["not_admitted"] == sent - 1 and sw.counters()["global"]["malformed"] == 1
        if not sw.sockets[0].gso:
            return
        segments = [make_header(PacketType.PROBE, job=j, worker=0, slot=s).pack()
                    for j in range(1, 7) for s in range(6)]
        homes = [home_of(d, shards, steer) for d in segments]
        tx.sendmsg([b"".join(segments)], [(socket.SOL_UDP, 103, struct.pack("=H", HEADER_SIZE))], 0, sw.address)
        wait_for(lambda: sum(s["datagrams"] for s in sw.shard_stats()) == sent + len(segments), "the message")
        (whole,) = [i for i, s in enumerate(sw.shard_stats()) if s["datagrams"] != expected[i]]
        stats = sw.shard_stats()
        assert stats[whole]["datagrams"] == expected[whole] + len(segments)
        assert stats[whole]["off_home"] == sum(h != whole for h in homes) > 0
        assert whole == homes[0]  # steered by its first datagram
        assert sw.counters()["global"]["not_admitted"] == sent - 1 + len(segments)
        assert sw.error is None


@needs_linux
def test_every_shard_socket_is_set_up_as_the_first_and_shares_its_address():
    with SoftSwitch(("127.0.0.1", 0), cores=3) as sw:
        socks = [s.sock for s in sw.sockets]
        assert len(socks) == 3 and len({s.fileno() for s in socks}) == 3
        for s in socks:
            assert s.getsockname() == socks[0].getsockname() == sw.address
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                assert s.getsockopt(socket.SOL_SOCKET, opt) == socks[0].getsockopt(socket.SOL_SOCKET, opt)
            assert fcntl.fcntl(s.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK
            assert s.getsockopt(socket.SOL_UDP, 104) == socks[0].getsockopt(socket.SOL_UDP, 104)  # UDP_GRO
        assert {s.backend for s in sw.sockets} == {sw.backend}


@needs_linux
def test_a_port_another_socket_holds_is_refused_even_one_in_a_reuseport_group_and_port_0_is_a_free_one():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        stranger.bind(("127.0.0.1", 0))
        with pytest.raises(OSError, match="cannot bind UDP"):
            SoftSwitch(stranger.getsockname(), cores=2).start()
    with SoftSwitch(("127.0.0.1", 0), cores=2) as a, SoftSwitch(("127.0.0.1", 0), cores=2) as b:
        assert a.address != b.address


def test_cores_are_checked_before_anything_is_bound():
    for cores in (0, MAX_SHARDS + 1):
        with pytest.raises(ConfigError, match=f"cores = {cores}: the switch runs on 1..{MAX_SHARDS} cores"):
            SoftSwitch(("127.0.0.1", 0), cores=cores)
    with pytest.raises(ConfigError, match="only the C switch"):
        SoftSwitch(("127.0.0.1", 0), cores=2, native=False)
    with pytest.raises(ConfigError, match="batched sockets"):
        SoftSwitch(("127.0.0.1", 0), cores=2, batched=False)
    with pytest.raises(ConfigError, match="steered by job or slot"):
        SoftSwitch(("127.0.0.1", 0), cores=2, steer="worker")
    with pytest.raises(ConfigError, match="shards"):
        NativeSwitch(8, 0)
    with pytest.raises(ValueError, match="shard 2"):
        NativeSwitch(8, 2).process(pkt(0, 1), src(0), 2)


def test_the_steering_program_is_a_few_classic_bpf_instructions():
    by_job, by_slot = steering_program(3, "job"), steering_program(3, "slot")
    assert len(by_job) == 3 * 8 and len(by_slot) == 5 * 8
    assert struct.unpack_from("=HBBI", by_job) == (0x28, 0, 0, 4)  # ld h [4]: the job
    assert struct.unpack_from("=HBBI", by_slot) == (0x28, 0, 0, 6)  # ld h [6]: the slot
    # slots a power of two apart (where a worker's segmented messages start) spread over the shards
    assert {home_shard(1, s, 2, "slot") for s in range(0, 1024, 128)} == {0, 1}
    assert [home_shard(j, 0, 3, "job") for j in range(6)] == [0, 1, 2, 0, 1, 2]


def allreduce_jobs(sw: SoftSwitch, jobs: list[tuple[int, np.dtype]], n: int, size: int):
    """Each job's n ranks allreduce their seeded tensors twice, all jobs at once; returns results and configs."""
    cfgs = [loopback_config(n, switch_port=sw.address[1], k=256, slot_count=16, job_id=j, slot_base=16 * j)
            for j, _ in jobs]
    for cfg in cfgs:
        sw.add_job(cfg)
    inputs = []
    for j, dtype in jobs:
        rng = np.random.default_rng(j)
        inputs.append([(rng.integers(-10**6, 10**6, size) if dtype == np.int32 else rng.standard_normal(size))
                       .astype(dtype) for _ in range(n)])

    def rank(i: int):
        which, r = divmod(i, n)
        with Client(cfgs[which], r) as c:
            return [c.allreduce(inputs[which][r]), c.allreduce(inputs[which][r] * 3)]

    out = run_ranks(len(jobs) * n, rank)
    for o in out:
        assert not isinstance(o, BaseException), o
    return [out[i * n:(i + 1) * n] for i in range(len(jobs))], inputs, cfgs


@needs_linux
@pytest.mark.parametrize(("cores", "steer"), [(2, "job"), (3, "job"), (2, "slot"), (3, "slot")])
def test_allreduces_of_two_jobs_at_once_through_several_cores_are_the_one_core_bits(cores, steer):
    """An int32 job and a float32 job at once: every rank's sums are bit for bit those of a one-core switch
    (int32 numpy's exactly), each job's contributions and finished sums are counted as there, the
    shards' counters add up to the switch's, and steered by job each job's datagrams stay on its shard."""
    jobs = [(1, np.int32), (2, np.float32)]
    with SoftSwitch(("127.0.0.1", 0)) as one:
        want, inputs, _ = allreduce_jobs(one, jobs, 3, 40_000)
        counted = one.counters()["jobs"]
    with SoftSwitch(("127.0.0.1", 0), cores=cores, steer=steer) as sw:
        got, _, cfgs = allreduce_jobs(sw, jobs, 3, 40_000)
        counters, stats = sw.counters(), sw.shard_stats()
        assert sw.error is None
    for (j, dtype), w, g, xs in zip(jobs, want, got, inputs, strict=True):
        for a, b in zip(w, g, strict=True):
            assert all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b, strict=True))
        if dtype == np.int32:
            assert np.array_equal(g[0][0], np.sum(xs, axis=0, dtype=np.int32))
        for name in ("contributions", "results_multicast", "results_to_owner", "bad_count", "slot_out_of_range"):
            assert counters["jobs"][j][name] == counted[j][name], name
    assert len(stats) == cores and sum(s["datagrams"] for s in stats) > 0
    assert all(s["off_home"] <= s["datagrams"] for s in stats)
    if steer == "job":  # each job's packets, segmented or not, all on the shard of its job
        assert all(s["off_home"] == 0 for s in stats)
        busy = {i for i, s in enumerate(stats) if s["datagrams"]}
        assert busy == {home_shard(j, 0, cores, "job") for j, _ in jobs}


@needs_linux
def test_the_control_port_reads_the_one_table_and_sums_the_shards(tmp_path):
    from switchagg.config import Endpoint
    from switchagg.loopback import free_ports
    from switchagg.switch.control_client import request

    (control,) = free_ports(1, socket.SOCK_STREAM)
    with SoftSwitch(("127.0.0.1", 0), control=("127.0.0.1", control), cores=2, steer="slot") as sw:
        (results,), _, (cfg,) = allreduce_jobs(sw, [(1, np.int32)], 2, 5000)
        status = request(Endpoint("127.0.0.1", control), {"op": "status"})
        assert status["cores"] == 2 and len(status["shards"]) == 2
        assert status["shards"] == sw.shard_stats()
        assert status["counters"]["jobs"]["1"] == sw.counters()["jobs"][1]
        assert sum(s["datagrams"] for s in status["shards"]) >= status["counters"]["jobs"]["1"]["contributions"]
        slots = request(Endpoint("127.0.0.1", control), {"op": "slots", "job": 1, "slots": list(range(16))})["slots"]
        # every slot the calls used holds its last chunk with both workers counted, whichever shard served it
        used = [copy for copies in slots.values() for copy in copies if copy["bitmap"]]
        assert used and all(copy["bitmap"] == 0b11 and copy["count"] == 2 for copy in used)
        assert slots == {str(s): v for s, v in sw.slot_state(1, list(range(16))).items()}


# ---- the end-to-end tests of test_client and test_reduce_scatter, through a switch on two cores -----------


@pytest.fixture(params=STEERING)
def soft_switch(request):
    """conftest's switch, on two cores: the tests imported from test_client and test_reduce_scatter take it."""
    if not BATCHED_AVAILABLE:
        pytest.skip("several cores need Linux's batched sockets")
    from switchagg.loopback import free_ports

    (control,) = free_ports(1, socket.SOCK_STREAM)
    sw = SoftSwitch(("127.0.0.1", 0), control=("127.0.0.1", control), cores=2, steer=request.param).start()
    yield sw
    sw.stop()
    assert sw.error is None
