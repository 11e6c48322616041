"""Differential tests: the same packets go to BMv2 running p4/ and to the pure switch model.

What comes out -- which host, the addresses, the header and the values -- and the drop
counters must be the same, packet for packet. Skipped without root, p4c and
simple_switch_grpc (required where CI found them).
"""

from __future__ import annotations

import dataclasses
import os
import random
import time

import numpy as np
import pytest

from bmv2_env.testbed import TestBed, missing_prerequisites
from switchagg import netns
from switchagg.config import Endpoint, JobConfig, ParentSpec, WorkerSpec
from switchagg.frames import mac_bytes
from switchagg.switch.model import JobEntry, SwitchModel
from switchagg.targets import p4job
from switchagg.wire import EXP_NONE, FLAG_OWNER, HEADER_SIZE, PacketType, make_header, unpack_header

from . import frames
from .conftest import need

pytestmark = pytest.mark.bmv2
K = 64
FOREIGN = 9  # the host that no job admits as a worker: the tree jobs' parent switch (PARENT_PORT) is there
PARENT_PORT = 16711


class Differential:
    """Sends a payload from a host into BMv2 and into the model; compares what each sends back."""

    def __init__(self, bed: TestBed) -> None:
        from switchagg.targets import bmv2

        self.bed, self.bmv2 = bed, bmv2
        self.model = SwitchModel(num_slots=p4job.NUM_SLOTS)
        self.jobs = {}
        self.socks = [netns.packet_socket(bed.host(i)) for i in range(bed.n_hosts)]
        self.by_ip = {bed.host_ip(i): i for i in range(bed.n_hosts)}

    def deploy(self, cfg) -> None:
        generation = self.bmv2.Bmv2Target(self.bed.grpc_addr).deploy(cfg)
        self.model.add_job(JobEntry.from_config(cfg, generation))
        self.jobs[cfg.job_id] = cfg

    def reset(self, job_id: int) -> int:
        generation = self.bmv2.Bmv2Target(self.bed.grpc_addr).reset(job_id)
        self.model.set_generation(job_id, generation)
        return generation

    def undeploy(self, job_id: int) -> None:
        self.bmv2.Bmv2Target(self.bed.grpc_addr).undeploy(job_id)
        self.model.remove_job(job_id)

    def generation(self, job_id: int) -> int:
        return self.model.jobs[job_id].generation

    def _drain(self, wait: float) -> list[tuple[int, frames.Frame, int]]:
        """What the hosts received: (host, parsed frame, the frame's length in bytes)."""
        parsed = [(i, frames.parse(data), len(data)) for i, data in netns.incoming(self.socks, wait)]
        return [(i, f, size) for i, f, size in parsed if f is not None]

    def frame(self, host: int, payload: bytes, src: tuple[str, int] | None = None) -> bytes:
        """``payload`` as UDP from ``host`` (``src``: its address and port) to the switch."""
        bed = self.bed
        return frames.build(bed.host_mac(host), bed.switch_mac, src or (bed.host_ip(host), 40000),
                            (bed.switch_ip, 16711), payload)

    def send(self, host: int, payload: bytes, src: tuple[str, int] | None = None) -> list:
        """Inject ``payload`` as UDP from ``host``; assert BMv2 and the model emit the same; return it."""
        return self.send_frame(host, self.frame(host, payload, src))

    def send_frame(self, host: int, frame: bytes) -> list:
        """Inject ``frame`` from ``host``; assert BMv2 and the model emit the same; return it."""
        bed = self.bed
        expected = sorted(
            (self.by_ip[e.dst[0]], mac_bytes(bed.host_mac(self.by_ip[e.dst[0]])), e.dst, e.payload())
            for e in self.model.process_frame(frame))
        self.socks[host].send(frame)
        got = []
        deadline = time.monotonic() + 3.0
        while len(got) < len(expected) and time.monotonic() < deadline:
            got += self._drain(0.05)
        got += self._drain(0.01)  # nothing more may follow
        # A frame that holds its datagram alone gets answers that hold theirs alone: a result of the header
        # alone (reduce-scatter) ends after the header, whatever the contribution carried after it.
        exact = len(frame) == 14 + int.from_bytes(frame[16:18], "big")
        seen = []
        for rx, f, size in got:
            assert f.ip_checksum_ok and f.udp_checksum == 0
            assert f.src == (bed.switch_ip, 16711) and f.src_mac == mac_bytes(bed.switch_mac)
            assert size == 42 + len(f.payload) or not exact
            seen.append((rx, f.dst_mac, f.dst, f.payload))
        assert sorted(seen) == expected
        return expected

    def status(self, job_id: int):
        return self.bmv2.Bmv2Target(self.bed.grpc_addr).status(job_id)

    def check_counters(self) -> None:
        model = self.model.counters()
        for job_id in self.jobs:
            status = self.status(job_id)
            assert status.global_drops == model["global"]
            assert status.counters == model["jobs"][job_id], f"job {job_id}"


@pytest.fixture(scope="module")
def diff():
    need("bmv2", missing_prerequisites())
    with TestBed(10, prefix="sad", subnet=78, host_ips=False) as bed:
        d = Differential(bed)
        d.deploy(bed.job(list(range(8)), job_id=1, slot_base=0, slot_count=8))
        d.deploy(bed.job([0, 1], job_id=2, slot_base=8, slot_count=4, port_base=41000))
        d.deploy(bed.job([2, 3, 4, 5, 6], job_id=3, slot_base=12, slot_count=4, port_base=42000))
        d.deploy(shared_port_job(bed))
        d.deploy(bed.job([8], job_id=5, slot_base=18, slot_count=2, port_base=44000))  # one worker
        for cfg in tree_jobs(bed):
            d.deploy(cfg)
        yield d
        for s in d.socks:
            s.close()


