"""The state record both switch twins expose: one slot copy's registers, as a control plane reads them.

:class:`~switchagg.switch.model.SwitchModel` (Python) and
:class:`~switchagg.switch.native.NativeSwitch` (C) keep their registers differently; each gives
:meth:`registers` in this one shape, which a test compares register by register after the same
packet traces, and which :func:`slot_state` reads for a stall's diagnosis.
"""

from __future__ import annotations

from typing import NamedTuple

from ..jobs import JobEntry

_U32 = 0xFFFFFFFF


class CopyState(NamedTuple):
    """The registers of copy ``i = 2 * (slot_base + slot) + copy``."""

    tag: int  # generation << 32 | chunk id
    bitmap: int  # the workers counted
    count: int
    exponent: int  # the largest proposed (int8)
    values: bytes | None  # the sums in wire order (big-endian int32); None where no chunk was ever written


def slot_state(job: JobEntry, copies: tuple[CopyState, CopyState]) -> list[dict[str, int | None]]:
    """Both copies of a job's slot as a stall's diagnosis reads them: state of another generation is empty."""
    out = []
    for copy, state in enumerate(copies):
        live = state.tag >> 32 == job.generation
        out.append({"copy": copy, "chunk": state.tag & _U32 if live else None,
                    "bitmap": state.bitmap if live else 0, "count": state.count if live else 0})
    return out
