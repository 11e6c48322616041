"""The switch's aggregation semantics as a pure class: the reference the P4 program must match.

No sockets, no clock: :meth:`SwitchModel.process` takes one UDP payload and its
source address and returns the packets to send; :meth:`SwitchModel.process_frame`
takes an Ethernet frame, as the P4 program does. ``docs/protocol.md`` has the
state table this code implements.

State is laid out as a Tofino would hold it: register arrays indexed by
``2 * (slot_base + slot) + copy``, each touched at most once per packet, in the
fixed order tag -> bitmap -> count -> exponent -> values, and every access a
read-modify-write whose outcome depends only on the packet and on earlier
stages. Set :attr:`SwitchModel.trace` to a list to record that order.
"""

from __future__ import annotations

import dataclasses
import enum
import socket
import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import _kernels
from ..config import JobConfig
from ..errors import ConfigError
from ..transport import NAME_SIZE, from_sockaddr_in, sockaddr_in
from ..wire import (
    FLAG_COPY,
    HEADER_SIZE,
    MAX_WORKERS,
    UDP_PORT,
    VALUE_DTYPE,
    VERSION,
    Header,
    PacketType,
    unpack_header,
    values_of,
)
from .counters import GlobalDrop, JobCounter

Address = tuple[str, int]
STAGES = ("tag", "bitmap", "count", "exponent", "values")
RESULTS_KEPT = 256  # results whose values stay valid (see Emit)
ETH_IP_UDP_SIZE = 14 + 20 + 8  # the headers before a frame's switchagg payload
_U32 = 0xFFFFFFFF


class TagOutcome(enum.IntEnum):
    """What the tag stage decides about a contribution and the copy it addresses."""

    NEW = 0  # the copy held an older chunk, another generation, or nothing: start afresh
    SAME = 1  # the copy holds this very chunk
    STALE = 2  # the copy holds a newer chunk: drop


def chunk_is_newer(chunk: int, stored: int) -> bool:
    """Serial-number order on 32-bit chunk ids (RFC 1982): newer within half the space."""
    return 0 < ((chunk - stored) & _U32) < 0x80000000


@dataclass(frozen=True)
class JobEntry:
    """What admission knows about an installed job (the P4 admission entry's parameters)."""

    job_id: int
    generation: int
    key: int
    slot_base: int
    slot_count: int
    values_per_packet: int
    workers: tuple[Address, ...]

    @classmethod
    def from_config(cls, config: JobConfig, generation: int) -> JobEntry:
        return cls(config.job_id, generation, config.key, config.slot_base, config.slot_count,
                   config.values_per_packet, tuple(w.address.tuple for w in config.workers))

    @property
    def n_workers(self) -> int:
        return len(self.workers)


class Emit(NamedTuple):
    """A packet the switch sends: destination, header, and values (None for none).

    The values are a read-only snapshot that the model reuses after
    :data:`RESULTS_KEPT` more results: send (or copy) them before then. A server
    sends what a batch of at most that many packets emitted, and allocates nothing
    per result.
    """

    dst: Address
    header: Header
    values: np.ndarray | None

    def payload(self) -> bytes:
        head = self.header.pack()
        return head if self.values is None else head + self.values.tobytes()


