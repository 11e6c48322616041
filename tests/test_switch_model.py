"""Every rule of the switch semantics (docs/protocol.md, "Switch state"), on the pure model and on
NativeSwitch, its C twin that the embedded switch serves with; then seeded random traffic through
both, every packet out and every counter compared."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from switchagg.errors import ConfigError
from switchagg.jobs import Uplink
from switchagg.switch.model import STAGES, JobEntry, SwitchModel, chunk_is_newer
from switchagg.switch.native import NativeSwitch
from switchagg.switch.records import RESULTS_KEPT
from switchagg.transport import NAME_SIZE, sockaddr_in
from switchagg.wire import FLAG_COPY, FLAG_OWNER, HEADER_SIZE, PacketType, make_header, unpack_header, values_of

from . import frames

K = 4
KEY = 0x5EED


def job(job_id=1, n=3, base=0, slots=4, gen=9, k=K, **tree):
    """A job of ``n`` workers; ``tree``: its place in a tree (JobEntry's parent, spans, rank_base, tree_size)."""
    return JobEntry(job_id, gen, KEY, base, slots, k, tuple((f"10.0.0.{i + 1}", 5000 + i) for i in range(n)), **tree)


PARENT = Uplink(("10.0.9.1", 16711), 40, 2, 0xFACE)  # where a tree's leaf sends its partials, as child 2 of job 40
LEAF = {"parent": PARENT, "spans": (2, 1, 1, 3, 1), "rank_base": 4, "tree_size": 20}  # the random traffic's job 7


def from_parent(chunk, values=None, *, up=PARENT, slot=0, copy=0, gen=9, exp=3, k=K, **kw):
    """The parent's RESULT to its child ``up.worker`` (``values`` None: its header alone)."""
    values = np.zeros(0) if values is None else np.asarray(values)
    h = make_header(PacketType.RESULT, job=up.job_id, worker=up.worker, slot=slot, copy=copy, chunk=chunk,
                    generation=gen, key=up.key, exponent=exp, count=len(values))._replace(**kw)
    return h.pack() + values.astype(">i4").tobytes()


def pkt(worker, chunk, values=None, *, job_id=1, slot=0, copy=0, gen=9, key=KEY, exp=3, k=K, **kw):
    values = np.full(k, worker + 1) if values is None else np.asarray(values)
    h = make_header(PacketType.CONTRIB, job=job_id, worker=worker, slot=slot, copy=copy, chunk=chunk,
                    generation=gen, key=key, exponent=exp, count=len(values))._replace(**kw)
    return h.pack() + values.astype(">i4").tobytes()


def src(worker):
    return (f"10.0.0.{worker + 1}", 5000 + worker)


@pytest.fixture(params=[SwitchModel, NativeSwitch])
def model(request):
    """Each test runs on the reference model and on its C twin."""
    return request.param


@pytest.fixture
def sw(model):
    m = model(num_slots=16)
    m.add_job(job())
    return m


def decode(emit):
    data = emit.payload()
    h = unpack_header(data)
    return h, values_of(data, h.count).astype(np.int64)


def jc(m, job_id=1):
    return m.counters()["jobs"][job_id]


def test_power_up_state_is_empty_so_chunk_zero_is_a_first_write(sw):
    assert sw.process(pkt(0, 0), src(0)) == []
    assert sw.slot_state(1, 0)[0] == {"copy": 0, "generation": 9, "chunk": 0, "bitmap": 1, "count": 1}


def test_first_writes_later_add_last_multicasts_to_every_worker(sw):
    assert sw.process(pkt(0, 5, [1, 2, 3, 4], exp=2), src(0)) == []
    assert sw.process(pkt(1, 5, [10, 20, 30, 40], exp=7), src(1)) == []
    out = sw.process(pkt(2, 5, [100, 200, 300, 400], exp=-1), src(2))
    assert [e.dst for e in out] == [src(0), src(1), src(2)]
    for rank, e in enumerate(out):
        h, v = decode(e)
        assert h.type == PacketType.RESULT and h.worker == rank and h.chunk == 5
        assert h.exponent == 7  # the max proposal
        assert v.tolist() == [111, 222, 333, 444]
    c = jc(sw)
    assert c["contributions"] == 3 and c["results_multicast"] == 1


def test_new_chunk_on_a_copy_resets_it(sw):
    for w in range(3):
        sw.process(pkt(w, 1, [5] * K), src(w))
    sw.process(pkt(0, 9, [1] * K), src(0))  # a newer chunk: write, not add
    assert sw.slot_state(1, 0)[0] == {"copy": 0, "generation": 9, "chunk": 9, "bitmap": 1, "count": 1}
    sw.process(pkt(1, 9, [1] * K), src(1))
    out = sw.process(pkt(2, 9, [1] * K), src(2))
    assert decode(out[0])[1].tolist() == [3] * K


def test_a_result_survives_later_packets_on_its_copy_until_sent(sw):
    """A server sends a batch's emits after the batch: a newer chunk on the same copy must not change them."""
    for w in range(2):
        sw.process(pkt(w, 1, [5] * K), src(w))
    out = sw.process(pkt(2, 1, [5] * K), src(2))
    batch = [sw.process(pkt(w, 9, [w + 100] * K), src(w)) for w in range(3)]  # the copy reused, completed
    assert out[0].values.tolist() == [15] * K and not out[0].values.flags.writeable
    assert batch[-1][0].values.tolist() == [303] * K
    again = [sw.process(pkt(w, 20 + r, [1] * K), src(w))[-1:] for r in range(RESULTS_KEPT - 2) for w in range(3)]
    assert again[-1][0].values.tolist() == [3] * K
    assert out[0].values.tolist() == [15] * K  # RESULTS_KEPT results on, and still intact


def test_repeat_after_completion_gets_stored_result_unicast(sw):
    for w in range(3):
        sw.process(pkt(w, 4), src(w))
    out = sw.process(pkt(1, 4), src(1))
    assert len(out) == 1 and out[0].dst == src(1)
    h, v = decode(out[0])
    assert h.type == PacketType.RESULT and v.tolist() == [6] * K
    assert jc(sw)["results_unicast"] == 1
    again = sw.process(pkt(1, 4), src(1))  # and it is not added twice
    assert decode(again[0])[1].tolist() == [6] * K


def test_repeat_before_completion_is_dropped_and_counted(sw):
    sw.process(pkt(0, 4), src(0))
    assert sw.process(pkt(0, 4), src(0)) == []
    assert jc(sw)["duplicate_pending"] == 1
    sw.process(pkt(1, 4), src(1))
    out = sw.process(pkt(2, 4), src(2))
    assert decode(out[0])[1].tolist() == [6] * K  # the repeat was not added


def owned(worker, chunk, owner, values=None, *, copy=0, **kw):
    """A reduce-scatter chunk's contribution: FLAG_OWNER set, its sum whole to ``owner`` alone."""
    return pkt(worker, chunk, values, copy=copy, **{"flags": FLAG_OWNER | copy, "owner": owner, **kw})


def test_an_owned_chunk_goes_whole_to_its_owner_and_as_a_header_to_the_others(sw):
    """Every worker gets the RESULT (it frees the slot and carries the next exponent); only the owner its values."""
    sw.process(owned(0, 5, 1, [1, 2, 3, 4], exp=2, copy=1), src(0))
    sw.process(owned(2, 5, 1, [10, 20, 30, 40], exp=7, copy=1), src(2))
    out = sw.process(owned(1, 5, 1, [100, 200, 300, 400], exp=-1, copy=1), src(1))
    assert [e.dst for e in out] == [src(0), src(1), src(2)]
    heads = [unpack_header(e.payload()) for e in out]
    for rank, h in enumerate(heads):
        assert h._replace(worker=0, count=0) == heads[0]._replace(count=0)  # the same header but recipient, count
        assert h.type == PacketType.RESULT and h.worker == rank and h.flags == FLAG_OWNER | FLAG_COPY
        assert (h.owner, h.exponent, h.chunk, h.slot, h.generation) == (1, 7, 5, 0, 9)
    assert decode(out[1])[1].tolist() == [111, 222, 333, 444] and heads[1].count == K
    for bare in (out[0], out[2]):
        assert bare.values is None and len(bare.payload()) == HEADER_SIZE and unpack_header(bare.payload()).count == 0
    c = jc(sw)
    assert (c["contributions"], c["results_to_owner"], c["results_multicast"]) == (3, 1, 0)
    assert sw.registers(1).values == np.array([111, 222, 333, 444], ">i4").tobytes()  # kept for repeats


def test_a_repeat_of_an_owned_chunk_is_whole_for_its_owner_and_a_header_for_the_others(sw):
    for w in range(3):
        sw.process(owned(w, 4, 2, exp=w), src(w))
    (mine,) = sw.process(owned(2, 4, 2), src(2))
    (theirs,) = sw.process(owned(0, 4, 2), src(0))
    assert mine.dst == src(2) and decode(mine)[1].tolist() == [6] * K
    h = unpack_header(theirs.payload())
    assert theirs.dst == src(0) and theirs.values is None and len(theirs.payload()) == HEADER_SIZE
    assert (h.type, h.worker, h.owner, h.flags, h.exponent, h.count) == (PacketType.RESULT, 0, 2, FLAG_OWNER, 2, 0)
    (plain,) = sw.process(pkt(0, 4), src(0))  # a repeat without the flag: the whole sum, as always
    assert decode(plain)[1].tolist() == [6] * K
    c = jc(sw)
    assert (c["results_unicast"], c["results_to_owner"], c["contributions"]) == (3, 1, 3)


def test_the_completing_contribution_says_whether_and_to_whom_a_sum_goes_whole(sw):
    """All ranks mark a chunk alike; where they do not, the last one's header is the result's."""
    sw.process(owned(0, 1, 0), src(0))
    sw.process(owned(1, 1, 0), src(1))
    assert [e.values is None for e in sw.process(pkt(2, 1), src(2))] == [False] * 3
    sw.process(pkt(0, 2), src(0))
    sw.process(owned(1, 2, 0), src(1))
    assert [e.values is None for e in sw.process(owned(2, 2, 2), src(2))] == [True, True, False]
    c = jc(sw)
    assert (c["results_multicast"], c["results_to_owner"]) == (1, 1)


def test_a_one_worker_job_sends_an_owned_sum_whole(model):
    m = model(16)
    m.add_job(job(n=1))
    (out,) = m.process(owned(0, 3, 0), src(0))
    assert decode(out)[1].tolist() == [1] * K and jc(m)["results_to_owner"] == 1


def test_an_owner_outside_the_job_is_dropped_by_the_job_and_one_without_the_flag_is_malformed(sw):
    assert sw.process(owned(0, 3, 3), src(0)) == []  # 3 workers: ranks 0..2
    assert sw.process(owned(0, 3, 255), src(0)) == []
    assert sw.process(query(0, 3, flags=FLAG_OWNER, owner=3), src(0)) == []
    assert sw.process(pkt(0, 3, owner=1), src(0)) == []  # an owner, no flag
    assert sw.process(owned(0, 3, 1, flags=FLAG_OWNER | 0x04), src(0)) == []  # a flag no one defined
    assert jc(sw)["bad_owner"] == 3 and sw.counters()["global"]["malformed"] == 2
    assert sw.registers(0).count == 0  # none of them reached the state
    assert sw.process(owned(0, 3, 1, gen=0), src(0)) == []  # generation 0 and the slot are checked first
    assert sw.process(owned(0, 3, 3, slot=4), src(0)) == []
    c = jc(sw)
    assert (c["bad_owner"], c["wrong_generation"], c["slot_out_of_range"]) == (3, 1, 1)


def test_queries_and_probes_may_carry_the_owner(sw):
    """A worker may mark every packet of an owned chunk: a query and a probe are answered as unmarked ones."""
    sw.process(owned(0, 3, 2), src(0))
    assert pending(sw.process(query(1, 3, flags=FLAG_OWNER, owner=2), src(1))) == (src(1), 0b1)
    probe = make_header(PacketType.PROBE, job=1, worker=0, key=KEY, owner=2).pack()
    (reply,) = sw.process(probe, src(0))
    assert unpack_header(reply.payload()) == unpack_header(probe)._replace(type=PacketType.PROBE_REPLY, generation=9)
    assert (jc(sw)["queries"], jc(sw)["probes"]) == (1, 1)


@pytest.mark.parametrize("complete", [False, True])
def test_older_chunk_is_stale_whether_or_not_the_copy_is_complete(sw, complete):
    for w in range(3 if complete else 1):
        sw.process(pkt(w, 100), src(w))
    before = sw.slot_state(1, 0)
    assert sw.process(pkt(1, 99), src(1)) == []
    assert jc(sw)["stale"] == 1
    assert sw.slot_state(1, 0) == before  # the late duplicate wiped nothing
    if complete:
        assert len(sw.process(pkt(0, 100), src(0))) == 1


def test_chunk_ids_compare_across_wrap_around(sw):
    assert chunk_is_newer(0, 0xFFFFFFFF) and chunk_is_newer(5, 0xFFFFFFF0)
    assert not chunk_is_newer(0xFFFFFFFF, 0) and not chunk_is_newer(7, 7)
    sw.process(pkt(0, 0xFFFFFFFE), src(0))
    sw.process(pkt(0, 1), src(0))  # newer across the wrap: a first write
    assert sw.slot_state(1, 0)[0]["chunk"] == 1
    assert sw.process(pkt(1, 0xFFFFFFFE), src(1)) == []
    assert jc(sw)["stale"] == 1


def test_two_shadow_copies_are_independent(sw):
    for w in range(3):
        sw.process(pkt(w, 10, copy=0), src(w))
    sw.process(pkt(0, 14, copy=1), src(0))  # worker 0 moves on to the other copy
    out = sw.process(pkt(2, 10, copy=0), src(2))  # worker 2 still retransmits the old one
    assert decode(out[0])[1].tolist() == [6] * K


def test_a_reset_changes_the_probes_answer_not_which_runs_are_taken(model):
    """The installed generation is where a run's join starts; packets carry their run's session generation,
    so an old run's packets are still summed, under their own tag, and a new run's start afresh."""
    m = model(16)
    m.add_job(job(gen=1))
    m.process(pkt(0, 50, gen=1), src(0))
    m.process(pkt(1, 50, gen=1), src(1))
    m.set_generation(1, 2)
    probe = make_header(PacketType.PROBE, job=1, worker=0, key=KEY).pack()
    assert unpack_header(m.process(probe, src(0))[0].payload()).generation == 2
    out = m.process(pkt(2, 50, gen=1), src(2))  # the old run's last contribution: its own sum
    assert decode(out[0])[1].tolist() == [6] * K and decode(out[0])[0].generation == 1
    m.process(pkt(0, 0, gen=2), src(0))  # chunk 0 < 50, yet a first write: the old run's state is empty
    m.process(pkt(1, 0, gen=2), src(1))
    out = m.process(pkt(2, 0, gen=2), src(2))
    assert decode(out[0])[1].tolist() == [6] * K  # nothing of the old run leaked in
    assert jc(m)["wrong_generation"] == 0 and jc(m)["stale"] == 0


def test_any_generation_but_zero_is_a_run_summed_under_its_own_tag(sw):
    """A session generation the job was never installed with is taken: its tag is (generation, chunk)."""
    for w in range(2):
        assert sw.process(pkt(w, 7, [w + 1] * K, gen=0xDEADBEEF), src(w)) == []
    assert sw.registers(0).tag == 0xDEADBEEF << 32 | 7
    out = sw.process(pkt(2, 7, [3] * K, gen=0xDEADBEEF), src(2))
    assert [decode(e)[0].generation for e in out] == [0xDEADBEEF] * 3
    assert decode(out[0])[1].tolist() == [6] * K
    assert pending(sw.process(query(1, 7, gen=0xDEADBEEF), src(1))) == (src(1), 0b111)
    assert pending(sw.process(query(1, 7), src(1))) == (src(1), 0)  # the job's generation: another run, empty
    assert jc(sw)["wrong_generation"] == 0 and jc(sw)["results_multicast"] == 1


def test_generation_zero_is_dropped_even_where_the_copy_powered_up_holding_it(sw):
    """Every tag powers up as (generation 0, chunk 0): a packet of generation 0 and chunk 0 would read a copy
    no run used as holding its chunk (a repeat, a result of zeros), so generation 0 is never taken."""
    before = sw.registers(0)
    for w in range(3):
        assert sw.process(pkt(w, 0, gen=0), src(w)) == []
    assert sw.process(query(0, 0, gen=0), src(0)) == []
    assert sw.registers(0) == before
    c = jc(sw)
    assert (c["wrong_generation"], c["contributions"], c["queries"], c["stale"]) == (4, 0, 0, 0)
    probe = make_header(PacketType.PROBE, job=1, worker=0, key=KEY).pack()  # a probe's is not checked
    assert unpack_header(sw.process(probe, src(0))[0].payload()).generation == 9


def test_two_runs_on_one_copy_start_it_afresh_by_turns_and_never_mix(sw):
    """Another generation reads the copy as EMPTY whatever chunk it holds (older or newer): it starts the copy
    afresh, and the run it displaced starts afresh again when it comes back; neither sum holds the other's."""
    a, b = 0x0A0A0A0A, 0x0B0B0B0B
    sw.process(pkt(0, 100, [1] * K, gen=a), src(0))
    sw.process(pkt(1, 100, [2] * K, gen=a), src(1))
    assert sw.process(pkt(0, 3, [100] * K, gen=b), src(0)) == []  # an older chunk id, yet another run: fresh
    assert sw.registers(0)[:3] == (b << 32 | 3, 0b1, 1)
    sw.process(pkt(1, 3, [200] * K, gen=b), src(1))
    out = sw.process(pkt(2, 3, [300] * K, gen=b), src(2))
    assert decode(out[0])[1].tolist() == [600] * K  # b's sum alone
    assert sw.process(pkt(2, 100, [4] * K, gen=a), src(2)) == []  # a's last one: a fresh copy, not a's sum
    assert sw.registers(0)[:3] == (a << 32 | 100, 0b100, 1)
    sw.process(pkt(0, 100, [1] * K, gen=a), src(0))  # a's workers resend what the switch lost to b
    out = sw.process(pkt(1, 100, [2] * K, gen=a), src(1))
    assert decode(out[0])[1].tolist() == [7] * K  # a's sum alone
    c = jc(sw)
    assert (c["stale"], c["duplicate_pending"], c["wrong_generation"], c["results_multicast"]) == (0, 0, 0, 2)


@pytest.mark.parametrize("change, reason", [
    ({"key": KEY + 1}, "not_admitted"),
    ({"worker": 3}, "not_admitted"),
    ({"job_id": 2}, "not_admitted"),
    ({"version": 2}, "bad_version"),
    ({"owner": 1}, "malformed"),
    ({"flags": 0x04}, "malformed"),
    ({"flags": 0x80, "owner": 1}, "malformed"),
    ({"worker": 32}, "malformed"),
    ({"type": PacketType.RESULT}, "malformed"),
    ({"type": 77}, "malformed"),
])
def test_bad_packets_are_dropped_and_counted_by_reason(sw, change, reason):
    kw = dict(change)
    data = pkt(kw.pop("worker", 0), 3, job_id=kw.pop("job_id", 1), key=kw.pop("key", KEY), **kw)
    assert sw.process(data, src(0)) == []
    assert sw.counters()["global"][reason] == 1


def test_foreign_source_address_is_not_admitted(sw):
    assert sw.process(pkt(0, 3), ("10.9.9.9", 5000)) == []
    assert sw.process(pkt(0, 3), ("10.0.0.1", 5999)) == []
    assert sw.counters()["global"]["not_admitted"] == 2


def test_length_and_count_checks(sw):
    good = pkt(0, 3)
    assert sw.process(good[:HEADER_SIZE - 1], src(0)) == []
    assert sw.process(good[:-4], src(0)) == []  # count says 4 values, 3 are there
    assert sw.process(good + b"\0" * 4, src(0)) == []
    assert sw.counters()["global"]["malformed"] == 3
    assert sw.process(pkt(0, 3, values=[1] * (K + 1)), src(0)) == []
    assert jc(sw)["bad_count"] == 1
    assert sw.process(pkt(0, 3, slot=4), src(0)) == []
    assert jc(sw)["slot_out_of_range"] == 1
    assert sw.slot_state(1, 0)[0]["count"] == 0


@pytest.mark.parametrize("size", [HEADER_SIZE + 1, 500, 1023 + HEADER_SIZE, 9000])
def test_junk_of_any_length_is_a_counted_drop(sw, size):
    """NativeSwitch.process sizes its out arrays for what any datagram may make, as the model takes anything."""
    assert sw.process(bytes(size), src(0)) == []
    assert sw.counters()["global"]["bad_version"] == 1


def test_counts_whose_length_wraps_around_16_bits_are_malformed(sw):
    """A count 16384 higher makes 24 + 4 * count 65536 bytes longer: no datagram is that long."""
    for count, values in ((0x4000, []), (0x4000 + K, [1] * K), (0xC000 + K, [1] * K)):
        assert sw.process(pkt(0, 3, values=values, count=count), src(0)) == []
    probe = make_header(PacketType.PROBE, job=1, worker=0, key=KEY, count=0x4000).pack()
    assert sw.process(probe, src(0)) == []
    assert sw.counters()["global"]["malformed"] == 4 and jc(sw)["bad_count"] == 0


SWITCH = ("10.0.0.254", 16711)


def frame(worker: int, payload: bytes, **ip) -> bytes:
    """``payload`` from ``worker`` to the switch, in a frame; ``ip`` changes its IPv4 header (frames.rewrite_ip)."""
    f = frames.build("02:00:00:00:00:01", "02:00:00:00:00:fe", src(worker), SWITCH, payload)
    return frames.rewrite_ip(f, **ip) if ip else f


def test_a_frame_counts_only_the_datagram_its_lengths_say(sw):
    """What the frame holds past the IPv4 datagram is not the datagram's: a short datagram stays short."""
    short = pkt(0, 3, version=2)[:20]
    assert sw.process_frame(frame(0, short) + bytes(8)) == []  # the version byte is there, in the frame
    assert sw.counters()["global"] == {"malformed": 1, "bad_version": 0, "not_admitted": 0, "ip_options": 0,
                                       "fragment": 0}
    good = [frame(w, pkt(w, 3)) + b"trailer" for w in range(3)]
    assert [len(sw.process_frame(f)) for f in good] == [0, 0, 3]
    whole = frame(0, pkt(0, 4))
    assert sw.process_frame(whole[:-1]) == []  # the frame ends before the datagram does
    assert sw.process_frame(whole[:38] + (4 + HEADER_SIZE).to_bytes(2, "big") + whole[40:]) == []  # UDP length
    assert sw.process_frame(frame(0, pkt(0, 4), ip_length=0xFFFF)) == []
    assert sw.counters()["global"]["malformed"] == 4 and jc(sw)["contributions"] == 3


def test_ip_options_and_fragments_are_counted_and_other_frames_left_alone(sw):
    data = pkt(0, 3)
    assert sw.process_frame(frame(0, data, options=bytes(4))) == []
    assert sw.process_frame(frame(0, data, options=b"\x94\x04\x00\x00", fragment=0x2000)) == []  # and a fragment
    for fragment in (0x2000, 0x6000, 0x0001, 0x4100):  # more fragments (DF or not), an offset (the last one's too)
        assert sw.process_frame(frame(0, data, fragment=fragment)) == []
    counted = sw.counters()["global"]
    assert counted["ip_options"] == 2 and counted["fragment"] == 4
    udp = frame(0, data)
    other = [udp[:12] + b"\x86\xdd" + udp[14:], udp[:23] + b"\x06" + udp[24:],  # IPv6; TCP
             udp[:36] + (5000).to_bytes(2, "big") + udp[38:], udp[:41]]  # another UDP port; a runt
    assert [sw.process_frame(f) for f in other] == [[]] * 4
    assert sw.counters()["global"] == counted and jc(sw)["contributions"] == 0


def test_incoming_ip_checksums_are_not_verified(sw):
    """Admission and the length checks cover the fields the switch relies on; what it writes has a right
    checksum (the P4 program works a reply's out afresh: test_p4_source.py)."""
    probe = make_header(PacketType.PROBE, job=1, worker=2, key=KEY).pack()
    (reply,) = sw.process_frame(frame(2, probe, checksum=0xBAD))
    assert reply.dst == src(2) and reply.header.type == PacketType.PROBE_REPLY
    assert [len(sw.process_frame(frame(w, pkt(w, 3), checksum=w))) for w in range(3)] == [0, 0, 3]


def test_probe_is_answered_with_the_generation_only_when_admitted(sw):
    probe = make_header(PacketType.PROBE, job=1, worker=2, key=KEY).pack()
    out = sw.process(probe, src(2))
    assert len(out) == 1 and out[0].dst == src(2)
    h = unpack_header(out[0].payload())
    assert h.type == PacketType.PROBE_REPLY and h.generation == 9
    assert sw.process(probe, src(1)) == []
    assert jc(sw)["probes"] == 1 and sw.counters()["global"]["not_admitted"] == 1


def query(worker, chunk, *, job_id=1, slot=0, copy=0, gen=9, key=KEY, **kw):
    return make_header(PacketType.QUERY, job=job_id, worker=worker, slot=slot, copy=copy, chunk=chunk,
                       generation=gen, key=key)._replace(**kw).pack()


def pending(out):
    """The bitmap a query's one answer carries (a PENDING's key)."""
    (reply,) = out
    h = unpack_header(reply.payload())
    assert h.type == PacketType.PENDING and h.count == 0 and len(reply.payload()) == HEADER_SIZE
    return reply.dst, h.key


def test_a_query_is_answered_with_the_bitmap_of_the_chunk_and_changes_nothing(sw):
    assert pending(sw.process(query(1, 5), src(1))) == (src(1), 0)  # an empty copy
    sw.process(pkt(0, 5), src(0))
    sw.process(pkt(2, 5), src(2))
    before = sw.slot_state(1, 0)
    assert pending(sw.process(query(1, 5), src(1))) == (src(1), 0b101)  # worker 1's is missing
    assert pending(sw.process(query(0, 5), src(0))) == (src(0), 0b101)  # worker 0 waits for it
    assert pending(sw.process(query(0, 6), src(0))) == (src(0), 0)  # a newer chunk: not held yet
    assert sw.slot_state(1, 0) == before  # a query writes nothing, not even a newer chunk's tag
    assert len(sw.process(pkt(1, 5), src(1))) == 3
    assert pending(sw.process(query(2, 5), src(2))) == (src(2), 0b111)  # done: resend for the result
    (h, _), = [decode(e) for e in sw.process(pkt(2, 5), src(2))]
    assert h.type == PacketType.RESULT
    assert jc(sw)["queries"] == 5 and jc(sw)["results_unicast"] == 1


def test_a_query_on_a_copy_that_moved_on_is_stale_and_other_runs_read_it_empty(sw):
    sw.process(pkt(0, 7), src(0))
    assert sw.process(query(0, 6), src(0)) == []
    assert pending(sw.process(query(0, 7, copy=1), src(0))) == (src(0), 0)  # the other copy is its own
    assert pending(sw.process(query(0, 6, gen=8), src(0))) == (src(0), 0)  # another run: the copy is empty to it
    assert sw.process(query(0, 7, gen=0), src(0)) == []
    assert sw.process(query(0, 7, slot=4), src(0)) == []
    assert sw.process(query(0, 7, key=1), src(0)) == []
    c = jc(sw)
    assert (c["stale"], c["queries"], c["wrong_generation"], c["slot_out_of_range"]) == (1, 2, 1, 1)
    assert sw.counters()["global"]["not_admitted"] == 1


def test_a_query_with_values_is_malformed(sw):
    assert sw.process(query(0, 7, count=K) + bytes(4 * K), src(0)) == []
    assert sw.process(query(0, 7, count=1), src(0)) == []  # a count its length does not hold
    assert sw.counters()["global"]["malformed"] == 2 and jc(sw)["queries"] == 0


def test_jobs_are_isolated_and_cannot_overlap(model):
    m = model(16)
    m.add_job(job(job_id=1, base=0, slots=4))
    with pytest.raises(ConfigError, match="overlap"):
        m.add_job(job(job_id=2, base=3, slots=4))
    with pytest.raises(ConfigError, match="already installed"):
        m.add_job(job(job_id=1, base=8, slots=4))
    with pytest.raises(ConfigError, match="16"):
        m.add_job(job(job_id=3, base=14, slots=4))
    m.add_job(job(job_id=2, base=4, slots=4, n=2))
    m.process(pkt(0, 1, job_id=1, values=[1] * K), src(0))
    m.process(pkt(0, 1, job_id=2, values=[1000] * K), src(0))
    out = m.process(pkt(1, 1, job_id=2, values=[1000] * K), src(1))
    assert len(out) == 2 and decode(out[0])[1].tolist() == [2000] * K
    assert m.slot_state(1, 0)[0]["count"] == 1  # job 1's slot 0 is untouched


def test_each_packet_touches_registers_once_in_the_documented_order():
    sw = SwitchModel(16)  # the reference model records the order; the C twin is held to its output
    sw.add_job(job())
    sw.trace = []
    cases = [pkt(0, 1), pkt(0, 1), pkt(1, 1), pkt(2, 1), pkt(2, 1), pkt(0, 0)]
    for data in cases:
        start = len(sw.trace)
        sw.process(data, src(unpack_header(data).worker))
        touched = sw.trace[start:]
        assert len(touched) == len(set(touched))
        assert touched == list(STAGES[: len(touched)])  # a prefix of tag, bitmap, count, exponent, values
    assert sw.trace.count("values") == 4  # 3 contributions + 1 repeat served after completion


def test_a_leaf_touches_registers_once_in_the_documented_order_for_its_partials_and_its_parents_results():
    sw = SwitchModel(16)
    sw.add_job(job(parent=PARENT, rank_base=4, tree_size=9))
    sw.trace = []
    cases = [(pkt(0, 1), src(0)), (pkt(1, 1), src(1)), (pkt(2, 1), src(2)), (pkt(2, 1), src(2)),
             (from_parent(1, [5] * K), PARENT.address), (from_parent(1, [5] * K), PARENT.address), (pkt(0, 1), src(0))]
    for data, source in cases:
        start = len(sw.trace)
        sw.process(data, source)
        touched = sw.trace[start:]
        assert len(touched) == len(set(touched)) and touched == list(STAGES[: len(touched)])
    assert sw.trace.count("values") == 6  # 3 contributions, the repeat sent up, the result taken, the repeat served


def test_sums_wrap_like_int32_hardware(sw):
    sw.process(pkt(0, 1, [2**31 - 1] * K), src(0))
    sw.process(pkt(1, 1, [1] * K), src(1))
    out = sw.process(pkt(2, 1, [0] * K), src(2))
    assert decode(out[0])[1].tolist() == [-(2**31)] * K


def test_counters_outlive_a_reset_and_go_with_the_job(model):
    m = model(16)
    m.add_job(job())
    m.process(pkt(0, 1), src(0))
    m.set_generation(1, 10)
    assert jc(m)["contributions"] == 1
    m.remove_job(1)
    assert 1 not in m.counters()["jobs"]
    m.add_job(job())
    assert jc(m)["contributions"] == 0
    assert m.process(pkt(0, 1), src(0)) == []  # admitted again: a first write


EMPTY = (0, 0, 0, 0, None)  # a copy's registers at power-up (CopyState)


def test_removing_a_job_returns_its_slots_to_the_power_up_state(model):
    m = model(16)
    m.add_job(job(base=2, slots=2))
    m.add_job(job(job_id=2, base=0, slots=2, n=2))
    for slot in range(2):
        m.process(pkt(0, 5, slot=slot, copy=slot), src(0))
        m.process(pkt(0, 5, job_id=2, slot=slot), src(0))
    m.remove_job(1)
    assert [tuple(m.registers(i)) for i in range(4, 8)] == [EMPTY] * 4
    assert m.registers(0).count == 1  # job 2's slots are its own


@pytest.mark.parametrize("remove", [True, False], ids=["removed", "slots-given-to-another-job"])
def test_a_job_re_added_with_its_generation_and_another_k_starts_on_empty_slots(model, remove):
    """An operator's pinned generation, undeploy, change K, redeploy: the old chunks are not the new job's."""
    m = model(16)
    m.add_job(job(gen=9, k=K))
    m.process(pkt(0, 5, k=K), src(0))
    m.process(pkt(1, 5, k=K), src(1))
    m.remove_job(1)
    m.add_job(job(gen=9, k=6) if remove else job(job_id=3, gen=9, k=6))
    job_id = 1 if remove else 3
    assert m.process(pkt(2, 5, job_id=job_id, k=6), src(2)) == []
    assert m.slot_state(job_id, 0)[0] == {"copy": 0, "generation": 9, "chunk": 5, "bitmap": 4, "count": 1}
    m.process(pkt(0, 5, job_id=job_id, k=6), src(0))
    out = m.process(pkt(1, 5, job_id=job_id, k=6), src(1))
    assert decode(out[0])[1].tolist() == [6] * 6
    assert jc(m, job_id)["bad_count"] == 0


def test_the_c_switch_drops_a_contribution_its_copy_holds_another_k_for():
    """Updating an installed job's K in C (which NativeSwitch never does: its add clears) is a counted drop, not
    a sum past the stored values."""
    m = NativeSwitch(16)
    m.add_job(job(gen=9, k=K))
    m.process(pkt(0, 5, k=K), src(0))
    e = job(gen=9, k=6)
    m._install(e)  # the installed job updated in place, as a reset is
    assert m.process(pkt(1, 5, k=6), src(1)) == []
    assert jc(m)["bad_count"] == 1 and m.registers(0).count == 1


def random_traffic(rng, n_packets, ks=(K, 6), current=None):
    """Two jobs' workers sending, retransmitting, going stale, plus strangers and broken packets (jobs 1 and 7
    of K = ``ks``, as the tests install them); ``current`` carries on where another's traffic left off."""
    jobs = [job(job_id=1, n=3, base=0, slots=2, gen=5, k=ks[0]),
            job(job_id=7, n=5, base=2, slots=3, gen=6, k=ks[1], **LEAF)]
    current = {} if current is None else current  # (job, slot, copy) -> the chunk its workers are on; ids start
    # just before the wrap
    for _ in range(n_packets):
        j = jobs[rng.integers(len(jobs))]
        worker = int(rng.integers(j.n_workers))
        slot, copy = int(rng.integers(j.slot_count)), int(rng.integers(2))
        chunk = current.setdefault((j.job_id, slot, copy), 0xFFFFFFFE)
        if rng.random() < 0.08:
            chunk = current[(j.job_id, slot, copy)] = (chunk + 1) & 0xFFFFFFFF
        elif rng.random() < 0.05:
            chunk = (chunk - 1) & 0xFFFFFFFF  # a late duplicate of the chunk before
        values = rng.integers(-(2**31), 2**31, j.values_per_packet + (rng.random() < 0.02))  # some of wrong K
        kw = dict(job_id=j.job_id, slot=slot, copy=copy, gen=j.generation, exp=int(rng.integers(-128, 128)))
        if chunk % 3 == 0:  # a reduce-scatter's chunk, every rank naming its owner, now and then one outside the job
            kw |= {"flags": FLAG_OWNER | copy, "owner": chunk % j.tree_ranks if rng.random() < 0.98 else j.tree_ranks}
        data, source = pkt(worker, chunk, values, **kw), j.workers[worker]
        roll = rng.random()
        if roll < 0.05:
            data = data[: rng.integers(len(data))]  # truncated
        elif roll < 0.08:
            source = ("10.9.9.9", 4000)  # a stranger
        elif roll < 0.09:
            data = pkt(worker, chunk, values, **{**kw, "gen": kw["gen"] + 1})  # another run: its own tag
        elif roll < 0.10:
            data = pkt(worker, chunk, values, **{**kw, "gen": 0})  # what every tag powers up holding
        elif roll < 0.12:
            data = make_header(PacketType.PROBE, job=j.job_id, worker=worker, key=KEY).pack()
        elif roll < 0.14:
            data = query(worker, chunk, **{k: v for k, v in kw.items() if k != "exp"})
        elif roll < 0.17:
            b = bytearray(data)
            b[rng.integers(HEADER_SIZE)] ^= 1 << int(rng.integers(8))  # a flipped header bit
            data = bytes(b)
        elif roll < 0.19:  # a count whose 24 + 4 * count wraps around to the length in 16 bits
            data = pkt(worker, chunk, values, **kw, count=(len(values) + 0x4000 * int(rng.integers(1, 4))) & 0xFFFF)
        elif roll < 0.27 and j.parent is not None:  # the parent's result: whole, its header alone, now and then
            # from a stranger or naming another child, of another chunk or K
            sent, kw = values if rng.random() < 0.8 else None, {k: v for k, v in kw.items() if k != "job_id"}
            data, source = from_parent(chunk, sent, **kw), j.parent.address
            if rng.random() < 0.1:
                source = ("10.9.9.9", 16711)
            elif rng.random() < 0.1:
                data = from_parent(chunk, sent, up=Uplink(PARENT.address, PARENT.job_id, 3, PARENT.key), **kw)
        yield data, source


@pytest.fixture
def leaf(model):
    """A switch whose job 1 (3 workers, tree ranks 4..6 of 9) is child 2 of PARENT's job 40."""
    m = model(num_slots=16)
    m.add_job(job(parent=PARENT, rank_base=4, tree_size=9))
    return m


def test_a_leaf_sends_its_finished_partial_up_as_one_contribution_and_nothing_down(leaf):
    leaf.process(pkt(0, 5, [1, 2, 3, 4], exp=2, copy=1), src(0))
    leaf.process(pkt(1, 5, [10, 20, 30, 40], exp=7, copy=1), src(1))
    (up,) = leaf.process(pkt(2, 5, [100, 200, 300, 400], exp=-1, copy=1), src(2))
    h, values = decode(up)
    assert up.dst == PARENT.address and values.tolist() == [111, 222, 333, 444]
    assert (h.type, h.job, h.worker, h.key) == (PacketType.CONTRIB, PARENT.job_id, PARENT.worker, PARENT.key)
    assert (h.chunk, h.slot, h.copy, h.generation, h.exponent) == (5, 0, 1, 9, 7)  # the children's largest exponent
    c = jc(leaf)
    assert (c["contributions"], c["partials_up"], c["results_multicast"]) == (3, 1, 0)
    assert leaf.registers(1).count == 3  # n: the partial went up and awaits the parent's sum


def test_the_parents_result_is_stored_and_sent_down_to_every_child(leaf):
    for w in range(3):
        leaf.process(pkt(w, 5, [w + 1] * K), src(w))
    out = leaf.process(from_parent(5, [60, 70, 80, 90], exp=11), PARENT.address)
    assert [e.dst for e in out] == [src(0), src(1), src(2)]
    for rank, e in enumerate(out):
        h, values = decode(e)
        assert (h.type, h.job, h.worker, h.key, h.exponent, h.chunk) == (PacketType.RESULT, 1, rank, KEY, 11, 5)
        assert values.tolist() == [60, 70, 80, 90]
    assert leaf.registers(0).count == 4 and leaf.registers(0).exponent == 11  # n + 1: the parent's result held
    assert jc(leaf)["results_from_parent"] == 1
    # a child's repeat is answered from the stored result, as a flat job's is
    (again,) = leaf.process(pkt(1, 5, [2] * K), src(1))
    assert again.dst == src(1) and decode(again)[1].tolist() == [60, 70, 80, 90] and decode(again)[0].exponent == 11
    assert jc(leaf)["results_unicast"] == 1


def test_child_zeros_repeat_while_the_parents_sum_is_awaited_sends_the_partial_up_again(leaf):
    for w in range(3):
        leaf.process(pkt(w, 5, [w + 1] * K, exp=w), src(w))
    (up,) = leaf.process(pkt(0, 5, [99] * K, exp=40), src(0))  # a repeat's values and exponent change nothing
    h, values = decode(up)
    assert up.dst == PARENT.address and h.type == PacketType.CONTRIB and values.tolist() == [6] * K and h.exponent == 2
    assert jc(leaf)["partials_resent"] == 1 and jc(leaf)["partials_up"] == 1 and jc(leaf)["contributions"] == 3
    # child 0's repeat alone sends it again: one loss anywhere in a tree must not send it up once per child
    assert leaf.process(pkt(2, 5, [3] * K, exp=2), src(2)) == [] and jc(leaf)["duplicate_pending"] == 1
    assert pending(leaf.process(query(2, 5), src(2)))[1] == 0b111  # every child counted: a QUERY's resend goes up


@pytest.mark.parametrize("case", ["incomplete", "taken", "older", "other_run", "other_copy"])
def test_a_result_the_copy_does_not_await_is_dropped_and_counted(leaf, case):
    for w in range(2 if case == "incomplete" else 3):
        leaf.process(pkt(w, 5, [w + 1] * K), src(w))
    if case == "taken":
        leaf.process(from_parent(5, [1] * K), PARENT.address)
    before = leaf.registers(0)
    data = {"incomplete": from_parent(5, [7] * K), "taken": from_parent(5, [7] * K), "older": from_parent(4, [7] * K),
            "other_run": from_parent(5, [7] * K, gen=10), "other_copy": from_parent(5, [7] * K, copy=1)}[case]
    assert leaf.process(data, PARENT.address) == []
    assert jc(leaf)["unexpected_result"] == 1 and leaf.registers(0) == before


def test_a_result_is_taken_only_from_the_parent_as_it_names_this_child(leaf):
    for w in range(3):
        leaf.process(pkt(w, 5, [1] * K), src(w))
    for data, source in [(from_parent(5, [7] * K), ("10.0.9.2", 16711)),  # another address
                         (from_parent(5, [7] * K, up=Uplink(PARENT.address, 40, 1, PARENT.key)), PARENT.address),
                         (from_parent(5, [7] * K, up=Uplink(PARENT.address, 41, 2, PARENT.key)), PARENT.address),
                         (from_parent(5, [7] * K, up=Uplink(PARENT.address, 40, 2, KEY)), PARENT.address),
                         (from_parent(5, [7] * K), src(0))]:  # a worker can't pose as the parent
        assert leaf.process(data, source) == []
    assert leaf.counters()["global"]["malformed"] == 5 and jc(leaf)["results_from_parent"] == 0
    assert len(leaf.process(from_parent(5, [7] * K), PARENT.address)) == 3
    flat = job(job_id=2, base=4)  # and a switch with no parent takes none
    leaf.add_job(flat)
    assert leaf.process(from_parent(5, [7] * K, up=Uplink(PARENT.address, 2, 0, KEY)), PARENT.address) == []
    assert leaf.counters()["global"]["malformed"] == 6


def test_a_parents_result_of_another_k_is_dropped_by_the_job(leaf):
    for w in range(3):
        leaf.process(pkt(w, 5, [1] * K), src(w))
    assert leaf.process(from_parent(5, [7] * (K + 1)), PARENT.address) == []
    assert jc(leaf)["bad_count"] == 1 and leaf.registers(0).count == 3


def test_a_parents_header_alone_without_an_owner_is_dropped_and_the_copy_still_awaits(leaf):
    """An allreduce's sum is whole on every branch: a leaf that took a bare header would answer its children's
    repeats with its own partial."""
    for w in range(3):
        leaf.process(pkt(w, 5, [1] * K), src(w))
    assert leaf.process(from_parent(5, None), PARENT.address) == []
    assert jc(leaf)["bad_count"] == 1 and leaf.registers(0).count == 3
    assert len(leaf.process(from_parent(5, [7] * K), PARENT.address)) == 3


def test_an_owned_chunk_goes_whole_down_the_owners_branch_alone(model):
    """A spine whose children are switches over 2, 1 and 3 ranks (tree ranks 0..5): rank 4 is under child 2."""
    spine = model(num_slots=16)
    spine.add_job(job(spans=(2, 1, 3)))
    for w in range(3):
        out = spine.process(owned(w, 5, 4, [w + 1] * K), src(w))
    assert [(e.header.worker, e.header.count) for e in out] == [(0, 0), (1, 0), (2, K)]
    (again,) = spine.process(owned(2, 5, 4, [0] * K), src(2))
    assert again.header.count == K
    (bare,) = spine.process(owned(0, 5, 4, [0] * K), src(0))  # child 0 holds ranks 0 and 1, not the owner
    assert bare.header.count == 0 and bare.values is None
    assert spine.process(owned(0, 6, 6, [0] * K), src(0)) == [] and jc(spine)["bad_owner"] == 1  # 6: no rank of its


def test_a_leaf_passes_on_a_result_for_another_branchs_owner_as_headers(leaf):
    """Owner 8 is not under this leaf (its ranks are 4..6): the parent sends its header alone, and so does the leaf,
    now and on a child's repeat; owner 5 is its child 1, who alone gets the values."""
    for w in range(3):
        leaf.process(owned(w, 5, 8, [w + 1] * K), src(w))
    out = leaf.process(from_parent(5, None, flags=FLAG_OWNER, owner=8), PARENT.address)
    assert [(e.header.worker, e.header.count, e.values) for e in out] == [(0, 0, None), (1, 0, None), (2, 0, None)]
    (again,) = leaf.process(owned(1, 5, 8, [0] * K), src(1))
    assert again.header.count == 0
    for w in range(3):
        leaf.process(owned(w, 6, 5, [w + 1] * K), src(w))
    out = leaf.process(from_parent(6, [9] * K, flags=FLAG_OWNER, owner=5), PARENT.address)
    assert [(e.header.worker, e.header.count) for e in out] == [(0, 0), (1, K), (2, 0)]
    assert decode(out[1])[1].tolist() == [9] * K


def test_two_leaves_and_a_spine_sum_six_workers(model):
    """The tree end to end on three switches of one kind, packets carried by hand: every worker gets the sum of all
    six, and each level counted what it did."""
    spine_at, leaves_at = ("10.0.8.1", 16711), [("10.0.8.2", 16711), ("10.0.8.3", 16711)]
    spine = model(num_slots=16)
    spine.add_job(JobEntry(40, 3, 0xFACE, 0, 4, K, tuple(leaves_at), spans=(3, 3)))
    leaves = [model(num_slots=16) for _ in leaves_at]
    for i, sw in enumerate(leaves):
        sw.add_job(job(parent=Uplink(spine_at, 40, i, 0xFACE), rank_base=3 * i, tree_size=6))
    got = {}
    for i, sw in enumerate(leaves):
        for w in range(3):
            for e in sw.process(pkt(w, 5, [10 ** (3 * i + w)] * K, exp=3 * i + w), src(w)):
                for down in spine.process(e.payload(), leaves_at[i]):
                    for result in leaves[down.header.worker].process(down.payload(), spine_at):
                        got[(down.header.worker, result.header.worker)] = decode(result)
    assert sorted(got) == [(i, w) for i in range(2) for w in range(3)]
    assert all(values.tolist() == [111111] * K and h.exponent == 5 for h, values in got.values())
    assert jc(spine, 40)["results_multicast"] == 1 and [jc(sw)["results_from_parent"] for sw in leaves] == [1, 1]


@pytest.mark.parametrize("tree, says", [({"spans": (1, 2)}, "spans"), ({"spans": (1, 0, 1)}, "spans"),
                                        ({"rank_base": 5, "tree_size": 6}, "do not lie within"),
                                        ({"tree_size": 70000}, "at most 65535"),
                                        ({"parent": Uplink(("10.0.0.9", 1), 40, 32, 1)}, "child 0..31")])
def test_a_tree_that_does_not_add_up_is_refused_saying_what_to_fix(model, tree, says):
    with pytest.raises(ConfigError, match=says):
        model(num_slots=16).add_job(job(**tree))


def test_native_switch_matches_the_model_on_random_traffic():
    rng = np.random.default_rng(20261203)
    ref, native = SwitchModel(8), NativeSwitch(8)
    for m in (ref, native):
        m.add_job(job(job_id=1, n=3, base=0, slots=2, gen=5))
        m.add_job(job(job_id=7, n=5, base=2, slots=3, gen=6, k=6, **LEAF))
    emitted = 0
    # job 7 re-added at packet 3000 with its generation and another K, its workers going on from the chunks its
    # slots hold: the old state cleared, not taken for the new K's
    chunks = {}
    traffic = itertools.chain(random_traffic(rng, 3000, current=chunks),
                              random_traffic(rng, 1000, ks=(K, 5), current=chunks))
    for i, (data, source) in enumerate(traffic):
        if i == 2000:
            for m in (ref, native):
                m.set_generation(7, 6)  # the same generation: a no-op reset keeps the state
                m.set_generation(1, 8)
        if i == 3000:
            for m in (ref, native):
                m.remove_job(7)
                m.add_job(job(job_id=7, n=5, base=2, slots=3, gen=6, k=5, **LEAF))
        want, got = ref.process(data, source), native.process(data, source)
        assert [(e.dst, e.payload()) for e in got] == [(e.dst, e.payload()) for e in want], f"packet {i}"
        emitted += len(want)
    assert native.counters() == ref.counters()
    assert [native.registers(i) for i in range(16)] == [ref.registers(i) for i in range(16)]
    jobs = ref.counters()["jobs"]
    datagram_drops = {r: n for r, n in ref.counters()["global"].items() if r not in ("ip_options", "fragment")}
    assert emitted > 200 and all(datagram_drops.values())  # the traffic exercised every path a datagram has
    assert all(jobs[1][c] or jobs[7][c] for c in jobs[1])


class Out:
    """The out arrays of :meth:`NativeSwitch.process_batch`, as the server's socket holds them, and the packets
    they describe: packet i is its header and then its body (a result's values, shared by its multicast)."""

    def __init__(self, packets: int, nbytes: int) -> None:
        self.buf = np.zeros(nbytes, np.uint8)
        self.offsets, self.lengths, self.body_offsets, self.body_lengths = np.zeros((4, packets), np.uint32)
        self.names = np.zeros((packets, NAME_SIZE), np.uint8)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """process_batch's out arguments, in its order."""
        return self.buf, self.offsets, self.lengths, self.names, self.body_offsets, self.body_lengths

    def packets(self, made: int) -> list[tuple[bytes, bytes]]:
        """(destination sockaddr_in, datagram) of packets 0..made-1, as the socket sends them."""
        def part(at, length):
            return self.buf[at:at + length].tobytes()
        return [(bytes(self.names[i]), part(self.offsets[i], self.lengths[i])
                 + part(self.body_offsets[i], self.body_lengths[i])) for i in range(made)]


def batch_of(traffic: list[tuple[bytes, tuple[str, int]]]) -> tuple[np.ndarray, ...]:
    """process_batch's in arguments: the datagrams one after another, and their sources."""
    buf = np.frombuffer(b"".join(data for data, _ in traffic), np.uint8)
    lengths = np.array([len(data) for data, _ in traffic], np.uint32)
    offsets = (np.cumsum(lengths) - lengths).astype(np.uint32)
    names = np.array([np.frombuffer(sockaddr_in(source), np.uint8) for _, source in traffic])
    return buf, offsets, lengths, names


def test_process_batch_stops_where_a_multicast_might_not_fit_and_resumes():
    """The server's batch path: packets out in the model's order, however the out arrays split them."""
    ref, native = SwitchModel(16), NativeSwitch(16)
    for m in (ref, native):
        m.add_job(job(n=3))
    traffic = [(pkt(w, c), src(w)) for c in range(1, 5) for w in range(3)] + [(pkt(1, 4), src(1))]
    width = len(traffic[0][0])
    batch = batch_of(traffic)
    out = Out(4, 4 * width)
    got, start, calls = [], 0, 0
    while start < len(traffic):
        start, made = native.process_batch(*batch, start, len(traffic), *out.arrays())
        got += out.packets(made)
        calls += 1
    want = [(sockaddr_in(e.dst), e.payload()) for data, source in traffic for e in ref.process(data, source)]
    assert got == want and len(want) == 13 and calls > 1
    for small in (Out(4, 3 * width - 1), Out(2, 4 * width)):  # a byte short; a packet short
        with pytest.raises(ValueError, match="multicast"):
            native.process_batch(*batch, 0, 1, *small.arrays())


SHARE_FROM = 1024  # _switch.c's: a result's values of this many bytes or more go out from one copy


@pytest.mark.parametrize("ks", [(K, 6), (256, 6)], ids=["copied", "shared-and-copied"])
def test_a_large_multicast_writes_its_values_once_and_every_packet_that_carries_them_points_there(ks):
    """A result of 1 KiB of values or more to n workers is n headers (each naming its rank) and one copy of the
    sum, which every packet of the multicast sends from; smaller values follow each header (a second iovec
    costs the kernel more than the copy). A reduce-scatter's non-owners get their header alone (count 0).
    The packets are the model's, byte for byte, random traffic included."""
    rng = np.random.default_rng(30)
    ref, native = SwitchModel(8), NativeSwitch(8)
    for m in (ref, native):
        m.add_job(job(job_id=1, n=3, base=0, slots=2, gen=5, k=ks[0]))
        m.add_job(job(job_id=7, n=5, base=2, slots=3, gen=6, k=ks[1]))
    k = ks[0]
    traffic = [(pkt(w, 1, job_id=1, gen=5, k=k), src(w)) for w in range(3)]  # a multicast
    owned = dict(job_id=1, gen=5, k=k, flags=FLAG_OWNER, owner=2)
    traffic += [(pkt(w, 2, **owned), src(w)) for w in range(3)]  # to its owner
    traffic += [(pkt(0, 2, **owned), src(0))]  # a repeat: unicast, a header alone
    traffic += list(random_traffic(rng, 3000, ks))
    batch = batch_of(traffic)
    out = Out(256, 1 << 16)
    got, start, parts = [], 0, []  # parts: (call, head length, body offset, body length) of each packet
    while start < len(traffic):
        start, made = native.process_batch(*batch, start, len(traffic), *out.arrays())
        got += out.packets(made)
        parts += [(start, int(out.lengths[i]), int(out.body_offsets[i]), int(out.body_lengths[i]))
                  for i in range(made)]
    want = [(sockaddr_in(e.dst), e.payload()) for data, source in traffic for e in ref.process(data, source)]
    assert got == want
    shared = 4 * k >= SHARE_FROM
    if shared:  # one body, three packets
        assert parts[0:3] == [(parts[0][0], HEADER_SIZE, parts[0][2], 4 * k)] * 3
    else:
        assert [p[1:] for p in parts[0:3]] == [(HEADER_SIZE + 4 * k, 0, 0)] * 3
    assert [p[1] + p[3] for p in parts[3:7]] == [HEADER_SIZE, HEADER_SIZE, HEADER_SIZE + 4 * k, HEADER_SIZE]
    readers: dict[tuple[int, int], list[tuple[tuple[int, ...], int]]] = {}
    for (_, payload), (call, head, at, n) in zip(got, parts, strict=True):
        carried = len(payload) - HEADER_SIZE
        assert (head, n) == ((HEADER_SIZE, carried) if carried >= SHARE_FROM else (len(payload), 0))
        if n:
            h = unpack_header(payload)
            readers.setdefault((call, at), []).append(((h.job, h.slot, h.copy, h.chunk), h.worker))
    # each body is one result's, each of its packets to another rank; and most served several
    assert all(len({r for r, _ in v}) == 1 and len({w for _, w in v}) == len(v) for v in readers.values())
    assert sum(len(v) > 1 for v in readers.values()) > (20 if shared else -1)