def shared_port_job(bed: TestBed) -> JobConfig:
    """Job 4: ranks 0 and 1 on host 7 (one switch port, two UDP ports), rank 2 on host 8.

    Its multicast group has two replicas on port 7, told apart by their instance.
    """
    cfg = bed.job([8], job_id=4, slot_base=16, slot_count=2)
    shared = [WorkerSpec(Endpoint(bed.host_ip(7), 43000 + rank), mac=bed.host_mac(7), switch_port=7)
              for rank in range(2)]
    return dataclasses.replace(cfg, workers=(*shared, *cfg.workers))


def tree_jobs(bed: TestBed) -> list[JobConfig]:
    """Levels of trees (docs/protocol.md section 10), their parent switch on host FOREIGN: job 6, a leaf of three
    workers holding tree ranks 4..6 of 9, child 2 of the parent's job 40; job 7, a leaf of one worker, child 0 of
    job 41; job 8, a spine whose three children (switches, here hosts) hold 2, 1 and 3 ranks."""
    parent = Endpoint(bed.host_ip(FOREIGN), PARENT_PORT)
    up = {"mac": bed.host_mac(FOREIGN), "switch_port": FOREIGN}
    return [dataclasses.replace(bed.job([2, 3, 4], job_id=6, slot_base=20, slot_count=4, port_base=45000),
                                parent=ParentSpec(parent, 40, 2, 0xFACE, **up), rank_base=4, tree_size=9),
            dataclasses.replace(bed.job([8], job_id=7, slot_base=24, slot_count=2, port_base=46000),
                                parent=ParentSpec(parent, 41, 0, 0xFACF, **up), rank_base=3, tree_size=4),
            dataclasses.replace(bed.job([5, 6, 7], job_id=8, slot_base=26, slot_count=4, port_base=47000),
                                spans=(2, 1, 3))]


def from_parent(d: Differential, job_id: int, chunk: int, values=None, *, slot: int = 0, copy: int = 0,
                exponent: int = 4, **override) -> tuple[int, bytes, tuple[str, int]]:
    """The parent's RESULT for tree job ``job_id`` (``values`` None: its header alone), from host FOREIGN."""
    up = d.jobs[job_id].parent
    vals = np.zeros(0) if values is None else np.asarray(values)
    h = make_header(PacketType.RESULT, job=up.job, worker=up.index, slot=slot, copy=copy, chunk=chunk,
                    generation=d.generation(job_id), key=up.key, exponent=exponent, count=len(vals))
    return FOREIGN, h._replace(**override).pack() + vals.astype(">i4").tobytes(), up.address.tuple


def contrib(d: Differential, job_id: int, rank: int, chunk: int, *, slot: int = 0, copy: int = 0,
            values=None, exponent: int = 3, **override) -> tuple[int, bytes, tuple[str, int]]:
    cfg = d.jobs[job_id]
    w = cfg.workers[rank]
    vals = np.arange(K, dtype=np.int64) * (rank + 1) + chunk if values is None else np.asarray(values)
    h = make_header(PacketType.CONTRIB, job=job_id, worker=rank, slot=slot, copy=copy, chunk=chunk,
                    generation=d.generation(job_id), key=cfg.key, exponent=exponent, count=len(vals))
    h = h._replace(**override)
    return w.switch_port, h.pack() + vals.astype(">i4").tobytes(), w.address.tuple


def owned(d: Differential, job_id: int, rank: int, chunk: int, owner: int, *, copy: int = 0,
          **kw) -> tuple[int, bytes, tuple[str, int]]:
    """A reduce-scatter chunk's contribution: FLAG_OWNER set, its sum whole to ``owner`` alone."""
    return contrib(d, job_id, rank, chunk, copy=copy, **{"flags": FLAG_OWNER | copy, "owner": owner, **kw})


def query(d: Differential, job_id: int, rank: int, chunk: int, *, slot: int = 0, copy: int = 0,
          **override) -> tuple[int, bytes, tuple[str, int]]:
    """A QUERY: which workers has the copy counted for ``chunk``? A header, no values."""
    cfg = d.jobs[job_id]
    w = cfg.workers[rank]
    h = make_header(PacketType.QUERY, job=job_id, worker=rank, slot=slot, copy=copy, chunk=chunk,
                    generation=d.generation(job_id), key=cfg.key)
    return w.switch_port, h._replace(**override).pack(), w.address.tuple


def send(d, packet) -> list:
    host, payload, src = packet
    return d.send(host, payload, src)


def pending(out: list) -> int | None:
    """The bitmap a PENDING answer carries (what both BMv2 and the model sent), None for no answer."""
    if not out:
        return None
    (_, _, _, payload), = out
    h = unpack_header(payload)
    assert h.type == PacketType.PENDING and h.count == 0 and len(payload) == 24
    return h.key


@pytest.mark.parametrize("job_id", [2, 3, 1, 4])  # 2, 5 and 8 workers; 3 on 2 ports
def test_full_round_multicasts_the_sum(diff, job_id):
    n = diff.jobs[job_id].n_workers
    outs = [send(diff, contrib(diff, job_id, r, 10, exponent=r - 3)) for r in range(n)]
    assert all(o == [] for o in outs[:-1]) and len(outs[-1]) == n
    diff.check_counters()


def test_retransmission_before_and_after_completion_and_duplicates(diff):
    send(diff, contrib(diff, 2, 0, 20, slot=1))
    assert send(diff, contrib(diff, 2, 0, 20, slot=1)) == []  # duplicate while pending
    assert len(send(diff, contrib(diff, 2, 1, 20, slot=1))) == 2
    assert len(send(diff, contrib(diff, 2, 0, 20, slot=1))) == 1  # retransmission after: unicast
    assert len(send(diff, contrib(diff, 2, 1, 20, slot=1))) == 1
    diff.check_counters()


