"""The join handshake: the workers of a run agree, through the switch, on a session generation no
earlier run used.

A switch keeps a copy's state until a newer chunk or another generation replaces it, and a new
run's workers start their chunk ids where every run does. Had a run used the job's installed
generation, a restarted job would meet its previous run's finished copies under the very same
tags and be served their sums as repeats. So every run sums under a **session generation** of its
own, random, which its workers settle before their first call. They have no channel but the
switch, and no worker can tell by itself whether a copy it meets is fresh; but each can tell
whether a sum holds *its own* fresh random words, and every worker receives the same sum of a
copy. The handshake builds on that (``docs/protocol.md``, section 6a), in rungs of two phases,
each an ordinary int32 sum of P chunks (ids 0 to P - 1) in which every rank owns two words, P being as
many chunks as the ranks' words fill (:func:`switchagg.calls.parts`: 1 up to K / 2 ranks, 32 for 1,024
ranks at K = 64), one per slot of the rung's *block* of P slots. The job's S slots hold ``S // P``
blocks; rung ``r`` runs on block ``r mod (S // P)`` (where P = 1, slot ``r mod S``), its nonces in
copy 0 and its verdict in copy 1:

1. **Nonces** (copy 0): each rank writes a fresh 64-bit nonce. Under the first rung's tag (the
   job's installed generation, which a PROBE tells, and chunk 0) an earlier run's copy may still
   sit, finished or half-filled: then some rank finds a word that is not its nonce in the sum.
2. **Verdict** (copy 1), under a generation drawn from that sum (fresh if any rank's nonce in it
   is): each rank writes whether its own nonce came back, and a fresh 32-bit word. The run takes
   the session generation drawn from this sum if every rank said yes and each rank finds its own
   words in it; otherwise every rank sees the same refusal and they climb to the next rung, under a
   generation drawn from this sum. A verdict that an earlier run left under the same tag holds
   none of this run's words, so no rank takes it.
3. **Close** (block 0's copy 1, only where the run agreed on a rung of another block), under a
   generation drawn from the agreed verdict: a sum of zeros that replaces the first rung's verdict,
   which every rank has passed, so that the next run's first rung is refused at its own verdict and
   its climb stays short (a run that joined and stopped without a call would otherwise lengthen the
   path by a rung for the next).

Each rank decides from sums that every rank received alike, so they decide alike. A phase's sum is
its P chunks' sums together, each of which may be fresh or an earlier run's on its own, and every
draw hashes all of them; so the verdict runs under an earlier run's tag only where the whole nonce sum
was that run's, where every rank found its nonce missing: a verdict part that holds any of this run's
words then holds a no, and a rank takes the session only if it finds its own words and no no. Climbing
follows the path earlier runs took, so it ends where they stopped. A rank can climb that path alone
(the switch serves a finished copy again to anyone, no peer needed) and wait at the first phase with
a chunk whose tag is fresh; a slower peer must still find every earlier rung's copy there to follow
it. So each rung has a block of its own: a rung's first write replaces no copy of the rungs before
it while the path is shorter than ``S // P`` rungs, and with the close a path is two rungs long unless
earlier runs died inside their handshakes. Blocks never overlap, so a rung either holds the first
rung's slots or none of them: the close never replaces a part of the agreed verdict. A ``switchagg
reset`` (a new installed generation) starts from a fresh first tag. Pure logic: the client moves the
packets.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import NamedTuple

import numpy as np

from .calls import WORDS, parts
from .errors import JobNotStarted

MAX_RUNGS = 32  # an earlier path longer than this means something else is wrong


class Phase(NamedTuple):
    """One sum of the handshake: under which generation, in which slots and copy, with what values.

    Its P chunks (P x K values) go as chunk ids 0 to P - 1 on slots ``slot`` to ``slot + P - 1``."""

    generation: int
    slot: int  # the first of the rung's block: (rungs mod blocks) x P
    copy: int  # 0: the nonces, 1: the verdict
    values: np.ndarray  # P x K big-endian int32: this rank's two words at its place, zeros elsewhere


class Join:
    """One rank's side of the handshake; :attr:`phase` is the sum to run next, :meth:`take` its result,
    until :attr:`session` is set."""

    def __init__(self, base: int, rank: int, ranks: int, k: int, slots: int) -> None:
        self.parts = parts(ranks, k)  # chunks of a phase, one per slot of a rung's block
        if self.parts > slots:
            raise ValueError(f"the join's sums of {ranks} ranks' {WORDS} words take {self.parts} chunks of K = {k} "
                             f"values, a slot each, but the job has {slots} slots: give it at least {self.parts}, "
                             "or a larger K")
        self.base, self.rank, self.n, self.k, self.slots = base, rank, ranks, k, slots
        self.session: int | None = None
        self.rungs = 0
        self._sent = (0, 0)
        self._nonce_ok = False
        self._agreed: int | None = None  # the session, once agreed where a close phase follows
        self.phase = self._nonces(base)

    def _row(self, words: tuple[int, int]) -> np.ndarray:
        row = np.zeros(self.parts * self.k, dtype=">u4")
        row[WORDS * self.rank:WORDS * self.rank + WORDS] = words
        self._sent = words
        return row.view(">i4")

    def _own(self, result: bytes) -> tuple[int, int]:
        words = np.frombuffer(result, dtype=">u4", count=WORDS * self.n)
        return int(words[WORDS * self.rank]), int(words[WORDS * self.rank + 1])

    def _nonces(self, generation: int) -> Phase:
        nonce = secrets.randbits(64) | 1  # never all zeros: a rank that wrote nothing reads as zeros
        block = self.rungs % (self.slots // self.parts)
        return Phase(generation, block * self.parts, 0, self._row((nonce >> 32, nonce & 0xFFFFFFFF)))

    def take(self, result: bytes) -> None:
        """The sum the current phase came back with (P x K big-endian int32: its chunks' in order)."""
        if self.session is not None:
            raise RuntimeError("the handshake is over")
        if self._agreed is not None:  # the close's sum: it only replaced a copy, and decides nothing
            self.session = self._agreed
            return
        if self.phase.copy == 0:
            self._nonce_ok = self._own(result) == self._sent
            self.phase = Phase(self._draw(b"verdict", result), self.phase.slot, 1,
                               self._row((int(self._nonce_ok), secrets.randbits(32) | 1)))
            return
        flags = np.frombuffer(result, dtype=">u4", count=WORDS * self.n)[::WORDS]
        if self._own(result) == self._sent and bool((flags == 1).all()):
            if self.phase.slot == 0:  # the first rung's block, whose copies replaced the first's: no close
                self.session = self._draw(b"session", result)
            else:
                self._agreed = self._draw(b"session", result)
                self.phase = Phase(self._draw(b"close", result), 0, 1, self._row((0, 0)))
            return
        self.rungs += 1
        if self.rungs >= MAX_RUNGS:
            raise JobNotStarted(
                f"the workers of this job could not agree on a fresh session in {MAX_RUNGS} tries: state that "
                "earlier runs left on the switch keeps getting in the way (`switchagg reset` the job)")
        self.phase = self._nonces(self._draw(b"rung", result))

    def _draw(self, domain: bytes, result: bytes) -> int:
        """A generation every rank draws alike from a sum they all received: never 0 (what a switch
        powers up holding) nor the installed one (the first rung's)."""
        digest = hashlib.blake2b(domain + result, digest_size=4, person=b"switchagg-join").digest()
        value = int.from_bytes(digest, "big")
        while value in (0, self.base):
            digest = hashlib.blake2b(domain + digest, digest_size=4, person=b"switchagg-join").digest()
            value = int.from_bytes(digest, "big")
        return value
