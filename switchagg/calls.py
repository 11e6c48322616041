"""What a call is, said to every peer before any of its data moves: the call round's descriptor.

Every allreduce call starts with a *call round*: one packet per slot the call uses (at least one per
part of the descriptors, below, also for an empty call or an int32 one), before any data chunk. Its values, which
the switch sums like any others, hold each worker's **descriptor** of the call in two words of
its own, ``[2 * rank, 2 * rank + 1]`` of a row of every rank's words, and zeros elsewhere. The sum
is then every worker's descriptor side by side, so each worker can check, before it sends a single
data chunk, that all ranks are making the same call: the same length, kind (float or int32), op and
place in the sequence of calls, and the same collective (an allreduce, or a reduce-scatter:
:class:`Layout`). Mismatched calls therefore never add their data up, and every rank learns of
the mismatch from the same sums, so every rank raises for the same call. A rank whose input
could not be reduced at all sends a descriptor marked *failed* instead, so that its peers fail
that call with it instead of pairing their next call with its next one.

A chunk of K values holds the words of K / 2 ranks, and a tree has up to 65,535 (section 10), so
the row is cut into :func:`parts` chunks: part ``p`` holds ranks ``[p * K / 2, (p + 1) * K / 2)``,
and call-round entry ``j`` carries part ``j mod P``. A call round therefore has at least P
entries (:func:`call_rounds`); where every rank fits in one chunk (P = 1), every entry carries the
whole row, as it always did. A rank sends no data until it holds every part's sum, and decides
only then: that every rank's words are what its own descriptor would put there.

When the call round shows any difference, every rank knows every rank's descriptor, so they all
agree on what the call consumed (:func:`footprint`): chunk ids and slot copies stay paired, and
the next call works. Pure functions of the numbers: no I/O (``docs/protocol.md``, section 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import CallMismatch, PeerFailed
from .wire import VALUE_DTYPE

WORDS = 2  # words of a call round's values that each rank owns
KINDS = {"float": 1, "int32": 2}
OPS = {"sum": 1, "mean": 2}
COLLECTIVES = {"allreduce": 0, "reduce_scatter": 1}
_PRESENT = 1 << 31  # set in every descriptor's second word: a rank that wrote one
_SCATTER = 1 << 30  # the collective: set for a reduce-scatter
_FAILED = 1 << 25
_LENGTH_HIGH = 0x1FF  # bits 32..40 of the length, in bits 16..24 of the second word
MAX_LENGTH = 1 << 41  # values one call can carry
SEQ_MOD = 1 << 16  # the call's place in the session, modulo this


@dataclass(frozen=True)
class Layout:
    """Which of a call's values each data chunk carries, and which rank receives its sum.

    An allreduce (one shard, no owner) cuts its vector into chunks of K values, the last one short,
    and every rank receives every sum. A reduce-scatter among n ranks (``scatter``, n shards) cuts
    each rank's shard of ``shard`` values apart: ``per_shard`` = ceil(shard / K) chunks each, each
    shard's last one short, so that no chunk straddles two owners; chunk ``c`` belongs to rank
    ``c // per_shard``, who alone receives its sum (the others receive its RESULT's header only).
    """

    k: int
    shard: int  # values per shard: an allreduce's whole vector
    shards: int = 1  # an allreduce's 1; a reduce-scatter's n ranks
    scatter: bool = False  # a reduce-scatter: each chunk's sum goes whole only to its owner

    @classmethod
    def of(cls, length: int, k: int, n_workers: int, collective: str) -> Layout:
        """The layout of a call of ``length`` values (for a reduce-scatter, a multiple of ``n_workers``)."""
        if collective == "allreduce":
            return cls(k, length)
        if length % n_workers:
            raise ValueError(f"reduce_scatter needs a length that {n_workers} ranks divide evenly (each gets "
                             f"length / {n_workers} values), not {length}: pad the tensor to a multiple of "
                             f"{n_workers}")
        return cls(k, length // n_workers, n_workers, scatter=True)

    @property
    def per_shard(self) -> int:
        """Data chunks per shard."""
        return -(-self.shard // self.k)

    @property
    def n_chunks(self) -> int:
        return self.shards * self.per_shard

    def owner(self, chunk: int) -> int:
        """The rank whose shard data chunk ``chunk`` is part of."""
        return chunk // self.per_shard

    def source(self, chunk: int) -> tuple[int, int]:
        """Where data chunk ``chunk``'s values lie in the call's input: [start, stop)."""
        owner, j = divmod(chunk, self.per_shard)
        start = owner * self.shard + j * self.k
        return start, min(start + self.k, (owner + 1) * self.shard)

    def target(self, chunk: int) -> tuple[int, int]:
        """Where its sums go in the owner's output (the shard): [start, stop)."""
        j = chunk % self.per_shard
        return j * self.k, min((j + 1) * self.k, self.shard)


