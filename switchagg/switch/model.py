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

import numpy as np

from .. import _native
from ..errors import ConfigError
from ..frames import datagram_of
from ..jobs import Address, GlobalDrop, JobCounter, JobEntry, JobTable, named_counters
from ..wire import (
    FLAG_COPY,
    FLAG_OWNER,
    HEADER_SIZE,
    MAX_WORKERS,
    VALUE_DTYPE,
    VERSION,
    Header,
    PacketType,
    unpack_header,
    values_of,
)
from .records import RESULTS_KEPT, CopyState, Emit, slot_state

STAGES = ("tag", "bitmap", "count", "exponent", "values")
_U32 = 0xFFFFFFFF


class TagOutcome(enum.IntEnum):
    """What the tag stage decides about a contribution and the copy it addresses."""

    NEW = 0  # the copy held an older chunk, another generation, or nothing: start afresh
    SAME = 1  # the copy holds this very chunk
    STALE = 2  # the copy holds a newer chunk: drop


def chunk_is_newer(chunk: int, stored: int) -> bool:
    """Serial-number order on 32-bit chunk ids (RFC 1982): newer within half the space."""
    return 0 < ((chunk - stored) & _U32) < 0x80000000


class SwitchModel:
    """Aggregation state and admission of one switch with ``num_slots`` slots."""

    def __init__(self, num_slots: int = 1024) -> None:
        if not 1 <= num_slots <= 0x10000:
            raise ConfigError(f"num_slots = {num_slots}: a switch has 1..65536 slots")
        self.num_slots = num_slots
        self.table = JobTable(num_slots)
        self._admission: dict[tuple[int, int, str, int, int], JobEntry] = {}
        # a parent's RESULTs, admitted as its packets name this switch: (its job, our child index, its address, key)
        self._uplinks: dict[tuple[int, int, str, int, int], JobEntry] = {}
        self.global_counters = [0] * len(GlobalDrop)
        self.job_counters: dict[int, list[int]] = {}
        self.trace: list[str] | None = None
        size = 2 * num_slots  # the registers, all zeros: no packet of generation 0 is taken, so every copy is empty
        self.tag = [0] * size  # generation << 32 | chunk id
        self.bitmap = [0] * size
        self.count = [0] * size
        self.exponent = [0] * size
        self.values: list[np.ndarray | None] = [None] * size
        self._results: dict[int, list] = {}  # K -> [RESULTS_KEPT result buffers, the next one]

    # ---- control plane -------------------------------------------------------------------------

    @property
    def jobs(self) -> dict[int, JobEntry]:
        return self.table.as_dict()

    def add_job(self, entry: JobEntry) -> None:
        """Install a job's admission entries on cleared slots; refuses overlapping slots and reused ids.

        The slots are cleared here as well as at removal: a job re-added with its old generation
        must not find its old chunks "fresh" (another K's values among them)."""
        self.table.add(entry)
        self.job_counters[entry.job_id] = [0] * len(JobCounter)
        self._clear(entry)
        self._admit(entry)

    def _admit(self, entry: JobEntry) -> None:
        """Write a job's admission entries (a new job's, or an installed one's new generation)."""
        self._admission = {k: v for k, v in self._admission.items() if k[0] != entry.job_id}
        for rank, (ip, port) in enumerate(entry.workers):
            self._admission[(entry.job_id, rank, ip, port, entry.key)] = entry
        self._uplinks = {k: v for k, v in self._uplinks.items() if v.job_id != entry.job_id}
        if (up := entry.parent) is not None:
            self._uplinks[(up.job_id, up.worker, *up.address, up.key)] = entry

    def remove_job(self, job_id: int) -> JobEntry:
        """Uninstall a job: its admission entries go, and its slots return to the power-up state."""
        entry = self.table.remove(job_id)
        self.job_counters.pop(job_id)
        self._admission = {k: v for k, v in self._admission.items() if k[0] != job_id}
        self._uplinks = {k: v for k, v in self._uplinks.items() if v.job_id != job_id}
        self._clear(entry)
        return entry

    def _clear(self, entry: JobEntry) -> None:
        """Both copies of every slot of ``entry`` back to the power-up state (as a control plane writes
        registers), so that no state outlives the job that wrote it."""
        for i in range(2 * entry.slot_base, 2 * (entry.slot_base + entry.slot_count)):
            self.tag[i] = self.bitmap[i] = self.count[i] = self.exponent[i] = 0
            self.values[i] = None

    def set_generation(self, job_id: int, generation: int) -> None:
        """Reset a job: a new installed generation, which probes answer and the workers' join starts from.

        Packets carry their run's session generation, not this one (any but 0 is taken), so a reset
        does not cut an old run's packets off: runs are kept apart by the tag, where another
        generation's state reads as empty, and no register is swept. Like the P4 counters, the
        job's counters outlive the reset.
        """
        entry = dataclasses.replace(self.table.get(job_id), generation=generation)
        self.table.replace(entry)
        self._admit(entry)

    # ---- data plane ----------------------------------------------------------------------------

    def process(self, data: bytes | memoryview, src: Address) -> list[Emit]:
        """Handle one UDP payload from ``src``; return what to send (often nothing)."""
        if len(data) < HEADER_SIZE:
            return self._drop(GlobalDrop.MALFORMED)
        h = unpack_header(data)
        if h.version != VERSION:
            return self._drop(GlobalDrop.BAD_VERSION)
        if (h.type not in (PacketType.CONTRIB, PacketType.PROBE, PacketType.QUERY, PacketType.RESULT)
                or h.flags & ~(FLAG_COPY | FLAG_OWNER) or (h.owner and not h.flags & FLAG_OWNER)
                or h.worker >= MAX_WORKERS or len(data) != HEADER_SIZE + 4 * h.count
                or (h.type not in (PacketType.CONTRIB, PacketType.RESULT) and h.count)):
            return self._drop(GlobalDrop.MALFORMED)
        admission = self._uplinks if h.type == PacketType.RESULT else self._admission
        job = admission.get((h.job, h.worker, src[0], src[1], h.key))
        if job is None:
            # a RESULT is a packet this switch takes only from the parent of one of its jobs
            return self._drop(GlobalDrop.MALFORMED if h.type == PacketType.RESULT else GlobalDrop.NOT_ADMITTED)
        counters = self.job_counters[job.job_id]
        if h.type == PacketType.PROBE:
            counters[JobCounter.PROBES] += 1
            return [Emit(src, h._replace(type=PacketType.PROBE_REPLY, generation=job.generation), None)]
        # Any generation but 0 is a run's: each run (a session the workers agreed on) sums under its own
        # tag, and another's state reads as EMPTY. 0 is what every tag powers up holding: a packet of
        # generation 0 and chunk 0 would read a copy no run ever used as holding its chunk.
        if h.generation == 0:
            counters[JobCounter.WRONG_GENERATION] += 1
            return []
        if h.slot >= job.slot_count:
            counters[JobCounter.SLOT_OUT_OF_RANGE] += 1
            return []
        # An owner is a rank of the job's tree, which only admission knows: a drop of the job's, not malformed.
        # Without FLAG_OWNER the owner is 0 (checked above), which every job has.
        if h.owner >= job.tree_ranks:
            counters[JobCounter.BAD_OWNER] += 1
            return []
        if h.type == PacketType.QUERY:
            return self._query(h, src, job, counters)
        if h.type == PacketType.RESULT:  # a parent's sum: whole, or its header alone where the owner is elsewhere
            # the header alone only for a chunk whose owner is under another switch (FLAG_OWNER): an allreduce's
            # sum is whole on every branch
            if h.count != job.values_per_packet and (h.count or not h.flags & FLAG_OWNER):
                counters[JobCounter.BAD_COUNT] += 1
                return []
            return self._from_parent(h, values_of(data, h.count), job, counters)
        if h.count != job.values_per_packet:
            counters[JobCounter.BAD_COUNT] += 1
            return []
        return self._aggregate(h, values_of(data, h.count), src, job, counters)

    def process_frame(self, frame: bytes | memoryview) -> list[Emit]:
        """Handle one Ethernet frame sent to the switch's own address, as the P4 program does
        (:func:`~switchagg.frames.datagram_of` says what it takes)."""
        got = datagram_of(frame)
        if got is None:
            return []
        if isinstance(got, GlobalDrop):
            return self._drop(got)
        return self.process(*got)

    def _tag(self, i: int, h: Header) -> TagOutcome:
        """Stage 1, tag: is the packet's chunk new to copy ``i``, the one it holds, or older?"""
        stored = self.tag[i]
        if stored >> 32 != h.generation or chunk_is_newer(h.chunk, stored & _U32):
            return TagOutcome.NEW
        return TagOutcome.SAME if stored & _U32 == h.chunk else TagOutcome.STALE

    def _query(self, h: Header, src: Address, job: JobEntry, counters: list[int]) -> list[Emit]:
        """A worker asks which workers the copy has counted for its chunk; nothing is written.

        The answer, a PENDING unicast back, carries the copy's bitmap in its key field: with the
        worker's own bit clear its contribution never arrived (it resends it); with every bit set the
        sum is done (it resends too, and gets the stored RESULT); else a peer's is missing, and the
        worker waits instead of resending data the switch would drop. A copy that does not hold the
        chunk yet answers 0; one that moved on to a newer chunk drops the query as stale.
        """
        i = 2 * (job.slot_base + h.slot) + h.copy
        outcome = self._tag(i, h)
        if self.trace is not None:
            self.trace.append("tag")
        if outcome == TagOutcome.STALE:
            counters[JobCounter.STALE] += 1
            return []
        bitmap = self.bitmap[i] if outcome == TagOutcome.SAME else 0
        if self.trace is not None:
            self.trace.append("bitmap")
        counters[JobCounter.QUERIES] += 1
        return [Emit(src, h._replace(type=PacketType.PENDING, key=bitmap), None)]

    def _aggregate(self, h: Header, values: np.ndarray, src: Address, job: JobEntry,
                   counters: list[int]) -> list[Emit]:
        i = 2 * (job.slot_base + h.slot) + h.copy
        trace = self.trace
        # Stage 1, tag: is this chunk new to the copy, the one it holds, or older?
        outcome = self._tag(i, h)
        if outcome == TagOutcome.NEW:
            self.tag[i] = h.generation << 32 | h.chunk
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
        # Complete: every child counted. In a tree (a job with a parent) the count then says what the copy holds:
        # n, its partial sum, sent up and awaiting the parent's; n + 1, the parent's result (_from_parent).
        complete = count >= job.n_workers
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
            _native.add_be(row, values)  # wraps modulo 2**32 like the hardware
        if trace is not None:
            trace.append("values")
        if not complete:
            counters[JobCounter.CONTRIBUTIONS] += 1
            return []
        if job.parent is not None and count == job.n_workers:
            # A partial sum goes up as one contribution of the parent's job, with the children's largest
            # exponent. While it is awaited, child 0's repeat sends it again (the parent drops a copy it
            # counted, and answers one it finished with its stored result): one child's, not every child's,
            # or each loss anywhere in the tree would send a switch's partial up once per child.
            if repeat and h.worker != 0:
                counters[JobCounter.DUPLICATE_PENDING] += 1
                return []
            counters[JobCounter.PARTIALS_RESENT if repeat else JobCounter.CONTRIBUTIONS] += 1
            if not repeat:
                counters[JobCounter.PARTIALS_UP] += 1
            up = job.parent
            return [Emit(up.address, h._replace(type=PacketType.CONTRIB, worker=up.worker, job=up.job_id, key=up.key,
                                                exponent=exponent), self._snapshot(row))]
        # A reduce-scatter's chunk (FLAG_OWNER) goes whole down the owner's branch alone: every other child gets
        # the RESULT's header with count 0, which frees its slot and carries the next exponent. The flag and
        # the owner are the packet's (the completing one's, or the repeat's): all ranks mark a chunk alike.
        to_owner = bool(h.flags & FLAG_OWNER)
        if repeat:
            counters[JobCounter.RESULTS_UNICAST] += 1
            if to_owner and job.child_of(h.owner) != h.worker:
                return [Emit(src, h._replace(type=PacketType.RESULT, exponent=exponent, count=0), None)]
            return [Emit(src, h._replace(type=PacketType.RESULT, exponent=exponent), self._snapshot(row))]
        counters[JobCounter.CONTRIBUTIONS] += 1
        counters[JobCounter.RESULTS_TO_OWNER if to_owner else JobCounter.RESULTS_MULTICAST] += 1
        return self._down(h, job, exponent, self._snapshot(row))

    def _from_parent(self, h: Header, values: np.ndarray, job: JobEntry, counters: list[int]) -> list[Emit]:
        """The parent's RESULT for a copy whose partial it awaited: stored as the copy's result (count n + 1),
        then sent down as a finished sum is. Any other copy's state (another chunk, one not complete here,
        a result taken already) drops it: a late or repeated answer, or one from a run this copy never held."""
        i = 2 * (job.slot_base + h.slot) + h.copy
        trace = self.trace
        outcome = self._tag(i, h)
        if trace is not None:
            trace.extend(("tag", "bitmap", "count"))  # read, read, and n -> n + 1 where awaited
        if outcome != TagOutcome.SAME or self.count[i] != job.n_workers:
            counters[JobCounter.UNEXPECTED_RESULT] += 1
            return []
        self.count[i] = job.n_workers + 1
        self.exponent[i] = h.exponent
        if trace is not None:
            trace.append("exponent")
        row = self.values[i]
        if h.count:  # the header alone (owner elsewhere) leaves the partial: no child here gets the values
            np.copyto(row, values)
        if trace is not None:
            trace.append("values")
        counters[JobCounter.RESULTS_FROM_PARENT] += 1
        return self._down(h, job, h.exponent, self._snapshot(row) if h.count else None)

    def _down(self, h: Header, job: JobEntry, exponent: int, result: np.ndarray | None) -> list[Emit]:
        """A finished sum to every child: one replica each, with its index in the worker field (as the P4
        egress writes it), the job's id and key; whole down the owner's branch alone for a reduce-scatter's
        chunk, and nowhere whole where ``result`` is None (a parent's header for another branch's owner)."""
        v, _, flags, _, _, slot, chunk, generation, _, _, owner, count = h
        owner_child = job.child_of(owner) if flags & FLAG_OWNER else None
        out = []
        for rank, dst in enumerate(job.workers):
            whole = result is not None and (not flags & FLAG_OWNER or rank == owner_child)
            out.append(Emit(dst, Header(v, PacketType.RESULT, flags, rank, job.job_id, slot, chunk, generation,
                                        job.key, exponent, owner, count if whole else 0), result if whole else None))
        return out

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
        drops, _ = named_counters(self.global_counters, None)
        return {"global": drops, "jobs": {j: named_counters(self.global_counters, c)[1]
                                          for j, c in self.job_counters.items()}}

    def registers(self, i: int) -> CopyState:
        """Copy ``i``'s registers (``i = 2 * (slot_base + slot) + copy``)."""
        row = self.values[i]
        return CopyState(self.tag[i], self.bitmap[i], self.count[i], self.exponent[i],
                         None if row is None else row.tobytes())

    def slot_state(self, job_id: int, slot: int) -> list[dict[str, int | None]]:
        """Both copies of a job's slot, for diagnosing a stall (which workers are missing)."""
        job = self.table.get(job_id)
        i = 2 * (job.slot_base + slot)
        return slot_state(job, (self.registers(i), self.registers(i + 1)))