class SwitchModel:
    """Aggregation state and admission of one switch with ``num_slots`` slots."""

    def __init__(self, num_slots: int = 1024) -> None:
        if not 1 <= num_slots <= 0x10000:
            raise ConfigError(f"num_slots = {num_slots}: a switch has 1..65536 slots")
        self.num_slots = num_slots
        self.jobs: dict[int, JobEntry] = {}
        self._admission: dict[tuple[int, int, str, int, int], JobEntry] = {}
        self.global_counters = [0] * len(GlobalDrop)
        self.job_counters: dict[int, list[int]] = {}
        self.trace: list[str] | None = None
        self._power_up(2 * num_slots)

    def _power_up(self, size: int) -> None:
        """The registers, ``size`` copies each, all zeros: generation 0 is never installed, so every copy is empty."""
        self.tag = [0] * size  # generation << 32 | chunk id
        self.bitmap = [0] * size
        self.count = [0] * size
        self.exponent = [0] * size
        self.values: list[np.ndarray | None] = [None] * size
        self._results: dict[int, list] = {}  # K -> [RESULTS_KEPT result buffers, the next one]

    # ---- control plane -------------------------------------------------------------------------

    def add_job(self, entry: JobEntry) -> None:
        """Install a job's admission entries; refuses overlapping slots and reused ids."""
        if entry.job_id in self.jobs:
            raise ConfigError(f"job {entry.job_id} is already installed: remove or reset it first")
        if entry.slot_base + entry.slot_count > self.num_slots:
            raise ConfigError(
                f"job {entry.job_id} wants slots {entry.slot_base}..{entry.slot_base + entry.slot_count - 1}"
                f" but the switch has {self.num_slots}: lower slot_base or slot_count")
        mine = range(entry.slot_base, entry.slot_base + entry.slot_count)
        for other in self.jobs.values():
            theirs = range(other.slot_base, other.slot_base + other.slot_count)
            if mine.start < theirs.stop and theirs.start < mine.stop:
                raise ConfigError(
                    f"job {entry.job_id}'s slots {mine.start}..{mine.stop - 1} overlap job "
                    f"{other.job_id}'s {theirs.start}..{theirs.stop - 1}: give it another slot_base")
        if not 1 <= entry.n_workers <= MAX_WORKERS:
            raise ConfigError(f"job {entry.job_id} has {entry.n_workers} workers; 1..{MAX_WORKERS} are allowed")
        self.job_counters[entry.job_id] = [0] * len(JobCounter)
        self._install(entry)

    def _install(self, entry: JobEntry) -> None:
        """Write a job's admission entries (a new job's, or an installed one's new generation)."""
        self.jobs[entry.job_id] = entry
        self._admission = {k: v for k, v in self._admission.items() if k[0] != entry.job_id}
        for rank, (ip, port) in enumerate(entry.workers):
            self._admission[(entry.job_id, rank, ip, port, entry.key)] = entry

    def remove_job(self, job_id: int) -> JobEntry:
        entry = self.jobs.pop(job_id, None)
        if entry is None:
            raise ConfigError(f"job {job_id} is not installed on this switch")
        self.job_counters.pop(job_id)
        self._admission = {k: v for k, v in self._admission.items() if k[0] != job_id}
        return entry

    def set_generation(self, job_id: int, generation: int) -> None:
        """Reset a job: state of the old generation now reads as empty; no register is swept.

        Like the P4 counters, the job's counters outlive the reset.
        """
        entry = self.jobs.get(job_id)
        if entry is None:
            raise ConfigError(f"job {job_id} is not installed on this switch")
        self._install(dataclasses.replace(entry, generation=generation))

    # ---- data plane ----------------------------------------------------------------------------

    def process(self, data: bytes | memoryview, src: Address) -> list[Emit]:
        """Handle one UDP payload from ``src``; return what to send (often nothing)."""
        if len(data) < HEADER_SIZE:
            return self._drop(GlobalDrop.MALFORMED)
        h = unpack_header(data)
        if h.version != VERSION:
            return self._drop(GlobalDrop.BAD_VERSION)
        if (h.type not in (PacketType.CONTRIB, PacketType.PROBE) or h.flags & ~FLAG_COPY
                or h.reserved or h.worker >= MAX_WORKERS or len(data) != HEADER_SIZE + 4 * h.count
                or (h.type == PacketType.PROBE and h.count)):
            return self._drop(GlobalDrop.MALFORMED)
        job = self._admission.get((h.job, h.worker, src[0], src[1], h.key))
        if job is None:
            return self._drop(GlobalDrop.NOT_ADMITTED)
        counters = self.job_counters[job.job_id]
        if h.type == PacketType.PROBE:
            counters[JobCounter.PROBES] += 1
            return [Emit(src, h._replace(type=PacketType.PROBE_REPLY, generation=job.generation), None)]
        if h.generation != job.generation:
            counters[JobCounter.WRONG_GENERATION] += 1
            return []
        if h.slot >= job.slot_count:
            counters[JobCounter.SLOT_OUT_OF_RANGE] += 1
            return []
        if h.count != job.values_per_packet:
            counters[JobCounter.BAD_COUNT] += 1
            return []
        return self._aggregate(h, values_of(data, h.count), src, job, counters)

    def process_frame(self, frame: bytes | memoryview) -> list[Emit]:
        """Handle one Ethernet frame sent to the switch's own address, as the P4 program does.

        The embedded switch gets datagrams from the kernel; the P4 program gets frames, and what
        it takes of them (``docs/protocol.md``, section 1) is stated here, for the differential
        test to hold it to. A switchagg datagram is IPv4 with a 20-byte header, unfragmented, and
        UDP to :data:`UDP_PORT`; its payload is what the IPv4 and UDP lengths say, whatever the
        frame holds past them. UDP with IPv4 options or in fragments is counted by reason (a later
        fragment has no port to tell whose it is, and the switch serves no other UDP); any other
        frame is not the switch's to count, and yields nothing. The IPv4 checksum is not verified
        (admission and the length checks cover the fields the switch relies on); the P4 program
        works out a reply's afresh.
        """
        if len(frame) < ETH_IP_UDP_SIZE or frame[12:14] != b"\x08\x00" or frame[23] != socket.IPPROTO_UDP:
            return []
        if frame[14] & 0x0F != 5:
            return self._drop(GlobalDrop.IP_OPTIONS)
        ip_length, fragment = struct.unpack_from(">H2xH", frame, 16)
        if fragment & 0x3FFF:  # more fragments, or an offset
            return self._drop(GlobalDrop.FRAGMENT)
        src_port, dst_port, udp_length = struct.unpack_from(">HHH", frame, 34)
        if dst_port != UDP_PORT:
            return []
        if udp_length != ip_length - 20 or len(frame) < 14 + ip_length:
            return self._drop(GlobalDrop.MALFORMED)
        src = socket.inet_ntoa(bytes(frame[26:30])), src_port
        return self.process(frame[ETH_IP_UDP_SIZE:14 + ip_length], src)

    def _aggregate(self, h: Header, values: np.ndarray, src: Address, job: JobEntry,
                   counters: list[int]) -> list[Emit]:
        i = 2 * (job.slot_base + h.slot) + h.copy
        trace = self.trace
        # Stage 1, tag: is this chunk new to the copy, the one it holds, or older?
        stored = self.tag[i]
        if stored >> 32 != h.generation or chunk_is_newer(h.chunk, stored & _U32):
            outcome = TagOutcome.NEW
            self.tag[i] = h.generation << 32 | h.chunk
        elif stored & _U32 == h.chunk:
            outcome = TagOutcome.SAME
        else:
            outcome = TagOutcome.STALE
        if trace is not None:
            trace.append("tag")
        if outcome == TagOutcome.STALE:
            counters[JobCounter.STALE] += 1
            return []
        # Stage 2, bitmap: has this worker been counted already?
        bit = 1 << h.worker
        old_bitmap = 0 if outcome == TagOutcome.NEW else self.bitmap[i]
        self.bitmap[i] = old_bitmap | bit
        repeat = bool(old_bitmap & bit)
        if trace is not None:
            trace.append("bitmap")
        # Stage 3, count: first write resets, a new worker increments, a repeat only reads.
        if outcome == TagOutcome.NEW:
            self.count[i] = 1
        elif not repeat:
            self.count[i] += 1
        count = self.count[i]
        if trace is not None:
            trace.append("count")
        complete = count == job.n_workers
        if repeat and not complete:
            counters[JobCounter.DUPLICATE_PENDING] += 1
            return []
        # Stage 4, exponent: the max over workers of the exponent proposed for the slot's next chunk.
        if outcome == TagOutcome.NEW:
            self.exponent[i] = h.exponent
        elif not repeat:
            self.exponent[i] = max(self.exponent[i], h.exponent)
        exponent = self.exponent[i]
        if trace is not None:
            trace.append("exponent")
        # Stage 5, values: write, add (wrapping like int32 hardware) or read.
        row = self.values[i]  # kept in wire order, so a result goes out as it lies
        if outcome == TagOutcome.NEW:
            if row is None or row.size != values.size:
                row = self.values[i] = np.empty(values.size, dtype=VALUE_DTYPE)
            np.copyto(row, values)
        elif not repeat:
            _kernels.add_be(row, values)  # wraps modulo 2**32 like the hardware
        if trace is not None:
            trace.append("values")
        if not complete:
            counters[JobCounter.CONTRIBUTIONS] += 1
            return []
        result = self._snapshot(row)
        if repeat:
            counters[JobCounter.RESULTS_UNICAST] += 1
            return [Emit(src, h._replace(type=PacketType.RESULT, exponent=exponent), result)]
        counters[JobCounter.CONTRIBUTIONS] += 1
        counters[JobCounter.RESULTS_MULTICAST] += 1
        # One replica per worker, each with its rank in the worker field (as the P4 egress writes it).
        v, _, flags, _, job_id, slot, chunk, generation, key, _, reserved, count = h
        return [Emit(dst, Header(v, PacketType.RESULT, flags, rank, job_id, slot, chunk, generation, key, exponent,
                                 reserved, count), result)
                for rank, dst in enumerate(job.workers)]

    def _snapshot(self, row: np.ndarray) -> np.ndarray:
        """A read-only copy of a result row, in the next buffer of a ring kept per K."""
        ring = self._results.get(row.size)
        if ring is None:
            ring = self._results[row.size] = [np.empty((RESULTS_KEPT, row.size), dtype=VALUE_DTYPE), 0]
        buffers, n = ring
        ring[1] = (n + 1) % RESULTS_KEPT
        out = buffers[n]
        np.copyto(out, row)
        view = out.view()
        view.flags.writeable = False
        return view

    def _drop(self, reason: GlobalDrop) -> list[Emit]:
        self.global_counters[reason] += 1
        return []

    # ---- observation ---------------------------------------------------------------------------

    def counters(self) -> dict[str, object]:
        """All counters by name: switch-wide drops, and per job its events and drops."""
        return _named_counters(self.global_counters, self.job_counters)

    def slot_state(self, job_id: int, slot: int) -> list[dict[str, int]]:
        """Both copies of a job's slot, for diagnosing a stall (which workers are missing)."""
        job = self.jobs[job_id]
        out = []
        for copy in (0, 1):
            tag, bitmap, count = self._copy_state(2 * (job.slot_base + slot) + copy)
            live = tag >> 32 == job.generation
            out.append({"copy": copy, "chunk": tag & _U32 if live else None,
                        "bitmap": bitmap if live else 0, "count": count if live else 0})
        return out

    def _copy_state(self, i: int) -> tuple[int, int, int]:
        return self.tag[i], self.bitmap[i], self.count[i]


