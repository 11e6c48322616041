"""The switch's rules in C (``switchagg/_switch.c``): what the embedded switch serves with.

:class:`NativeSwitch` is the twin of :class:`~switchagg.switch.model.SwitchModel`, not a
subclass: the same rules, in the same order, with the same packets out, and its registers
given in the same record (:class:`~switchagg.switch.records.CopyState`), which a test
compares with the model's after the same traces. In Python the switch spends more CPU per
packet than the workers it serves. The job table is the shared one; admission, registers
and counters live in C. The data plane takes a batch of datagrams (:meth:`process_batch`) as
the server's socket lays them out; :meth:`process` takes one, for tests and the plain socket
backend. The stage trace is not recorded here: the model documents the order.

With ``shards`` > 1 several threads serve the one table at once, each calling
:meth:`process_batch` with its own shard number (the C code takes a lock per copy and keeps
counters per shard, see ``_switch.c``); :meth:`counters` sums the shards', and
:meth:`shard_stats` says what each served.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import _native
from ..errors import ConfigError
from ..frames import datagram_of
from ..jobs import Address, GlobalDrop, JobEntry, JobTable, named_counters
from ..transport import NAME_SIZE, from_sockaddr_in, sockaddr_in
from ..wire import HEADER_SIZE, MAX_WORKERS, unpack_header, values_of
from .records import CopyState, Emit, slot_state

MAX_SHARDS = 64  # _switch.c's


class NativeSwitch:
    """Aggregation state and admission of one switch with ``num_slots`` slots, in C, served by ``shards``
    threads (1..:data:`MAX_SHARDS`) that the kernel steers datagrams to by ``steer``, ``"job"`` or
    ``"slot"`` (:func:`~switchagg.switch.server.home_shard`: what ``off_home`` is counted against)."""

    def __init__(self, num_slots: int = 1024, shards: int = 1, steer: str = "job") -> None:
        if not 1 <= num_slots <= 0x10000:
            raise ConfigError(f"num_slots = {num_slots}: a switch has 1..65536 slots")
        if not 1 <= shards <= MAX_SHARDS:
            raise ConfigError(f"shards = {shards}: a switch has 1..{MAX_SHARDS} shards")
        if steer not in ("job", "slot"):
            raise ConfigError(f"steer = {steer!r}: the shards are steered by job or slot")
        self.num_slots, self.shards, self.steer = num_slots, shards, steer
        self.table = JobTable(num_slots)
        self._core = _native.Switch(num_slots, shards, steer == "slot")
        self._frame_drops = [0] * len(GlobalDrop)  # what process_frame drops, before the C switch sees it

    # ---- control plane -------------------------------------------------------------------------

    @property
    def jobs(self) -> dict[int, JobEntry]:
        return self.table.as_dict()

    def add_job(self, entry: JobEntry) -> None:
        self.table.add(entry)
        self._install(entry)

    def _install(self, entry: JobEntry) -> None:
        names = b"".join(sockaddr_in(address) for address in entry.workers)
        bases = np.array(entry.child_bases(), dtype=np.uint32).tobytes()
        up = entry.parent
        parent = (b"", 0, 0, 0) if up is None else (sockaddr_in(up.address), up.job_id, up.worker, up.key)
        self._core.install(entry.job_id, entry.generation, entry.key, entry.slot_base, entry.slot_count,
                           entry.values_per_packet, names, entry.tree_ranks, bases, *parent)

    def remove_job(self, job_id: int) -> JobEntry:
        entry = self.table.remove(job_id)
        self._core.remove(job_id)
        return entry

    def set_generation(self, job_id: int, generation: int) -> None:
        entry = dataclasses.replace(self.table.get(job_id), generation=generation)
        self.table.replace(entry)
        self._install(entry)

    # ---- data plane ----------------------------------------------------------------------------

    def process_batch(self, in_buf: np.ndarray, in_offsets: np.ndarray, in_lengths: np.ndarray,
                      in_names: np.ndarray, start: int, stop: int, out_buf: np.ndarray, out_offsets: np.ndarray,
                      out_lengths: np.ndarray, out_names: np.ndarray, out_body_offsets: np.ndarray,
                      out_body_lengths: np.ndarray, shard: int = 0) -> tuple[int, int]:
        """Datagrams ``start..stop-1`` in, packets to send out, as the server's socket lays both out
        (:meth:`UdpSocket.send_packets` with ``bodies``); see ``_native.Switch.process``. Packet j
        is ``out_lengths`` bytes at ``out_offsets`` (its header, and values under 1 KiB) and then its
        body (``out_body_offsets``, ``out_body_lengths``): a result's values of 1 KiB or more lie in
        ``out_buf`` once, and every packet of its multicast points at them (``_switch.c`` says why
        not the smaller ones). It runs without the GIL; ``shard`` is the calling thread's.

        Returns the next datagram to handle (it stops early when the out arrays might not hold
        the next one's packets) and how many packets it wrote.
        """
        return self._core.process(in_buf, in_offsets, in_lengths, in_names, start, stop, out_buf, out_offsets,
                                  out_lengths, out_names, out_body_offsets, out_body_lengths, shard)

    def process(self, data: bytes | memoryview, src: Address, shard: int = 0) -> list[Emit]:
        """One datagram in, what to send out: :meth:`SwitchModel.process`'s contract (served by ``shard``)."""
        names = np.frombuffer(sockaddr_in(src), dtype=np.uint8).reshape(1, NAME_SIZE)
        # room for the most any datagram can make (process_batch refuses one whose room is short): a packet to each
        # of the largest job's workers, each the datagram's length, or a header for a shorter one
        out = np.empty(MAX_WORKERS * max(len(data), HEADER_SIZE), dtype=np.uint8)
        heads, bodies = np.empty((2, MAX_WORKERS), dtype=np.uint32), np.empty((2, MAX_WORKERS), dtype=np.uint32)
        out_names = np.empty((MAX_WORKERS, NAME_SIZE), dtype=np.uint8)
        _, made = self.process_batch(np.frombuffer(bytes(data), dtype=np.uint8), np.zeros(1, np.uint32),
                                     np.array([len(data)], dtype=np.uint32), names, 0, 1, out, heads[0], heads[1],
                                     out_names, bodies[0], bodies[1], shard)
        emits = []
        for i in range(made):
            payload = out[heads[0, i]:heads[0, i] + heads[1, i]].tobytes() + \
                out[bodies[0, i]:bodies[0, i] + bodies[1, i]].tobytes()
            values = values_of(payload, (len(payload) - HEADER_SIZE) // 4) if len(payload) > HEADER_SIZE else None
            emits.append(Emit(from_sockaddr_in(out_names[i].tobytes()), unpack_header(payload), values))
        return emits

    def process_frame(self, frame: bytes | memoryview) -> list[Emit]:
        """:meth:`SwitchModel.process_frame`'s contract: the frame checks here, the datagram's in C."""
        got = datagram_of(frame)
        if got is None:
            return []
        if isinstance(got, GlobalDrop):
            self._frame_drops[got] += 1
            return []
        return self.process(*got)

    # ---- observation ---------------------------------------------------------------------------

    def counters(self, shard: int | None = None) -> dict[str, object]:
        """The model's counters: every shard's summed, or with ``shard`` that shard's alone (the drops
        of :meth:`process_frame`, which no shard sees, count in the sum only)."""
        frame_drops = self._frame_drops if shard is None else [0] * len(self._frame_drops)
        drops = [c + f for c, f in zip(self._core.counters(None, shard), frame_drops, strict=True)]
        return {"global": named_counters(drops, None)[0],
                "jobs": {job: named_counters(drops, self._core.counters(job, shard))[1]
                         for job in self.table.as_dict()}}

    def shard_stats(self) -> list[dict[str, int]]:
        """Per shard: the datagrams it served, and how many of them the steering (:mod:`switchagg.switch.server`)
        would have sent to another shard: those that came inside another datagram's segmented message, or
        that another thread handed it. Always 0 with one shard."""
        return [{"datagrams": d, "off_home": o} for d, o in self._core.shard_stats()]

    def registers(self, i: int) -> CopyState:
        return CopyState(*self._core.copy_state(i))

    def slot_state(self, job_id: int, slot: int) -> list[dict[str, int | None]]:
        job = self.table.get(job_id)
        i = 2 * (job.slot_base + slot)
        return slot_state(job, (self.registers(i), self.registers(i + 1)))