@dataclass(frozen=True)
class CallDescriptor:
    """One rank's call: its place in the session, length in values, kind, op and collective, or that it failed."""

    seq: int
    length: int = 0
    kind: str = "int32"
    op: str = "sum"
    failed: bool = False
    collective: str = "allreduce"

    def words(self) -> tuple[int, int]:
        """The two 32-bit words this descriptor takes in the call round."""
        if self.failed:
            return 0, _PRESENT | _FAILED | self.seq % SEQ_MOD
        if not 0 <= self.length < MAX_LENGTH:
            raise ValueError(f"a call carries at most {MAX_LENGTH - 1} values, not {self.length}")
        return (self.length & 0xFFFFFFFF,
                _PRESENT | COLLECTIVES[self.collective] * _SCATTER | KINDS[self.kind] << 28 | OPS[self.op] << 26
                | (self.length >> 32 & _LENGTH_HIGH) << 16 | self.seq % SEQ_MOD)

    @classmethod
    def from_words(cls, low: int, high: int) -> CallDescriptor | None:
        """The descriptor two words hold, or None where they hold none (a rank that wrote no descriptor)."""
        if not high & _PRESENT:
            return None
        seq = high % SEQ_MOD
        if high & _FAILED:
            return cls(seq, failed=True)
        kinds = {v: k for k, v in KINDS.items()}
        ops = {v: k for k, v in OPS.items()}
        kind, op = kinds.get(high >> 28 & 3), ops.get(high >> 26 & 3)
        if kind is None or op is None:
            return None
        collective = "reduce_scatter" if high & _SCATTER else "allreduce"
        return cls(seq, (high >> 16 & _LENGTH_HIGH) << 32 | low, kind, op, collective=collective)

    def rounds(self, k: int, slots: int, ranks: int) -> int:
        """Packets of this call's call round among ``ranks`` ranks: one per slot it uses, and at least
        one per part of the descriptors (:func:`call_rounds`)."""
        chunks = 0
        if not self.failed:
            # a reduce-scatter's length is a multiple of n (its caller checks, else it failed): a descriptor
            # read from a foreign sum that says otherwise counts the whole shards it has
            length = self.length - self.length % ranks if self.collective == "reduce_scatter" else self.length
            chunks = Layout.of(length, k, ranks, self.collective).n_chunks
        return call_rounds(chunks, slots, parts(ranks, k))

    def __str__(self) -> str:
        if self.failed:
            return f"call #{self.seq}: failed before it started"
        what = "reduce_scatter of " if self.collective == "reduce_scatter" else ""
        return f"call #{self.seq}: {what}{self.length} {self.kind} values, op {self.op}"


def parts(ranks: int, k: int) -> int:
    """Chunks of K values that ``ranks`` ranks' :data:`WORDS` words each take, side by side: at least one."""
    return max(1, -(-WORDS * ranks // k))


def call_rounds(n_chunks: int, slots: int, n_parts: int) -> int:
    """Entries of the call round of a call of ``n_chunks`` data chunks: one per slot the data uses, and
    at least one per part of the descriptors. Each takes a slot of its own, so the parts must fit the
    job's slots."""
    if n_parts > slots:
        raise ValueError(f"the call round needs {n_parts} slots (the ranks' descriptors, {WORDS} words each, fill "
                         f"{n_parts} chunks of K values), but the job has {slots}: give the job at least {n_parts} "
                         "slots, or a larger K")
    return max(n_parts, min(slots, n_chunks))


def rows(desc: CallDescriptor, rank: int, ranks: int, k: int) -> tuple[np.ndarray, bytes]:
    """This rank's call-round values and the sum every rank must get back (the same descriptor at every
    rank's place), each :func:`parts` x K big-endian int32: call-round entry ``j`` carries K of them,
    part ``j mod P``."""
    words = desc.words()
    size = parts(ranks, k) * k
    mine = np.zeros(size, dtype=">u4")
    mine[WORDS * rank:WORDS * rank + WORDS] = words
    expect = np.zeros(size, dtype=">u4")
    expect[:WORDS * ranks] = words * ranks
    return mine.view(VALUE_DTYPE), expect.tobytes()


def read(row: bytes, ranks: int) -> list[CallDescriptor | None]:
    """Each rank's descriptor in a call round's sum (every part's, in order)."""
    words = np.frombuffer(row, dtype=">u4", count=WORDS * ranks)
    return [CallDescriptor.from_words(int(words[WORDS * r]), int(words[WORDS * r + 1])) for r in range(ranks)]


def footprint(row: bytes, ranks: int, k: int, slots: int) -> int:
    """How many ids and slots a call that the call round stopped has used on every rank alike: the
    largest call round any rank sent (whatever a rank sent past another's is left unfinished, and
    the next use of those slots takes their other copy under newer ids)."""
    return max((d.rounds(k, slots, ranks) if d is not None else slots) for d in read(row, ranks))


def mismatch_error(row: bytes, ranks: int, rank: int) -> CallMismatch | PeerFailed:
    """The error every rank raises for a call whose call round showed different calls."""
    descs = read(row, ranks)
    failed = [r for r, d in enumerate(descs) if d is not None and d.failed and r != rank]
    if failed:
        return PeerFailed(
            f"rank(s) {failed} could not take part in this call (their input could not be reduced; each of "
            "them raised the reason), so no rank gets a result for it; the next calls stay paired")
    said = "; ".join(f"rank {r}: " + (str(d) if d is not None else "no descriptor (not this protocol's call round)")
                     for r, d in enumerate(descs))
    return CallMismatch(
        f"the ranks' calls do not match, so none of them is summed ({said}). Every rank must make the same "
        "calls in the same order (allreduce or reduce_scatter), with tensors of the same length and kind (float or "
        "int32) and the same op")