def test_stale_chunk_both_shadow_copies_and_wrap_around(diff):
    for copy, chunk in ((0, 0xFFFFFFFE), (1, 0xFFFFFFFF), (0, 1), (1, 2)):  # ids wrap between rounds
        for r in range(2):
            send(diff, contrib(diff, 2, r, chunk, slot=2, copy=copy))
    assert send(diff, contrib(diff, 2, 0, 0xFFFFFFFE, slot=2, copy=0)) == []  # older than chunk 1: stale
    assert len(send(diff, contrib(diff, 2, 1, 1, slot=2, copy=0))) == 1
    diff.check_counters()


def test_foreign_sender_wrong_key_and_malformed_headers(diff):
    good = contrib(diff, 2, 0, 30, slot=3)
    send(diff, (FOREIGN, good[1], (diff.bed.host_ip(FOREIGN), 40000)))  # unknown source
    send(diff, (good[0], good[1], (good[2][0], good[2][1] + 1)))  # right IP, wrong port
    send(diff, contrib(diff, 2, 0, 30, slot=3, key=0xBAD))
    send(diff, contrib(diff, 2, 0, 30, slot=3, version=2))
    for bad in ({"owner": 1}, {"flags": 0x80}, {"worker": 40}, {"type": PacketType.RESULT}, {"type": 9}):
        send(diff, contrib(diff, 2, 0, 30, slot=3, **bad))
    send(diff, (good[0], good[1][:20], good[2]))  # shorter than the header
    send(diff, (good[0], good[1][:-4], good[2]))  # count says 64 values, 63 are there
    send(diff, (good[0], good[1] + bytes(4), good[2]))  # and 65
    send(diff, (good[0], make_header(PacketType.PROBE, job=2, worker=0, key=diff.jobs[2].key, count=K).pack()
                + good[1][24:], good[2]))  # a probe carrying values
    send(diff, contrib(diff, 2, 0, 30, slot=3, values=[1, 2, 3]))  # a K the program does not take
    send(diff, contrib(diff, 2, 0, 30, slot=4))  # slot beyond the job's 4
    send(diff, contrib(diff, 2, 0, 30, slot=3, generation=0))  # what every tag powers up holding
    probe = make_header(PacketType.PROBE, job=2, worker=1, key=diff.jobs[2].key).pack()
    assert len(diff.send(diff.jobs[2].workers[1].switch_port, probe, diff.jobs[2].workers[1].address.tuple)) == 1
    diff.check_counters()


def test_two_jobs_interleaved_share_hosts_not_state(diff):
    for r in range(5):
        send(diff, contrib(diff, 3, r, 40, slot=0, values=np.full(K, 1000 + r)))
        if r < 2:
            send(diff, contrib(diff, 2, r, 40, slot=0, values=np.full(K, -r)))
    diff.check_counters()


def test_reset_with_old_state_still_in_the_registers(diff):
    """A reset changes what a probe answers (where a run's join starts), not which packets are taken: the old
    run's packets still sum under their own tag, and the new run's start the copy afresh."""
    send(diff, contrib(diff, 2, 0, 500, slot=1))
    old = diff.generation(2)
    assert diff.reset(2) != old
    w = diff.jobs[2].workers[0]
    (reply,) = diff.send(w.switch_port, make_header(PacketType.PROBE, job=2, worker=0, key=diff.jobs[2].key).pack(),
                         w.address.tuple)
    assert unpack_header(reply[3]).generation == diff.generation(2)
    assert len(send(diff, contrib(diff, 2, 1, 500, slot=1, generation=old))) == 2  # the old run's own sum
    send(diff, contrib(diff, 2, 0, 3, slot=1))  # a lower chunk id, yet a first write: another run's copy
    assert len(send(diff, contrib(diff, 2, 1, 3, slot=1))) == 2
    diff.check_counters()


def test_session_generations_sum_apart_and_generation_zero_is_dropped(diff):
    """Packets carry their run's session generation, any but 0, which the job was never installed with: each
    sums under its own tag; another run's copy reads EMPTY (a fresh write, never stale); generation 0, which
    every tag powers up holding, is wrong_generation even for chunk 0 on a copy no run has used."""
    for rank in range(8):  # job 1's slot 7 has never been written: (generation 0, chunk 0) in every register
        assert send(diff, contrib(diff, 1, rank, 0, slot=7, generation=0)) == []
    assert send(diff, query(diff, 1, 0, 0, slot=7, generation=0)) == []
    a, b = 0x0A0A0A0A, 0xB0B0B0B0
    for rank in range(8):  # a run that is not the installed one: summed
        out = send(diff, contrib(diff, 1, rank, 0, slot=7, generation=a, values=np.full(K, rank + 1)))
    assert len(out) == 8 and unpack_header(out[0][3]).generation == a
    assert np.frombuffer(out[0][3][24:], ">i4").tolist() == [36] * K
    assert pending(send(diff, query(diff, 1, 0, 0, slot=7, generation=a))) == 0xFF
    for rank in range(3):
        send(diff, contrib(diff, 1, rank, 900, slot=7, copy=1, generation=a, values=np.full(K, 1)))
    send(diff, contrib(diff, 1, 3, 5, slot=7, copy=1, generation=b, values=np.full(K, 100)))  # older id, other run
    assert pending(send(diff, query(diff, 1, 0, 900, slot=7, copy=1, generation=a))) == 0  # a's state is gone
    assert pending(send(diff, query(diff, 1, 0, 5, slot=7, copy=1, generation=b))) == 0b1000
    for rank in (0, 1, 2, 4, 5, 6):
        assert send(diff, contrib(diff, 1, rank, 5, slot=7, copy=1, generation=b, values=np.full(K, 100))) == []
    out = send(diff, contrib(diff, 1, 7, 5, slot=7, copy=1, generation=b, values=np.full(K, 100)))
    assert len(out) == 8 and np.frombuffer(out[0][3][24:], ">i4").tolist() == [800] * K  # b's sum alone
    assert send(diff, contrib(diff, 1, 3, 900, slot=7, copy=1, generation=a, values=np.full(K, 1))) == []  # fresh
    assert pending(send(diff, query(diff, 1, 0, 900, slot=7, copy=1, generation=a))) == 0b1000
    assert diff.status(1).counters["wrong_generation"] >= 9
    diff.check_counters()


