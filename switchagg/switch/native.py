"""The switch's rules in C (``switchagg/_switch.c``): what the embedded switch serves with.

:class:`NativeSwitch` is the twin of :class:`~switchagg.switch.model.SwitchModel`, not a
subclass: the same rules, in the same order, with the same packets out, and its registers
given in the same record (:class:`~switchagg.switch.records.CopyState`), which a test
compares with the model's after the same traces. In Python the switch spends more CPU per
packet than the workers it serves. The job table is the shared one; admission, registers
and counters live in C. The data plane takes a batch of datagrams (:meth:`process_batch`) as
the server's socket lays them out; :meth:`process` takes one, for tests and the plain socket
backend. The stage trace is not recorded here: the model documents the order.
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


class NativeSwitch:
    """Aggregation state and admission of one switch with ``num_slots`` slots, in C."""

    def __init__(self, num_slots: int = 1024) -> None:
        if not 1 <= num_slots <= 0x10000:
            raise ConfigError(f"num_slots = {num_slots}: a switch has 1..65536 slots")
        self.num_slots = num_slots
        self.table = JobTable(num_slots)
        self._core = _native.Switch(num_slots)
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
        self._core.install(entry.job_id, entry.generation, entry.key, entry.slot_base, entry.slot_count,
                           entry.values_per_packet, names)

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
                      out_lengths: np.ndarray, out_names: np.ndarray) -> tuple[int, int]:
        """Datagrams ``start..stop-1`` in, packets to send out, as the server's socket lays both out;
        see ``_native.Switch.process``.

        Returns the next datagram to handle (it stops early when the out arrays might not hold
        the next one's packets) and how many packets it wrote.
        """
        return self._core.process(in_buf, in_offsets, in_lengths, in_names, start, stop, out_buf, out_offsets,
                                  out_lengths, out_names)

    def process(self, data: bytes | memoryview, src: Address) -> list[Emit]:
        """One datagram in, what to send out: :meth:`SwitchModel.process`'s contract."""
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

    def counters(self) -> dict[str, object]:
        drops = [c + f for c, f in zip(self._core.counters(None), self._frame_drops, strict=True)]
        return {"global": named_counters(drops, None)[0],
                "jobs": {job: named_counters(drops, self._core.counters(job))[1] for job in self.table.as_dict()}}

    def registers(self, i: int) -> CopyState:
        return CopyState(*self._core.copy_state(i))

    def slot_state(self, job_id: int, slot: int) -> list[dict[str, int | None]]:
        job = self.table.get(job_id)
        i = 2 * (job.slot_base + slot)
        return slot_state(job, (self.registers(i), self.registers(i + 1)))
