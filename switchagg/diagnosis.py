"""Why a call stalled: which workers the switch still waits for, from its own answers (sans-I/O).

A stalled call (:class:`~switchagg.errors.StallError`, :class:`~switchagg.errors.JobNotStarted`) names
the packets it waits for; from its own side a worker cannot tell whose contribution the switch lacks,
so before it raises it asks the switch about the oldest :data:`ASKED` of them. Two sources answer:

* every target answers a QUERY about a chunk with a PENDING that carries the bitmap of the workers
  its slot copy has counted (``docs/protocol.md`` section 4), whatever the job's ``loss_recovery``:
  :meth:`Diagnosis.queries` are the QUERYs, :meth:`Diagnosis.receive` takes the answers, and
  :meth:`Diagnosis.from_answers` says what they show, or that none came (the switch is down, cut
  off, or no longer has the job);
* the embedded switch's control port tells a slot's copies outright: :meth:`Diagnosis.slots_request`
  is the request, :meth:`Diagnosis.from_slots` reads its reply.

In a tree (``docs/protocol.md`` section 10) the worker asks its leaf, which may hold every worker's
contribution and wait for its parent: the sentence then names the parent switch (``parent``), which a
leaf waits on for the sums of the other leaves, and the missing workers by their ranks in the tree.

Here are the questions and the sentence; the client sends, waits and reads (:data:`ASK_TRIES` rounds
of :data:`ASK_WAIT` each, a QUERY or its answer may be lost as any packet), so this module owns no
socket and reads no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .protocol import StreamParams
from .wire import Header, PacketType, make_header

ASKED = 4  # the stuck packets a diagnosis asks about: the oldest ones
ASK_TRIES = 2  # the QUERYs go this often, in case one or its answer is lost
ASK_WAIT = 0.15  # s: how long each try waits for the answers


class Diagnosis:
    """The questions a stalled call asks the switch about its oldest stuck packets, and the answers' sentence.

    ``pending`` is the call's :meth:`~switchagg.protocol.Reduction.pending`: (chunk id, slot, copy) of
    every packet still out, oldest first; ``parent`` names the parent switch of this worker's switch in a
    tree (its address and the parent's job), None for a flat job.
    """

    def __init__(self, params: StreamParams, pending: Sequence[tuple[int, int, int]],
                 parent: str | None = None) -> None:
        self.params, self.parent = params, parent
        self.stuck: dict[int, tuple[int, int]] = {chunk: (slot, copy) for chunk, slot, copy in pending[:ASKED]}
        self._bitmaps: dict[int, int] = {}  # chunk -> the workers its copy has counted, as the switch answered

    # ---- through QUERY and PENDING (every target) ---------------------------------------------------

    def queries(self) -> list[bytes]:
        """A QUERY about each stuck chunk's slot copy, to send to the switch."""
        p = self.params
        return [make_header(PacketType.QUERY, job=p.job, worker=p.worker, slot=slot, copy=copy, chunk=chunk,
                            generation=p.generation, key=p.key).pack()
                for chunk, (slot, copy) in self.stuck.items()]

    def receive(self, h: Header) -> bool:
        """Take a header that came back; returns whether it was an answer to one of :meth:`queries`."""
        p = self.params
        if (h.type != PacketType.PENDING or h.job != p.job or h.worker != p.worker or h.generation != p.generation
                or self.stuck.get(h.chunk) != (h.slot, h.copy)):
            return False
        self._bitmaps[h.chunk] = h.key  # a PENDING's key field is the bitmap
        return True

    @property
    def answered(self) -> bool:
        """Every stuck chunk has its answer: no need to wait for more."""
        return len(self._bitmaps) == len(self.stuck)

    def from_answers(self, switch: str) -> str:
        """What the answers so far show, as a sentence to append to the call's error (``switch``: where it is)."""
        if not self.stuck:
            return ""
        if not self._bitmaps:
            return (f" The switch at {switch} answered none of {len(self.stuck)} QUERYs either: it is down, "
                    "this worker cannot reach it, or it no longer has this job (`switchagg status`).")
        everyone = (1 << self.params.n_workers) - 1
        notes: list[str] = []
        up = [chunk for chunk in self.stuck if self.parent is not None and self._bitmaps.get(chunk) == everyone]
        for chunk in self.stuck:
            bitmap = self._bitmaps.get(chunk)
            if bitmap is None:
                notes.append(f"chunk {chunk}: no answer")
            elif bitmap == 0:
                notes.append(f"no worker's contribution of chunk {chunk} reached the switch")
            elif chunk in up:
                if chunk == up[0]:  # one note for them all: they wait alike
                    notes.append(f"every worker's contribution of {_chunks(up)} reached the switch, whose sums go "
                                 f"up to its parent switch {self.parent}: the parent (or another switch under it) "
                                 f"holds them up, or the results do not reach this worker")
            elif bitmap == everyone:
                notes.append(f"chunk {chunk} is summed, but its result does not reach this worker")
            else:
                notes.append(f"chunk {chunk} waits for workers {self._missing(bitmap)}")
        return " The switch answers: " + "; ".join(notes) + "."

    # ---- through the embedded switch's control port ------------------------------------------------

    def slots_request(self) -> dict[str, Any]:
        """The control port's request for the stuck chunks' slots (:mod:`switchagg.switch.control`)."""
        return {"op": "slots", "job": self.params.job, "slots": [slot for slot, _ in self.stuck.values()]}

    def from_slots(self, states: Mapping[str, Sequence[Mapping[str, int]]]) -> str:
        """What the control port's reply (its ``slots``: each slot's copies' tag and bitmap) shows, as a sentence."""
        if not self.stuck:
            return ""
        notes: list[str] = []
        n = self.params.n_workers
        held = {chunk: states[str(slot)][copy] for chunk, (slot, copy) in self.stuck.items()}
        ours = [chunk for chunk, state in held.items()
                if (state["generation"], state["chunk"]) == (self.params.generation, chunk)]
        # the partial went up and awaits the parent's sum: section 10's AWAITING, one note for every such chunk
        up = [chunk for chunk in ours if self.parent is not None and held[chunk]["count"] == n]
        for chunk, (slot, copy) in self.stuck.items():
            state = held[chunk]
            if chunk in ours:
                if chunk in up:
                    if chunk == up[0]:
                        notes.append(f"{_chunks(up)} hold every worker's contribution here and wait for the sums "
                                     f"of the parent switch {self.parent} (`switchagg status` there)")
                elif state["count"] >= n:  # summed (in a tree: the parent's result held here), not reaching us
                    notes.append(f"chunk {chunk} is summed, but its result does not reach this worker")
                else:
                    notes.append(f"chunk {chunk} still waits for workers {self._missing(state['bitmap'])}")
            else:
                notes.append(f"chunk {chunk} never reached the switch (slot {slot} copy {copy} "
                             f"holds chunk {state['chunk']})")
        return " The switch says: " + "; ".join(notes) + "."

    def _missing(self, bitmap: int) -> list[int]:
        """The ranks whose bit ``bitmap`` lacks (in a tree, the tree's ranks of this leaf's workers)."""
        base = self.params.rank - self.params.worker
        return [base + r for r in range(self.params.n_workers) if not bitmap >> r & 1]


def _chunks(chunks: Sequence[int]) -> str:
    """``chunk 8`` or ``chunks 8, 9, 10``: the chunks one note is about."""
    return f"chunk {chunks[0]}" if len(chunks) == 1 else "chunks " + ", ".join(map(str, chunks))