def test_other_frames_are_forwarded_unchanged_and_runts_dropped(diff):
    bed = diff.bed
    host_mac = [bed.host_mac(h) for h in range(bed.n_hosts)]
    udp = frames.build(host_mac[0], host_mac[1], (bed.host_ip(0), 5000), (bed.host_ip(1), 5001), b"not switchagg")
    udp = udp[:24] + b"\x00\x00" + udp[26:]  # a wrong IPv4 checksum: a switch forwards it, it does not mend it
    tcp = udp[:23] + b"\x06" + udp[24:]
    fragment, options = frames.rewrite_ip(udp, fragment=0x2001), frames.rewrite_ip(udp, options=bytes(4))  # to a host
    arp = mac_bytes("ff:ff:ff:ff:ff:ff") + mac_bytes(host_mac[0]) + b"\x08\x06" + bytes(28)
    runt = mac_bytes(host_mac[1]) + mac_bytes(host_mac[0]) + b"\x88\xb5" + bytes(20)  # 34 bytes
    before = diff.status(1)
    sent = (udp, tcp, fragment, options, arp, runt)
    for frame in sent:
        diff.socks[0].send(frame)
    got, deadline = [], time.monotonic() + 1.0
    while time.monotonic() < deadline:
        got += [(h, f) for h, f in netns.incoming(diff.socks, 0.05) if f in sent]
    hosts = {w.switch_port for cfg in diff.jobs.values() for w in cfg.workers}
    hosts |= {cfg.parent.switch_port for cfg in diff.jobs.values() if cfg.parent is not None}
    flooded = sorted(hosts - {0})
    assert sorted(got) == sorted([(1, f) for f in (udp, tcp, fragment, options)] + [(h, arp) for h in flooded])
    assert diff.status(1) == before


@pytest.mark.parametrize("seed", range(3))
def test_seeded_random_sequences_with_loss_duplication_reordering(diff, seed):
    rng = random.Random(seed)
    job = 3
    n = diff.jobs[job].n_workers
    packets = []
    base = 1000 + 100 * seed
    for rnd in range(3):  # three rounds over the job's 4 slots, the copies alternating
        for slot in range(4):
            for r in range(n):
                vals = [rng.randrange(-2**31, 2**31) for _ in range(K)]
                exp = rng.choice([EXP_NONE, -20, 0, 5, 127])
                # the second round is a reduce-scatter's: each chunk's sum whole to one rank
                mark = {"flags": FLAG_OWNER | rnd % 2, "owner": slot % n} if rnd == 1 else {}
                p = contrib(diff, job, r, base + 4 * rnd + slot, slot=slot, copy=rnd % 2, values=vals, exponent=exp,
                            **mark)
                if rng.random() < 0.25:  # a query, for this chunk or a neighbour's, now and then
                    packets.append(query(diff, job, r, base + 4 * rnd + slot + rng.choice([-4, 0, 0, 4]), slot=slot,
                                         copy=rnd % 2, **mark))
                if rng.random() < 0.15:
                    continue  # lost
                packets.append(p)
                if rng.random() < 0.2:
                    packets.append(p)  # duplicated
    rng.shuffle(packets)
    for p in packets:
        send(diff, p)
    diff.check_counters()


def test_counts_whose_length_wraps_around_16_bits_are_malformed(diff):
    """24 + 4 * count taken in 16 bits would give a count 16384 higher the same length: bad_count, not malformed."""
    send(diff, contrib(diff, 2, 0, 60, slot=3, values=[], count=0x4000))
    send(diff, contrib(diff, 2, 0, 60, slot=3, count=0x4000 + K))
    send(diff, contrib(diff, 2, 0, 60, slot=3, count=0xC000 + K))
    w = diff.jobs[2].workers[0]
    probe = make_header(PacketType.PROBE, job=2, worker=0, key=diff.jobs[2].key, count=0x4000).pack()
    diff.send(w.switch_port, probe, w.address.tuple)
    diff.check_counters()


def test_a_frame_counts_only_the_datagram_its_lengths_say(diff):
    host, payload, src = contrib(diff, 2, 0, 61, slot=3, version=2)
    diff.send_frame(host, diff.frame(host, payload[:20], src) + bytes(8))  # the version byte lies past the datagram
    for rank in range(2):  # what the frame holds past the datagram is not summed
        host, payload, src = contrib(diff, 2, rank, 61, slot=3)
        out = diff.send_frame(host, diff.frame(host, payload, src) + b"trailer")
    assert len(out) == 2
    whole = diff.frame(host, payload, src)
    diff.send_frame(host, whole[:-1])  # the frame ends before the datagram
    diff.send_frame(host, frames.rewrite_ip(whole, ip_length=len(whole) - 14 - 4))  # IPv4 and UDP lengths disagree
    w = diff.jobs[2].workers[1]
    probe = make_header(PacketType.PROBE, job=2, worker=1, key=diff.jobs[2].key).pack()
    assert len(diff.send_frame(w.switch_port, diff.frame(w.switch_port, probe, w.address.tuple) + bytes(30))) == 1
    diff.check_counters()


def test_ip_options_and_fragments_sent_to_the_switch_are_counted(diff):
    host, payload, src = contrib(diff, 2, 0, 62, slot=3)
    whole = diff.frame(host, payload, src)
    for ip in ({"options": bytes(4)}, {"options": b"\x94\x04\x00\x00" * 10}, {"options": bytes(8), "fragment": 0x2000},
               {"fragment": 0x2000}, {"fragment": 0x6000}, {"fragment": 0x0001}, {"fragment": 0x4020}):
        assert diff.send_frame(host, frames.rewrite_ip(whole, **ip)) == []
    diff.check_counters()