def _named_counters(global_counters: list[int], job_counters: dict[int, list[int]]) -> dict[str, object]:
    return {
        "global": {r.name.lower(): global_counters[r] for r in GlobalDrop},
        "jobs": {job_id: {c.name.lower(): values[c] for c in JobCounter} for job_id, values in job_counters.items()},
    }


class NativeSwitch(SwitchModel):
    """:class:`SwitchModel` with its registers, admission and counters in C (``switchagg/_switch.c``).

    The same rules, in the same order, with the same packets out: the embedded switch's
    server runs this one, because in Python the switch spends more CPU per packet than the
    workers it serves. The control plane (validation, job table) is the model's; the data
    plane takes a batch of datagrams (:meth:`process_batch`) as the server's socket lays them
    out. :meth:`process` takes one datagram, for tests and the plain socket
    backend. The stage trace is not recorded here: the model documents the order.
    """

    def _power_up(self, size: int) -> None:
        self._core = _kernels.Switch(size // 2)

    def _install(self, entry: JobEntry) -> None:
        super()._install(entry)
        names = b"".join(sockaddr_in(address) for address in entry.workers)
        self._core.install(entry.job_id, entry.generation, entry.key, entry.slot_base, entry.slot_count,
                           entry.values_per_packet, names)

    def remove_job(self, job_id: int) -> JobEntry:
        entry = super().remove_job(job_id)
        self._core.remove(job_id)
        return entry

    def process_batch(self, in_buf: np.ndarray, in_offsets: np.ndarray, in_lengths: np.ndarray,
                      in_names: np.ndarray, start: int, stop: int, out_buf: np.ndarray, out_offsets: np.ndarray,
                      out_lengths: np.ndarray, out_names: np.ndarray) -> tuple[int, int]:
        """Datagrams ``start..stop-1`` in, packets to send out, as the server's socket lays both out;
        see ``_kernels.Switch.process``.

        Returns the next datagram to handle (it stops early when the out arrays might not hold
        the next one's packets) and how many packets it wrote.
        """
        return self._core.process(in_buf, in_offsets, in_lengths, in_names, start, stop, out_buf, out_offsets,
                                  out_lengths, out_names)

    def process(self, data: bytes | memoryview, src: Address) -> list[Emit]:
        size = max(len(data), HEADER_SIZE)
        names = np.frombuffer(sockaddr_in(src), dtype=np.uint8).reshape(1, NAME_SIZE)
        out = np.empty(MAX_WORKERS * size, dtype=np.uint8)
        out_offsets = np.empty(MAX_WORKERS, dtype=np.uint32)
        out_lengths = np.empty(MAX_WORKERS, dtype=np.uint32)
        out_names = np.empty((MAX_WORKERS, NAME_SIZE), dtype=np.uint8)
        _, made = self.process_batch(np.frombuffer(bytes(data), dtype=np.uint8), np.zeros(1, np.uint32),
                                     np.array([len(data)], dtype=np.uint32), names, 0, 1, out, out_offsets,
                                     out_lengths, out_names)
        emits = []
        for i in range(made):
            payload = out[out_offsets[i]:out_offsets[i] + out_lengths[i]].tobytes()
            values = values_of(payload, (len(payload) - HEADER_SIZE) // 4) if len(payload) > HEADER_SIZE else None
            emits.append(Emit(from_sockaddr_in(out_names[i].tobytes()), unpack_header(payload), values))
        return emits

    def counters(self) -> dict[str, object]:
        # The frame checks (process_frame) count in Python, the datagram checks in C.
        drops = [c + f for c, f in zip(self._core.counters(None), self.global_counters, strict=True)]
        return _named_counters(drops, {job: self._core.counters(job) for job in self.jobs})

    def _copy_state(self, i: int) -> tuple[int, int, int]:
        return self._core.copy_state(i)[:3]
