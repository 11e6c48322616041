"""The records both switch twins share: one slot copy's registers, as a control plane reads them,
and a packet the switch sends.

:class:`~switchagg.switch.model.SwitchModel` (Python) and
:class:`~switchagg.switch.native.NativeSwitch` (C) keep their registers differently; each gives
:meth:`registers` in this one shape, which a test compares register by register after the same
packet traces, and which :func:`slot_state` reads for a stall's diagnosis.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..jobs import Address, JobEntry
from ..wire import Header

_U32 = 0xFFFFFFFF
RESULTS_KEPT = 256  # results whose values stay valid (see Emit)


class CopyState(NamedTuple):
    """The registers of copy ``i = 2 * (slot_base + slot) + copy``."""

    tag: int  # generation << 32 | chunk id
    bitmap: int  # the workers counted
    count: int
    exponent: int  # the largest proposed (int8)
    values: bytes | None  # the sums in wire order (big-endian int32); None where no chunk was ever written


def slot_state(job: JobEntry, copies: tuple[CopyState, CopyState]) -> list[dict[str, int | None]]:
    """Both copies of a job's slot as a stall's diagnosis reads them: the session generation and chunk
    each holds (a run's state is its session's: the reader compares both), None for a copy never written."""
    out = []
    for copy, state in enumerate(copies):
        live = state.tag >> 32 != 0  # generation 0 is no run's: what the registers power up holding
        out.append({"copy": copy, "generation": state.tag >> 32, "chunk": state.tag & _U32 if live else None,
                    "bitmap": state.bitmap if live else 0, "count": state.count if live else 0})
    return out


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