def test_replies_to_a_wrong_ip_checksum_carry_a_right_one(diff):
    """Incoming IPv4 checksums are not verified; a reply's is worked out afresh (send checks every frame's)."""
    w = diff.jobs[2].workers[1]
    probe = diff.frame(w.switch_port, make_header(PacketType.PROBE, job=2, worker=1, key=diff.jobs[2].key).pack(),
                       w.address.tuple)
    probe = probe[:15] + b"\x2e" + probe[16:18] + b"\xbe\xef" + probe[20:22] + b"\x07" + probe[23:]  # DSCP, id, TTL
    for checksum in (0x0BAD, 0xFFFF, 0):
        assert len(diff.send_frame(w.switch_port, frames.rewrite_ip(probe, checksum=checksum))) == 1
    packets = [contrib(diff, 2, rank, 63, slot=2, copy=1) for rank in range(2)]
    for rank, (host, payload, src) in enumerate(packets):  # summed as they are
        diff.send_frame(host, frames.rewrite_ip(diff.frame(host, payload, src), checksum=rank + 1))
    host, payload, src = packets[0]
    assert len(diff.send_frame(host, frames.rewrite_ip(diff.frame(host, payload, src), checksum=0x1234))) == 1
    diff.check_counters()


@pytest.mark.parametrize("seed", range(2))
def test_seeded_fuzzed_headers_and_frames(diff, seed):
    """Flipped header bits, counts that wrap, truncations, trailers, IPv4 options, fragments and wrong
    checksums among a job's contributions, probes and queries."""
    rng = random.Random(100 + seed)
    cfg = diff.jobs[2]
    for i in range(120):
        rank = rng.randrange(2)
        roll = rng.random()
        if roll < 0.1:
            w = cfg.workers[rank]
            host, payload, src = w.switch_port, make_header(PacketType.PROBE, job=2, worker=rank, key=cfg.key).pack(), \
                w.address.tuple
        elif roll < 0.25:
            host, payload, src = query(diff, 2, rank, 1000 + 10 * seed + i // 8 + rng.randrange(-1, 2), slot=i % 4,
                                       copy=i // 4 % 2)
        else:
            host, payload, src = contrib(diff, 2, rank, 1000 + 10 * seed + i // 8, slot=i % 4, copy=i // 4 % 2,
                                         values=[rng.randrange(-2**31, 2**31) for _ in range(K)])
        roll = rng.random()
        if roll < 0.3:
            b = bytearray(payload)
            b[rng.randrange(24)] ^= 1 << rng.randrange(8)
            payload = bytes(b)
        elif roll < 0.4:
            count = (int.from_bytes(payload[22:24], "big") + 0x4000 * rng.randrange(1, 4)) & 0xFFFF
            payload = payload[:22] + count.to_bytes(2, "big") + payload[24:]
        elif roll < 0.5:
            payload = payload[:rng.randrange(len(payload))]
        frame = diff.frame(host, payload, src)
        roll = rng.random()
        if roll < 0.1:
            frame += rng.randbytes(rng.randrange(1, 40))
        elif roll < 0.15:
            frame = frames.rewrite_ip(frame, options=bytes(4 * rng.randrange(1, 11)))
        elif roll < 0.2:
            frame = frames.rewrite_ip(frame, fragment=rng.choice([0x2000, 0x0001, 0x20FF]))
        elif roll < 0.3:
            frame = frames.rewrite_ip(frame, checksum=rng.randrange(0x10000))
        diff.send_frame(host, frame)
    diff.check_counters()


def test_a_query_is_answered_with_each_row_of_the_query_table(diff):
    """docs/protocol.md section 5's QUERY table, row by row, on job 1 (8 workers) and job 4 (3, two on one
    port); each PENDING goes back to the sender alone, and no query changes the copy."""
    assert pending(send(diff, query(diff, 1, 3, 70, slot=4))) == 0  # EMPTY: power-up zeros
    for rank in (0, 2, 5):
        send(diff, contrib(diff, 1, rank, 70, slot=4))
    assert pending(send(diff, query(diff, 1, 3, 70, slot=4))) == 0b100101  # PARTIAL: the bitmap
    assert pending(send(diff, query(diff, 1, 0, 70, slot=4))) == 0b100101  # a counted worker asks too
    assert pending(send(diff, query(diff, 1, 0, 70, slot=4, copy=1))) == 0  # the other copy is its own
    assert pending(send(diff, query(diff, 1, 0, 71, slot=4))) == 0  # x newer than c: not arrived
    assert pending(send(diff, query(diff, 1, 0, 70 + 0x7FFFFFFF, slot=4))) == 0  # newer, just
    assert pending(send(diff, query(diff, 1, 0, 69, slot=4))) is None  # x older than c: stale
    assert pending(send(diff, query(diff, 1, 0, 70 + 0x80000000, slot=4))) is None  # 2^31 apart: older
    for rank in (1, 3, 4, 6):  # the newer chunk's query wrote no tag: these still count into chunk 70
        assert send(diff, contrib(diff, 1, rank, 70, slot=4)) == []
    assert pending(send(diff, query(diff, 1, 7, 70, slot=4))) == 0b1111111
    assert len(send(diff, contrib(diff, 1, 7, 70, slot=4))) == 8
    assert pending(send(diff, query(diff, 1, 2, 70, slot=4))) == 0xFF  # COMPLETE: every bit
    assert len(send(diff, contrib(diff, 1, 2, 70, slot=4))) == 1  # and the repeat gets the stored RESULT
    for rank, bitmap in ((0, 0), (1, 0), (2, 0)):  # job 4: ranks 0 and 1 share host 7's port
        assert pending(send(diff, query(diff, 4, rank, 80, slot=1, copy=1))) == bitmap
    send(diff, contrib(diff, 4, 1, 80, slot=1, copy=1))
    assert [pending(send(diff, query(diff, 4, rank, 80, slot=1, copy=1))) for rank in range(3)] == [0b10] * 3
    diff.check_counters()


def test_a_query_in_another_run_wraps_around_and_its_drops(diff):
    """A copy of the job's previous run reads as empty to the next run and as its own to the previous run;
    chunk ids wrap; a query of generation 0, a slot the job lacks, or not admitted is dropped and counted,
    as the model does."""
    send(diff, contrib(diff, 1, 0, 0xFFFFFFFF, slot=5))
    assert pending(send(diff, query(diff, 1, 1, 0xFFFFFFFF, slot=5))) == 1
    assert pending(send(diff, query(diff, 1, 1, 1, slot=5))) == 0  # newer across the wrap
    assert pending(send(diff, query(diff, 1, 1, 0xFFFFFFFE, slot=5))) is None  # stale
    old = diff.generation(1)
    diff.reset(1)
    assert pending(send(diff, query(diff, 1, 1, 0xFFFFFFFF, slot=5))) == 0  # the old run's state: empty
    assert pending(send(diff, query(diff, 1, 1, 0xFFFFFFFE, slot=5))) == 0  # so nothing is stale either
    assert pending(send(diff, query(diff, 1, 1, 0xFFFFFFFF, slot=5, generation=old))) == 1  # the old run's own
    assert send(diff, query(diff, 1, 1, 0xFFFFFFFF, slot=5, generation=0)) == []  # wrong_generation
    assert send(diff, query(diff, 1, 1, 5, slot=8)) == []  # slot_out_of_range (job 1 has 8)
    assert send(diff, query(diff, 1, 1, 5, slot=0xFFFF)) == []
    host, payload, src = query(diff, 1, 1, 5, slot=6)
    assert send(diff, (FOREIGN, payload, (diff.bed.host_ip(FOREIGN), 40000))) == []  # not admitted
    assert send(diff, (host, payload, (src[0], src[1] + 1))) == []
    assert send(diff, query(diff, 1, 1, 5, slot=6, key=0xBAD)) == []
    assert send(diff, query(diff, 1, 1, 5, slot=6, worker=2)) == []  # another rank's query from rank 1
    diff.check_counters()


def test_malformed_queries(diff):
    """A query with values, with a count its length does not hold, or with a header fault is dropped before
    admission; one in a frame with a trailer is answered, one in a frame cut short is not."""
    host, payload, src = query(diff, 1, 2, 90, slot=6)
    for count in (1, K):  # a query with values, of a count its length holds
        values = query(diff, 1, 2, 90, slot=6, count=count)[1] + np.arange(count, dtype=">i4").tobytes()
        assert send(diff, (host, values, src)) == []
    assert send(diff, (host, payload + bytes(4), src)) == []  # a count of 0, 4 bytes more
    assert send(diff, (host, payload[:20], src)) == []  # shorter than the header
    for bad in ({"count": 1}, {"count": K}, {"count": 0x4000}, {"owner": 1}, {"flags": 0x04}, {"worker": 32},
                {"version": 2}, {"type": PacketType.PENDING}, {"type": 7}):  # counts its length does not hold, ...
        assert send(diff, query(diff, 1, 2, 90, slot=6, **bad)) == []
    assert pending(diff.send_frame(host, diff.frame(host, payload, src) + bytes(30))) == 0  # past the datagram
    assert diff.send_frame(host, diff.frame(host, payload, src)[:-1]) == []  # the frame ends before it
    assert diff.send_frame(host, frames.rewrite_ip(diff.frame(host, payload, src), checksum=0x0BAD)) != []
    diff.check_counters()


def ranks_served(d: Differential, job_id: int, out: list) -> dict[int, int]:
    """Each recipient's rank and the values it got: {rank: count}, checked against the payload's length."""
    address = {w.address.tuple: rank for rank, w in enumerate(d.jobs[job_id].workers)}
    got = {}
    for _, _, dst, payload in out:
        h = unpack_header(payload)
        assert h.type == PacketType.RESULT and h.worker == address[dst] and len(payload) == HEADER_SIZE + 4 * h.count
        got[h.worker] = h.count
    return got


SCATTER_RUN = 0x5CA77E2  # the reduce-scatter tests' session generation


@pytest.mark.parametrize("job_id, owner, chunk", [(2, 0, 5000), (3, 4, 5001), (1, 5, 5002), (4, 1, 5003),
                                                   (4, 0, 5004), (5, 0, 5005)])
def test_a_reduce_scatter_sum_goes_whole_to_its_owner_and_as_a_header_to_the_others(diff, job_id, owner, chunk):
    """Job 4's ranks 0 and 1 share a port (replicas told apart by instance); job 5 has one worker. The header
    alone is 24 bytes in a frame of 66 (send checks its lengths and checksum against the model's). The run's own
    session generation: copies that earlier tests left (fuzzed chunk ids among them) are empty to it."""
    n = diff.jobs[job_id].n_workers
    mark = {"slot": 1, "copy": 1, "generation": SCATTER_RUN}
    outs = [send(diff, owned(diff, job_id, r, chunk, owner, exponent=r - 3, **mark)) for r in range(n)]
    assert all(o == [] for o in outs[:-1])
    assert ranks_served(diff, job_id, outs[-1]) == {r: K if r == owner else 0 for r in range(n)}
    for r in range(n):  # a repeat: whole to the owner, the header to the others
        assert ranks_served(diff, job_id, send(diff, owned(diff, job_id, r, chunk, owner, **mark))) == {
            r: K if r == owner else 0}
    diff.check_counters()


def test_reduce_scatter_chunks_among_allreduce_ones_and_the_completing_packets_mark(diff):
    """Each sum goes as its last contribution says; a query may carry the owner."""
    run = {"slot": 2, "generation": SCATTER_RUN}
    for chunk, marks in ((5010, [None, None, 2, 1, 1]), (5011, [0, 0, 0, 0, None]), (5012, [3] * 5)):
        for r, owner in enumerate(marks):
            out = send(diff, contrib(diff, 3, r, chunk, **run) if owner is None
                       else owned(diff, 3, r, chunk, owner, **run))
        assert ranks_served(diff, 3, out) == {r: K if marks[-1] in (None, r) else 0 for r in range(5)}
        assert pending(send(diff, query(diff, 3, 0, chunk, flags=FLAG_OWNER, owner=4, **run))) == 0b11111
    diff.check_counters()


def test_an_owner_outside_the_job_or_without_its_flag_is_dropped(diff):
    for bad in ({"owner": 2}, {"owner": 255}, {"flags": FLAG_OWNER | 0x04}, {"flags": 0}):  # job 2 has 2 workers
        assert send(diff, owned(diff, 2, 0, 5020, **{"owner": 1, **bad}, slot=3)) == []
    assert send(diff, query(diff, 2, 0, 5020, slot=3, flags=FLAG_OWNER, owner=2)) == []
    assert send(diff, owned(diff, 2, 0, 5020, 5, slot=3, generation=0)) == []  # the generation is checked first
    assert send(diff, owned(diff, 2, 0, 5020, 5, slot=4)) == []  # and the slot
    assert send(diff, owned(diff, 2, 0, 5020, 5, slot=3, values=[1, 2])) == []  # then the owner, then the count
    assert diff.status(2).counters["bad_owner"] >= 4
    diff.check_counters()


def test_bmv2_writes_its_output_to_a_file_not_a_pipe(diff):
    """A pipe outlives its reader when `python -m bmv2_env up` exits, and BMv2's next write kills it (SIGPIPE)."""
    bed = diff.bed
    assert bed.output.is_file()
    for fd in (1, 2):
        assert os.readlink(f"/proc/{bed._proc.pid}/fd/{fd}") == str(bed.output)


def partial_up(d: Differential, job_id: int, out: list) -> np.ndarray:
    """The one packet a leaf sent: a CONTRIB of its parent's job to the parent, as its child; its values."""
    (host, _, dst, payload), = out
    up = d.jobs[job_id].parent
    h = unpack_header(payload)
    assert (host, dst) == (FOREIGN, up.address.tuple)
    assert (h.type, h.job, h.worker, h.key, h.count) == (PacketType.CONTRIB, up.job, up.index, up.key, K)
    return np.frombuffer(payload[HEADER_SIZE:], ">i4")


def test_a_leaf_sends_its_partial_up_and_the_parents_result_down(diff):
    """Job 6 sends its three workers' sum up as child 2 of job 40; child 0's repeat while it is awaited sends it
    again, another child's is a duplicate; the parent's RESULT goes down to every worker as job 6's, and repeats
    are answered from it, which no later RESULT changes."""
    run = {"slot": 1, "generation": 0x7EE1}
    outs = [send(diff, contrib(diff, 6, r, 300, exponent=r, **run)) for r in range(3)]
    assert outs[:2] == [[], []]
    partial = partial_up(diff, 6, outs[2])
    assert partial.tolist() == (np.arange(K) * 6 + 3 * 300).tolist()
    assert send(diff, contrib(diff, 6, 1, 300, **run)) == []
    assert partial_up(diff, 6, send(diff, contrib(diff, 6, 0, 300, **run))).tolist() == partial.tolist()
    down = send(diff, from_parent(diff, 6, 300, np.arange(K) * 7, **run))
    assert ranks_served(diff, 6, down) == {0: K, 1: K, 2: K}
    assert all(unpack_header(p).job == 6 and unpack_header(p).key == diff.jobs[6].key for *_, p in down)
    assert ranks_served(diff, 6, send(diff, contrib(diff, 6, 1, 300, **run))) == {1: K}
    assert send(diff, from_parent(diff, 6, 300, np.arange(K), **run)) == []  # unexpected: taken already
    assert diff.status(6).counters["partials_resent"] == 1
    diff.check_counters()


def test_a_leaf_of_one_worker_sends_each_contribution_up(diff):
    run = {"generation": 0x7EE2}
    for chunk in (10, 11):
        partial_up(diff, 7, send(diff, contrib(diff, 7, 0, chunk, **run)))
        assert partial_up(diff, 7, send(diff, contrib(diff, 7, 0, chunk, **run)))[0] == chunk  # child 0: again
        assert ranks_served(diff, 7, send(diff, from_parent(diff, 7, chunk, [chunk] * K, **run))) == {0: K}
    diff.check_counters()


def test_results_a_leaf_does_not_take(diff):
    """From anyone but the parent as it names this leaf: malformed; the parent's contribution: not admitted; then the
    job's checks, as a contribution's; and a result no copy awaits."""
    run = {"slot": 2, "generation": 0x7EE3}
    before = diff.status(6).counters
    for r in range(3):
        send(diff, contrib(diff, 6, r, 400, **run))
    host, payload, src = from_parent(diff, 6, 400, [1] * K, **run)
    for bad in (dict(src=(diff.bed.host_ip(8), PARENT_PORT)), dict(src=(src[0], PARENT_PORT + 1))):
        assert diff.send(host, payload, **bad) == []
    for bad in ({"worker": 1}, {"key": 0xFACF}, {"job": 41}, {"type": PacketType.CONTRIB}):
        assert send(diff, from_parent(diff, 6, 400, [1] * K, **run, **bad)) == []
    assert send(diff, from_parent(diff, 6, 400, None, **run)) == []  # its header alone, no owner: bad_count
    assert send(diff, from_parent(diff, 6, 400, [1] * 3, **run)) == []  # another K
    assert send(diff, from_parent(diff, 6, 400, [1] * K, **{**run, "generation": 0})) == []
    assert send(diff, from_parent(diff, 6, 400, [1] * K, **{**run, "slot": 4})) == []
    assert send(diff, from_parent(diff, 6, 400, [1] * K, flags=FLAG_OWNER, owner=9, **run)) == []  # 9 ranks
    assert send(diff, from_parent(diff, 6, 401, [1] * K, **run)) == []  # another chunk
    assert send(diff, from_parent(diff, 6, 400, [1] * K, copy=1, flags=1, **run)) == []  # the other copy
    assert len(send(diff, from_parent(diff, 6, 400, [1] * K, **run))) == 3  # the one awaited
    after = diff.status(6).counters
    assert {c: after[c] - before[c] for c in ("unexpected_result", "bad_owner", "bad_count", "wrong_generation",
                                              "slot_out_of_range", "results_from_parent")} == {
        "unexpected_result": 2, "bad_owner": 1, "bad_count": 2, "wrong_generation": 1, "slot_out_of_range": 1,
        "results_from_parent": 1}
    diff.check_counters()


def test_owned_chunks_go_whole_down_the_owners_branch_at_every_level(diff):
    """Job 8's children hold ranks 0-1, 2 and 3-5: owner 4 is under child 2. Job 6 holds ranks 4-6: owner 5 is its
    child 1; for owner 8, under another leaf, the parent sends the header alone, and so does the leaf."""
    run = {"slot": 3, "generation": 0x7EE4}
    outs = [send(diff, owned(diff, 8, r, 500, 4, **run)) for r in range(3)]
    assert ranks_served(diff, 8, outs[-1]) == {0: 0, 1: 0, 2: K}
    assert ranks_served(diff, 8, send(diff, owned(diff, 8, 0, 500, 4, **run))) == {0: 0}
    assert ranks_served(diff, 8, send(diff, owned(diff, 8, 2, 500, 4, **run))) == {2: K}
    for owner, chunk, sent in ((5, 501, [5] * K), (8, 502, None)):
        for r in range(3):
            out = send(diff, owned(diff, 6, r, chunk, owner, **run))
        partial_up(diff, 6, out)
        down = send(diff, from_parent(diff, 6, chunk, sent, flags=FLAG_OWNER, owner=owner, **run))
        assert ranks_served(diff, 6, down) == {0: 0, 1: K if sent else 0, 2: 0}
        assert ranks_served(diff, 6, send(diff, owned(diff, 6, 1, chunk, owner, **run))) == {1: K if sent else 0}
    diff.check_counters()


@pytest.mark.parametrize("seed", range(3))
def test_seeded_random_tree_traffic_with_loss_duplication_reordering(diff, seed):
    """A leaf's children's contributions and its parent's results (whole, its header alone, from a stranger, naming
    another child, of a neighbouring chunk) lost, repeated and reordered."""
    rng = random.Random(seed)
    packets = []
    base = 2000 + 100 * seed
    for rnd in range(3):
        for slot in range(4):
            chunk = base + 4 * rnd + slot
            mark = {"flags": FLAG_OWNER | rnd % 2, "owner": rng.choice([4, 5, 8])} if rnd == 1 else {}
            for r in range(3):
                p = contrib(diff, 6, r, chunk, slot=slot, copy=rnd % 2, values=[rng.randrange(-2**31, 2**31)
                                                                                for _ in range(K)], **mark)
                packets += [p] * rng.choice([0, 1, 1, 1, 2])
            for _ in range(rng.choice([1, 2, 3])):
                sent = [rng.randrange(-2**31, 2**31) for _ in range(K)] if not mark or rng.random() < 0.7 else None
                kw, of = {}, chunk
                roll = rng.random()
                if roll < 0.1:
                    kw = {"worker": 1}
                elif roll < 0.2:
                    of = chunk + rng.choice([-4, 4])
                p = from_parent(diff, 6, of, sent, slot=slot, copy=rnd % 2, **mark, **kw)
                if rng.random() < 0.1:
                    p = (p[0], p[1], (diff.bed.host_ip(8), PARENT_PORT))
                packets.append(p)
    rng.shuffle(packets)
    for p in packets:
        send(diff, p)
    diff.check_counters()


def test_a_leafs_queries_a_reset_and_a_neighbours_removal_leave_its_tree_paths_as_they_were(diff):
    """A query while the partial is awaited and once the parent's sum is held (every bit set, both times); after a
    reset of job 6 its parent's RESULTs are still admitted with the tree's owner limit (its entry keeps it), and
    after job 7 (a leaf under the same parent switch) is removed and deployed again, job 6 still sends up and
    takes its parent's sums; a third leaf on the same uplink as job 6 is refused, and nothing of it is written."""
    from switchagg.errors import ConfigError

    run = {"slot": 1, "generation": 0x7EE5}
    for r in range(3):
        send(diff, contrib(diff, 6, r, 700, **run))
    assert pending(send(diff, query(diff, 6, 1, 700, **run))) == 0b111
    send(diff, from_parent(diff, 6, 700, [5] * K, **run))
    assert pending(send(diff, query(diff, 6, 2, 700, **run))) == 0b111
    diff.reset(6)
    for r in range(3):
        send(diff, owned(diff, 6, r, 701, 8, **run))
    assert send(diff, from_parent(diff, 6, 701, None, flags=FLAG_OWNER, owner=9, **run)) == []  # bad_owner
    assert ranks_served(diff, 6, send(diff, from_parent(diff, 6, 701, None, flags=FLAG_OWNER, owner=8, **run))) == {
        0: 0, 1: 0, 2: 0}
    cfg7 = diff.jobs[7]
    diff.undeploy(7)
    diff.deploy(cfg7)
    for r in range(3):
        out = send(diff, contrib(diff, 6, r, 702, **run))
    partial_up(diff, 6, out)
    assert ranks_served(diff, 6, send(diff, from_parent(diff, 6, 702, [6] * K, **run))) == {0: K, 1: K, 2: K}
    twin = dataclasses.replace(diff.jobs[7], job_id=9, slot_base=30, parent=diff.jobs[6].parent)
    before = diff.bmv2.Bmv2Target(diff.bed.grpc_addr).jobs()
    with pytest.raises(ConfigError, match="job 6 on this switch already takes the RESULTs of job 40 as its child 2"):
        diff.bmv2.Bmv2Target(diff.bed.grpc_addr).deploy(twin)
    assert diff.bmv2.Bmv2Target(diff.bed.grpc_addr).jobs() == before
    diff.check_counters()
