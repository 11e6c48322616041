"""The worker's side of the streaming protocol, as sans-I/O state machines.

:class:`Reduction` is one allreduce or reduce-scatter call: it decides which packet goes out when,
takes the results that come back, and raises when the job never starts or
stops making progress. It owns no socket and reads no clock: the caller feeds
it packets and the current time and sends what it puts in :attr:`Reduction.outbox`,
having :meth:`Reduction.encode` write each packet's values where it will send them from.
A :class:`~switchagg.window.Window` carries the congestion window and the round-trip
estimates from one call to the next.

The schedule (``docs/protocol.md`` has the whole story): a call of ``N`` data
chunks over a job with ``S`` slots first sends a call round, one packet per slot
in use and at least one per part of the descriptors (``R = max(P, min(S, N))``,
:func:`switchagg.calls.call_rounds`), whose values carry every worker's descriptor
of the call (:mod:`switchagg.calls`: entry ``j`` part ``j % P``) and whose header carries each
worker's proposed exponent for the slot's first data chunk. No data chunk goes before every
part's sum is in; where one shows that the ranks' calls differ, the call ends there
(:attr:`Reduction.mismatch`). Data chunk ``d`` then goes on slot ``d % S`` with the agreed
(maximum) exponent that came back in the result of the slot's previous use, and
proposes the exponent of chunk ``d + S``. A slot's next use goes out only when
its previous result is back (self-clocking), and at most ``Window.size`` packets
are outstanding. The join handshake's sums (:mod:`switchagg.session`) run without
a call round (``call=None``).

A reduce-scatter (``layout``, :class:`~switchagg.calls.Layout`) runs the very same schedule over
its own chunks, each rank's shard cut apart; its data chunks name their owner (``FLAG_OWNER``),
and the switch sends each sum whole to the owner alone and the RESULT's header (count 0, the
slot's next exponent) to the others, which completes the chunk there as a sum does: windows,
timers, retransmissions and queries are unchanged. A result whose owner or count is not its
chunk's is a switch's error: counted, never decoded.

:class:`NativeReduction` is the same state machine in C (``switchagg/_stream.c``), which is what a
client runs: per packet it costs a fraction of the Python. It quantizes numpy data itself; a tensor
on a GPU is quantized there, a window of chunks at a time (:class:`StagedPayloads`), and the stream
sends its rows from pinned memory.
Both take datagrams with :meth:`~Reduction.receive_batch` and write the packets due into the
caller's send rows with :meth:`~Reduction.emit`; the tests run each simulated network on both
and require the same bytes at the same times.
"""

from __future__ import annotations

import heapq
import math
from array import array
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from . import _native, calls
from .calls import Layout
from .errors import JobNotStarted, StallError
from .window import Window
from .wire import (
    EXP_NONE,
    EXP_NONFINITE,
    FLAG_OWNER,
    HEADER_SIZE,
    HEADER_STRUCT,
    VALUE_DTYPE,
    Buffer,
    Header,
    PacketType,
    make_header,
    unpack_header,
)

_U32 = 0xFFFFFFFF


@dataclass(frozen=True)
class StreamParams:
    """What a worker's packets say about it and its job."""

    job: int
    worker: int
    key: int
    generation: int
    n_workers: int
    slot_count: int
    values_per_packet: int
    ask_first: bool = False  # job.loss_recovery "query": a QUERY before any resend of one's contribution
    # In a tree (docs/protocol.md section 10) ``worker`` and ``n_workers`` are the leaf's (this host's index
    # there, and its fan-in: a PENDING's bits), while a call's ranks are the tree's: this one's place among them
    # (a reduce-scatter's owner, its shard) and their number (the headroom). None: the job's own.
    tree_rank: int | None = None
    tree_ranks: int | None = None

    @property
    def rank(self) -> int:
        """This worker's rank in the call: the tree's, or the job's."""
        return self.worker if self.tree_rank is None else self.tree_rank

    @property
    def ranks(self) -> int:
        """The call's ranks: the tree's, or the job's workers."""
        return self.n_workers if self.tree_ranks is None else self.tree_ranks


class Payloads(Protocol):
    """How a reduction gets its chunks' values and hands back the sums (the codec's side)."""

    def proposals(self) -> np.ndarray | None:
        """The proposed exponent of every data chunk, or None when the values are not floats."""

    def encode(self, chunk: int, exponent: int, out: np.ndarray) -> None:
        """Write data chunk ``chunk`` into ``out`` as K big-endian int32, quantized with ``exponent``."""

    def decode(self, chunk: int, exponent: int, sums: Buffer) -> None:
        """Store the summed data chunk ``chunk`` (quantized with ``exponent``): K big-endian int32. A
        reduce-scatter decodes only the chunks this rank owns, into its shard."""


@runtime_checkable
class StagedPayloads(Payloads, Protocol):
    """Payloads quantized elsewhere (a GPU: :class:`~switchagg.torch_payloads.TorchPayloads`), a window of
    chunks at a time, as the switch agrees their exponents.

    A reduction of them sends data chunk ``d`` only once ``d`` < :attr:`Reduction.prepared`, and whoever
    drives it calls :meth:`advance` after every step (a receive, a tick), which quantizes the chunks whose
    exponents are agreed (:meth:`Reduction.agreed_upto`, :meth:`Reduction.exponents`), a window at a
    time, and hands them over (:meth:`Reduction.prepare`), and takes the sums back a window at a time
    (:meth:`Reduction.summed_upto`). :attr:`rows` and :attr:`sums` are where the C stream reads each chunk's
    quantized values and writes each sum, a row of K native int32 per chunk (``sums``: the chunks this
    rank receives); :meth:`encode` and :meth:`decode` read and write the same rows, one at a time.
    """

    rows: np.ndarray
    sums: np.ndarray

    def advance(self, red: Reduction | NativeReduction, now: float) -> None:
        """Quantize what the switch agreed, a window at a time, and take back the sums that came."""


BACKOFF_CAP = 3  # once a call has results, a resent packet's wait doubles at most this often
EARLY_PROBE = 4  # a call with a full window out, or none of its results yet, probes only with this many out
RUN_CAP = 64  # a run that a lossy silence's probe finds lost resends at most this many: a GSO message's datagrams
RUN_ASK = 8  # a job that resends without asking asks first about a run of at least this many found lost at once
BURST_STEPS = 3  # a lossy silence's probes after its first: 4, 16 and 64 packets a probe timeout apart, then doubling
LOST, PROBE, TIMEOUT = 0, 1, 2  # why a packet is resent: RACK found it lost, a tail loss probe, its timer
SENT, ASKED, WAITING = 0, 1, 2  # a packet out: its data sent; a QUERY sent; a peer's missing (the switch said)


class Send(NamedTuple):
    """A packet to send: its header, and what :meth:`Reduction.encode` turns into its values.

    The values are written only when the packet goes out, straight into the
    buffer it is sent from, so a call of any size allocates nothing per packet.
    """

    header: Header
    data_chunk: int  # the chunk of the tensor it carries; -1 in the call round (the descriptors); a QUERY none
    exponent: int  # the agreed exponent its values are quantized with


class Reduction:
    """One allreduce or reduce-scatter call over the switch (see the module docstring for the schedule)."""

    def __init__(self, params: StreamParams, window: Window, payloads: Payloads, *,
                 n_chunks: int, first_id: int, copies: np.ndarray, now: float,
                 progress_timeout: float, started: bool = False,
                 call: tuple[np.ndarray, bytes] | None = None, layout: Layout | None = None,
                 first_slot: int = 0) -> None:
        """``copies[s]`` is the shadow copy of slot ``s``'s next use; this call advances it.
        Data chunk ``d`` goes on slot ``(first_slot + d) % slot_count``: the join's phases pick their
        slot so that a rung never replaces a copy of the rungs before it (:mod:`switchagg.session`).

        ``progress_timeout`` is how long the call waits for a first result and then
        for each further one before it raises: :class:`JobNotStarted` if the job never
        produced a result (``started`` says whether an earlier call did), else
        :class:`StallError`. ``call`` is the call round's values and the sum they must come
        back as (:func:`switchagg.calls.rows`: a part of K values for each call-round entry, in turn);
        None runs int32 data alone (the join's sums).
        ``layout`` is a reduce-scatter's (:class:`~switchagg.calls.Layout`, ``n_chunks`` of its
        chunks): each data chunk goes out marked with its owner, and only the owner's chunks come
        back with values (:meth:`_receive`); None is an allreduce.
        """
        self.params, self.window, self.payloads = params, window, payloads
        self.n_chunks, self.first_id = n_chunks, first_id
        # data chunks whose values can be encoded: a staged payload's, a window at a time (prepare)
        self.prepared = 0 if isinstance(payloads, StagedPayloads) else n_chunks
        self._agreed_upto = self._summed_upto = 0  # data chunks [0, m) agreed, and summed
        proposals = payloads.proposals()
        if call is None and proposals is not None:
            raise ValueError("floats need the call round: it carries their exponents")
        self._layout = layout if layout is not None and layout.scatter else None
        if self._layout is not None and self._layout.n_chunks != n_chunks:
            raise ValueError(f"a reduce-scatter's layout has {self._layout.n_chunks} chunks, not n_chunks = {n_chunks}")
        if self._layout is not None and params.ranks > 256:
            raise ValueError(f"a reduce-scatter over {params.ranks} ranks: its owner byte names ranks 0..255")
        self._call_row, self._expect = (None, None) if call is None else call
        self._parts = call_parts(call, params)  # entry t of the call round carries part t % parts
        self.mismatch: bytes | None = None  # the call round's sums, where they showed other calls than this one
        # the call round's sum of each part, as far as it came: no data goes before all of them are in
        self._gathered = bytearray(len(self._expect) if call is not None else 0)
        self._unseen = bytearray(b"\x01" * self._parts)
        self._n_unseen = self._parts
        self._differs = False  # some part's sum is not what this rank's descriptor would make it
        # Per-packet state in compact arrays of Python ints: numpy scalars cost more per access.
        self._proposals = None if proposals is None else array("b", proposals.astype(np.int8).tobytes())
        if first_slot and call is not None:
            raise ValueError("a call round's entries take the first slots: its data chunks start on slot 0")
        self._first_slot = first_slot % params.slot_count
        self.rounds, copy0 = start_call(copies, n_chunks, parts=self._parts, first_slot=self._first_slot)
        self.total = self.rounds + n_chunks
        self._copy0 = copy0.tolist()
        self._agreed = array("b", [EXP_NONE]) * self.total  # the exponent each result carried
        self._result = (PacketType.RESULT, params.worker, params.job, params.generation, params.key)  # a RESULT of ours
        self._pending = (PacketType.PENDING, params.worker, params.job, params.generation, 0)  # and a PENDING
        self._all = (1 << params.n_workers) - 1  # a PENDING's bitmap of a finished sum
        self._done = bytearray(self.total)
        self.n_done = 0
        self._next = 0
        # t -> [last send, retries, first send, order, timer deadline, first resend, SENT/ASKED/WAITING],
        # in order of last send
        self._outstanding: dict[int, list] = {}
        self._sends = 0  # packets this call sent: the order of each send
        self._timers: list[tuple[float, int]] = []  # (deadline, t); one whose packet's deadline moved is stale
        self.outbox: list[Send] = []
        self.last_progress = now
        self.progress_timeout = progress_timeout
        self.started = started
        self.retransmissions = 0  # contributions sent again
        self.queries = 0  # QUERY packets sent
        self.protocol_errors = 0  # results of this call's packets whose shape (owner, count) was not the packet's
        # datagrams that are no result or answer of this run's at all (too short, another type, lengths that
        # disagree, another job's, worker's, session's or key): ignored, and counted where they come
        self.foreign = 0
        # RACK: the order and round trip of the latest-sent packet, sent once, whose result came back
        self._rack_order, self._rack_rtt = -1, 0.0
        self._probes = 0  # tail loss probes sent since the last new result
        self._bursting = False  # the silence began on a lossy path: its probes are bursts (_probe_burst)
        self._quiet_from = 0  # the order of the first send after the call's last silence (a probe or timeout)
        self._run_asked = (-math.inf, 0.0)  # (when, first send of) the last QUERY about a lost packet sent once
        self._probe_from = now  # the last new result or probe: the next probe waits from here
        self._first_result = math.inf  # when this call's first result came
        self._stalled = False  # a packet went again for an RTO of silence since the last new result
        # the first send of a lossy silence's probed packet whose resend was answered in this receive batch: what
        # went out once no later than it is lost with it (_resend_run); -inf: none
        self._run_lost = -math.inf
        self._start_batch()
        self._fill(now)

    # ---- the schedule ----------------------------------------------------------------------------

    def _prev(self, t: int) -> int | None:
        """The entry that used ``t``'s slot just before it in this call, if any."""
        if t < self.rounds:
            return None
        d = t - self.rounds
        if d < self.params.slot_count:
            return d if self.rounds else None
        return t - self.params.slot_count

    def _ready(self, t: int) -> bool:
        if t - self.rounds >= self.prepared:  # a staged chunk waits for its window
            return False
        if t >= self.rounds and self._n_unseen:  # data waits for every part of the call round
            return False
        prev = self._prev(t)
        return prev is None or bool(self._done[prev])

    # ---- a staged payload's windows (StagedPayloads) ------------------------------------------------

    def prepare(self, upto: int, now: float) -> None:
        """Data chunks below ``upto`` have their values now: send what the schedule allows."""
        self.prepared = max(self.prepared, min(upto, self.n_chunks))
        self._fill(now)

    def agreed_upto(self) -> int:
        """Data chunks ``[0, m)`` whose exponents are agreed (the results before them on their slots are in): m."""
        while self._agreed_upto < self.n_chunks:
            prev = self._prev(self.rounds + self._agreed_upto)
            if prev is not None and not self._done[prev]:
                break
            self._agreed_upto += 1
        return self._agreed_upto

    def exponents(self, start: int, stop: int) -> bytes:
        """The agreed exponent (int8) of data chunks ``[start, stop)``, every one agreed."""
        if not 0 <= start <= stop <= self._agreed_upto:
            raise ValueError(f"exponents({start}, {stop}): only data chunks [0, {self._agreed_upto}) are agreed yet")
        prev = (self._prev(self.rounds + d) for d in range(start, stop))
        return array("b", [EXP_NONE if p is None else self._agreed[p] for p in prev]).tobytes()

    def summed_upto(self) -> int:
        """Data chunks ``[0, m)`` whose results are in: m."""
        while self._summed_upto < self.n_chunks and self._done[self.rounds + self._summed_upto]:
            self._summed_upto += 1
        return self._summed_upto

    def _slot_copy(self, t: int) -> tuple[int, int]:
        """The slot and shadow copy that entry ``t`` uses: each use of a slot flips its copy."""
        if t < self.rounds:
            return t, self._copy0[t]
        d = t - self.rounds
        slot = (self._first_slot + d) % self.params.slot_count
        use = d // self.params.slot_count + (slot < self.rounds)
        return slot, (self._copy0[slot] + use) & 1

    def _packet(self, t: int) -> Send:
        p = self.params
        if t < self.rounds:
            data_chunk, exponent_used = -1, EXP_NONE
            proposal = EXP_NONE if self._proposals is None or t >= self.n_chunks else self._proposals[t]
        else:
            data_chunk = t - self.rounds
            prev = self._prev(t)
            exponent_used = EXP_NONE if prev is None else self._agreed[prev]
            nxt = data_chunk + p.slot_count
            proposal = self._proposals[nxt] if self._proposals is not None and nxt < self.n_chunks else EXP_NONE
        slot, copy = self._slot_copy(t)
        header = make_header(PacketType.CONTRIB, job=p.job, worker=p.worker, slot=slot, copy=copy,
                             chunk=(self.first_id + t) & _U32, generation=p.generation, key=p.key,
                             exponent=proposal, count=p.values_per_packet, owner=self._owner(t))
        return Send(header, data_chunk, exponent_used)

    def _owner(self, t: int) -> int | None:
        """The rank that receives entry ``t``'s sum whole: a reduce-scatter's data chunk's owner; None
        where every rank does (the call round, an allreduce)."""
        if self._layout is None or t < self.rounds:
            return None
        return self._layout.owner(t - self.rounds)

    def _shape(self, t: int) -> tuple[int, int, int]:
        """What a RESULT of entry ``t`` must carry besides its ids: (owner flag, owner, count). The sum
        whole (K values) where this rank receives it; a header alone (count 0) for a reduce-scatter's
        chunk that another rank owns."""
        owner = self._owner(t)
        if owner is None:
            return 0, 0, self.params.values_per_packet
        return FLAG_OWNER, owner, self.params.values_per_packet if owner == self.params.rank else 0

    def _query(self, t: int) -> Send:
        """A QUERY about entry ``t``: which workers has its slot copy counted (a header, no values)?"""
        p = self.params
        slot, copy = self._slot_copy(t)
        header = make_header(PacketType.QUERY, job=p.job, worker=p.worker, slot=slot, copy=copy,
                             chunk=(self.first_id + t) & _U32, generation=p.generation, key=p.key)
        return Send(header, -1, EXP_NONE)

    def encode(self, send: Send, out: np.ndarray) -> None:
        """Write ``send``'s K values into ``out`` (big-endian int32), e.g. the row it is sent from."""
        if send.data_chunk < 0:  # call-round entry t carries part t % P: the chunk id tells t
            k = self.params.values_per_packet
            part = ((send.header.chunk - self.first_id) & _U32) % self._parts
            out[:] = self._call_row[part * k:(part + 1) * k]
        else:
            self.payloads.encode(send.data_chunk, send.exponent, out)

    def emit(self, rows: np.ndarray, lengths: np.ndarray) -> int:
        """Write the packets due, oldest first, into ``rows`` (uint8, a packet per row) and each one's
        length into ``lengths`` (a QUERY is a header, a contribution K values more); returns how many."""
        n = min(len(self.outbox), len(rows), len(lengths))
        for i, send in enumerate(self.outbox[:n]):
            HEADER_STRUCT.pack_into(rows[i], 0, *send.header)
            end = lengths[i] = HEADER_SIZE + 4 * send.header.count
            if send.header.count:
                self.encode(send, rows[i, HEADER_SIZE:end].view(VALUE_DTYPE))
        del self.outbox[:n]
        return n

    def _resend_wait(self, retries: int) -> float:
        """How long a packet sent (or asked about) ``retries`` times again waits for its result.

        About as long as those before it took: only the few packets resent are resent again when
        that runs out, never a window. Once the call has results, the backoff is bounded, so that a
        packet lost twice does not wait a second on a live job. At the call's tail (at most
        :data:`EARLY_PROBE` packets out, this one among them) it waits no longer than
        :attr:`Window.tail_timeout`, and once the call has results its second resend no longer than
        its first: there every peer waits on the few packets out, and a chunk that holds up the
        schedule is one (its slot's next chunk waits for its result); a recovery by QUERY is four
        packets (the QUERY, its PENDING, the resend, the result) where a resend's is two, so it
        meets a second loss about twice as often.
        """
        backoff = retries - 1
        wait = self.window.resend_timeout
        if len(self._outstanding) <= EARLY_PROBE:
            wait = min(wait, self.window.tail_timeout)
            if self.n_done:
                backoff = max(0, backoff - 1)
        if self.n_done:
            backoff = min(backoff, BACKOFF_CAP)
        return min(self.window.max_rto, wait * 2.0 ** backoff)

    def _send(self, t: int, now: float, retries: int, state: int = SENT, post: bool = True) -> None:
        """Send entry ``t``'s contribution (SENT), or a QUERY about it (ASKED), the ``retries``-th time again;
        ``post`` False: as if sent, for an entry that waits on the QUERY of another of its run."""
        if post:
            self.outbox.append(self._query(t) if state == ASKED else self._packet(t))
        # else the RTO, with full backoff while the job has not answered yet (peers may still be starting)
        wait = self._resend_wait(retries) if retries and self.started else self.window.timeout_for(retries)
        if retries:
            _, _, first, _, _, resent, _ = self._outstanding.pop(t)
            resent = now if retries == 1 else resent  # its first resend (or query)
        else:
            first = resent = now
        # at the end: the dict is in order of last send
        self._outstanding[t] = [now, retries, first, self._sends, now + wait, resent, state]
        self._sends += 1
        heapq.heappush(self._timers, (now + wait, t))

    def _fill(self, now: float) -> None:
        if self.mismatch is not None:  # the call is over: no data of a mismatched call goes
            return
        while (self._next < self.total and len(self._outstanding) < self.window.size
               and self._ready(self._next)):
            self._send(self._next, now, 0)
            self._next += 1

    # ---- inputs ----------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Every result is in, or the call round ended the call (:attr:`mismatch`)."""
        return self.n_done == self.total or self.mismatch is not None

    @property
    def marked(self) -> bool:
        """Whether some data chunk of the call went marked (:data:`~switchagg.wire.EXP_NONFINITE`: some
        rank's values in it held NaN or infinity), as far as the results so far tell: a result carries
        the exponent its slot's next chunk uses (no next chunk: every rank proposed none). Every rank
        receives every result's exponent, a reduce-scatter's header-only ones too, so once the call is
        done every rank knows this alike, whichever rank owns the marked chunk."""
        return EXP_NONFINITE in self._agreed

    def receive_batch(self, buf: Buffer, offsets: np.ndarray | memoryview, lengths: np.ndarray | memoryview,
                      now: float) -> int:
        """Take the datagrams received at ``now``: datagram i is ``lengths[i]`` bytes at ``buf[offsets[i]:]``
        (uint32 arrays, or memoryviews of them, as ``UdpSocket.drive`` gives).

        Whatever is not a RESULT for this call is ignored (and counted in :attr:`foreign` where it is not
        this run's at all); returns how many were new. The batch is
        taken whole, as TCP takes an ACK: each datagram's result, then the window learns from the
        batch's round trips once (:meth:`Window.on_results`) and is filled once.
        """
        view = memoryview(buf).cast("B")
        fresh = 0
        for at, length in zip(offsets.tolist(), lengths.tolist(), strict=False):
            data = view[at:at + length]
            if length < HEADER_SIZE:
                self.foreign += 1
                continue
            h = unpack_header(data)
            if h.type == PacketType.RESULT and length == HEADER_SIZE + 4 * h.count:
                fresh += self._receive(h, data[HEADER_SIZE:], now)
            elif h.type == PacketType.PENDING and length == HEADER_SIZE:
                self._receive_pending(h, now)
            else:
                self.foreign += 1
        if self._run_lost > -math.inf:
            self._resend_run(now)
        if self._taken:
            self.window.on_results(now, self._taken, self._longest, self._shortest, self._settled,
                                   self._settled_shortest)
            self._start_batch()
        if fresh:
            self._fill(now)
            self._cap_tail()
        return fresh

    def _resend_run(self, now: float) -> None:
        """Resend the packets sent once no later than :attr:`_run_lost` whose results the receive batch did
        not bring: the run that a lossy silence's probe found lost, one loss for the window.

        The probe (the oldest packet sent once) came back answered, so its first send was lost, its
        contribution on the way up or its result on the way down, and so was what left with it: a GSO
        message is lost whole, and a run at the switch's output takes the results that follow. Without
        this a worker whose last message was lost whole sent one packet a probe timeout (its result
        gives the rest a probe timeout to come, for a late peer's), so a lost tail of n packets took n
        probe timeouts: in simulation of the gso bed (7 workers, 5%), a call of 8 data chunks 22 ms
        against 0.4 ms lossless. Asking first, a probe is a QUERY and its PENDING says the same
        (:meth:`_receive_pending`). Only on a lossy path (the silence bursts), where a silence is
        likelier a lost run than a late peer, whose results would follow the probe's at once.
        """
        due, self._run_lost = self._run_lost, -math.inf
        run = [u for u, e in self._outstanding.items() if not e[1] and e[0] <= due][:RUN_CAP]
        for u in run:
            self._resend(u, LOST, now)
        if run:
            self.window.on_loss()

    def _start_batch(self) -> None:
        """No results yet of the receive batch's packets sent once, for the window (Window.on_results): how
        many, their longest and shortest round trips, and how many and the shortest of those settled."""
        self._taken, self._longest, self._shortest = 0, -math.inf, math.inf
        self._settled, self._settled_shortest = 0, math.inf

    def _take_call_round(self, t: int, row: bytes) -> None:
        """Call-round entry ``t``'s sum: its part's. Once every part's is in, and any differs from what this
        rank's descriptor makes it, the call is over (:attr:`mismatch`: every part's sum, in order).

        Every rank receives the same sums and waits for all of them, so every rank reads every rank's
        descriptor and decides alike; and data waits for them too (:meth:`_ready`), so no rank sends
        data of a call whose difference lies in a part that came later than its slot's entry.
        """
        if self.mismatch is not None:
            return
        part = t % self._parts
        at = part * len(row)
        self._gathered[at:at + len(row)] = row
        self._differs = self._differs or row != self._expect[at:at + len(row)]
        if self._unseen[part]:
            self._unseen[part] = 0
            self._n_unseen -= 1
        if self._differs and not self._n_unseen:
            self.mismatch = bytes(self._gathered)

    def _receive_pending(self, h: Header, now: float) -> None:
        """Take the switch's answer to a QUERY: the bitmap of workers its slot copy has counted.

        With this worker's bit clear its contribution was lost, and with every bit set the result
        was: either way the contribution goes again (a repeat of a finished sum is answered with
        it). Otherwise a peer's contribution is missing, which that peer's own query tells it: this
        worker sends nothing and waits for the result as if its packet had left now (RACK and the
        resend timer watch it from here, and ask again when either runs out).
        """
        if (h.type, h.worker, h.job, h.generation, h.count) != self._pending:
            self.foreign += 1  # not this run's
            return
        t = (h.chunk - self.first_id) & _U32
        entry = self._outstanding.get(t)
        if entry is None or entry[6] != ASKED or (h.slot, h.copy) != self._slot_copy(t):
            return  # not the answer it waits for
        first = entry[2]
        if not h.key >> self.params.worker & 1 or h.key == self._all:
            # Lost, and so is what went with it: a run (a GSO batch, a queue's overflow) takes the packets
            # sent with this one, whose results have not come either; they go again now, not after a
            # query each (its run, and the packets sent once no later than its first send).
            run = [u for u, e in self._outstanding.items()
                   if u != t and ((not e[1] and e[0] <= first) or (e[6] == ASKED and e[1] and e[2] == first))]
            for u in [t, *run]:
                self.retransmissions += 1
                self._send(u, now, self._outstanding[u][1] or 1)
            return
        # As if sent now: the peer resends now, so the results of what is sent after now reveal a loss
        # (RACK), and the timer backs that up. (Its run keeps its own timers: a packet of it may be one
        # that this worker lost, which its own QUERY then finds.)
        # before the job answered, as a resend waits then: the RTO, backing off (peers may be starting)
        wait = self._resend_wait(entry[1]) if self.started else self.window.timeout_for(entry[1])
        # The switch answered, and a peer is late: this silence is not this worker's path losing runs,
        # so its probes burst no more (its timers and the one-packet probes go on)
        self._bursting = False
        del self._outstanding[t]
        entry[0], entry[3], entry[4], entry[6] = now, self._sends, now + wait, WAITING
        self._outstanding[t] = entry
        self._sends += 1
        heapq.heappush(self._timers, (entry[4], t))

    def _receive(self, h: Header, values: Buffer, now: float) -> bool:
        """Take a RESULT addressed to this worker (``values``: its ``count`` big-endian int32); returns
        whether it was new.

        A reduce-scatter's chunk comes back whole (K values) to its owner alone, and as a header (count
        0) to every other rank, which completes it there: its exponent is the slot's next one. A result
        of one of this call's packets whose owner or count is not the packet's (values for a chunk
        another rank owns, none for one this rank owns) is a switch's error: counted
        (:attr:`protocol_errors`) and ignored, never decoded, so the packet stays outstanding. What it
        teaches the window, and what the window then sends, wait for the batch's end (:meth:`receive_batch`).
        """
        if (h.type, h.worker, h.job, h.generation, h.key) != self._result:
            self.foreign += 1  # not this run's
            return False
        t = (h.chunk - self.first_id) & _U32
        if t not in self._outstanding or (h.slot, h.copy) != self._slot_copy(t):
            return False  # a duplicate, or a stale result
        if (h.flags & FLAG_OWNER, h.owner, h.count) != self._shape(t):
            self.protocol_errors += 1
            return False
        sent, retries, first, order, _, resent, state = self._outstanding.pop(t)
        self._done[t] = 1
        self.n_done += 1
        self._agreed[t] = h.exponent
        if t < self.rounds:
            self._take_call_round(t, bytes(values[:4 * self.params.values_per_packet]))
        elif h.count:  # a sum this rank receives (a reduce-scatter's other chunks come as a header)
            d = t - self.rounds
            prev = self._prev(t)
            self.payloads.decode(d, EXP_NONE if prev is None else self._agreed[prev], values)
        if retries == 0:  # the window learns once the batch is in (receive_batch)
            rtt = now - sent
            self._taken += 1
            # A round trip of the path only where the result neither came later than a later packet's
            # allows (by more than the reorder window: it waited for a lost contribution's resend, its
            # own or a peer's) nor was out while the call went silent (it waited out a lost run, or a
            # stalled peer): such waits are recovery's, and taken for round trips they grew the RTO to
            # its maximum and shrank the window as a queue (in namespaces losing GSO batches whole,
            # calls of 40 ms took 20-40 s).
            if order >= self._quiet_from and (order > self._rack_order
                                              or rtt <= self._rack_rtt + self.window.reorder_window):
                self._longest, self._shortest = max(self._longest, rtt), min(self._shortest, rtt)
                if sent >= self._first_result:
                    self._settled += 1
                    self._settled_shortest = min(self._settled_shortest, rtt)
            if order > self._rack_order:
                self._rack_order, self._rack_rtt = order, rtt
        elif state != WAITING and not self._probes and self.window.is_spurious(now - sent):
            # Sooner than any round trip after the resend: the original's result, a timeout that was early.
            # Not in a silence the call probed: there the original's result was lost (nothing came), and the
            # switch answers a resend of a finished sum from the copy it holds at once, sooner than a round
            # trip that waits for the slowest peer. Taken for the original's, that answer taught a round trip
            # of the whole silence and no RACK: a worker that lost a run of results at a call's tail got
            # them back one probe (and one longer probe timeout) at a time, 40 ms on a call of 28 ms in
            # simulation of the gso bed.
            self.window.undo()
            self.window.on_result(now - first, now, first >= self._first_result)  # the original's true round trip
        else:
            if self.window.min_rtt < math.inf:  # ambiguous (Karn): no round trip, but how long a resent packet
                # waits (before any round trip, what it waited is mostly peers still starting: nothing to learn)
                self.window.on_resend_result(now - resent)
            if state == SENT and self._probes and order > self._rack_order and self._outstanding \
                    and self.window.min_rtt < math.inf:
                # A resent contribution's result that ends a silence (the call probed) marks what left
                # before it and is still out lost, as RACK marks what a later packet's result finds
                # (RFC 8985: not a result that may answer the original, which is_spurious tells once a
                # round trip was measured, which also sizes the reorder window): so a probe's result
                # finds a lost run of any length. What is out may instead have waited for a late or
                # stalled peer, whose results follow this one in the order that peer sends them: they
                # get a probe timeout (two round trips) from now to come, not a window of resends at
                # once. Without a silence a resend's result tells nothing of packets of later chunks
                # sent before it: its chunk completes as soon as it comes, theirs when a peer behind
                # a queue sends them (on links with a rate, taken for losses they were resent 6 times
                # over).
                oldest = self._outstanding[next(iter(self._outstanding))][0]
                self._rack_order = order
                self._rack_rtt = max(now - sent, now - oldest + self.window.probe_timeout)
                if self._bursting:
                    # On a lossy path the probe's result says what went with the probed packet's first send
                    # (its GSO message, its run at the switch's output: the packets sent once no later) was
                    # lost with it; they go again at the batch's end (_resend_run), not a probe timeout each
                    self._run_lost = max(self._run_lost, first)
        self.last_progress = self._probe_from = now
        self._first_result = min(self._first_result, now)
        if self._probes:  # a silence ended: what was resent during it need not wait out its backoff
            due = now + self.window.resend_timeout
            for u, entry in self._outstanding.items():
                if entry[1] and entry[4] > due:
                    self._move_timer(u, entry, due)
        self._probes = 0
        self._stalled = False
        self.started = True
        return True

    def _cap_tail(self) -> None:
        """With at most :data:`EARLY_PROBE` packets out, a packet resent (or asked about) before waits no
        longer from its last send than the tail rule of :meth:`_resend_wait` allows now.

        Its wait was set when more were out, and the results of those reveal no loss once they are
        back: at a call's tail, and also where the schedule is held up by one slot (the next chunk
        waits for a result that this worker lacks, and every peer waits for that chunk) the worker
        that holds it up would otherwise sit out a wait learned behind a full window, backed off,
        while every peer waits on it (in simulation at 5% loss, 7 workers: calls of 2-3 s instead
        of 0.1 s).
        """
        if len(self._outstanding) > EARLY_PROBE:
            return
        for u, entry in self._outstanding.items():
            if entry[1] and (due := entry[0] + self._resend_wait(entry[1])) < entry[4]:
                self._move_timer(u, entry, due)

    def _move_timer(self, t: int, entry: list, due: float) -> None:
        """Packet ``t``'s timer (``entry``'s) runs out at ``due`` instead: its deadline and a heap item of it,
        the one :meth:`_first_timer` takes (the earlier item, now stale, is skipped there)."""
        entry[4] = due
        heapq.heappush(self._timers, (due, t))

    def _first_timer(self) -> tuple[float, int] | None:
        """The live timer that fires first (stale ones, of packets answered, resent or re-timed, are dropped)."""
        while self._timers:
            deadline, t = self._timers[0]
            entry = self._outstanding.get(t)
            if entry is not None and entry[4] == deadline:
                return self._timers[0]
            heapq.heappop(self._timers)
        return None

    def _next_loss(self) -> tuple[int, float, int] | None:
        """The packet to resend next, when, and why (:data:`LOST`, :data:`PROBE` or :data:`TIMEOUT`).

        RACK: results come back in about the order their packets left (every worker sends its
        chunks in order, and a slot completes with its last contribution), so a packet sent before
        one, sent once, whose result came back is lost once its own result is a reorder window
        later than that one's round trip would have it. The outstanding packets are in the order
        they were last sent, so only the oldest needs looking at; a resent packet joins the end, and
        the results of packets sent after it find it lost again. When nothing marks a packet so,
        a call that is silent for :attr:`Window.probe_timeout` resends its oldest packet sent once
        (once per silence; at the tail, with at most :data:`EARLY_PROBE` out, doubling per probe): a
        tail loss probe, for a lost packet with no successor to reveal it (a call's last ones, or a
        run that took all that was out, which the probe's result then finds, RACK). The timers back
        both up: a resent packet's
        is short (:attr:`Window.resend_timeout`), one sent once has the RTO (:meth:`tick`).
        """
        best = None
        if self._outstanding:
            oldest = next(iter(self._outstanding))
            sent, _, _, order, _, _, _ = self._outstanding[oldest]
            if order < self._rack_order:
                best = (oldest, sent + self._rack_rtt + self.window.reorder_window, LOST)
            elif self.started and self._bursting and self._probes:
                # A silence that began on a lossy path (or whose QUERY went unanswered) and outlasted
                # its first probe: bursts (_probe_burst), which alone resend while it lasts
                best = (oldest, self._probe_from + self._burst_wait(), PROBE)
            elif self.started and (not self._probes or len(self._outstanding) <= EARLY_PROBE):
                # Before the job answered, silence means peers are starting. After, it is a lost run
                # with no later packet to reveal it (a call's last packets, or all that is out: a queue
                # that overflowed, or a GSO batch dropped whole) or a late or stalled peer: a probe
                # costs a packet. One per silence, whose own timer then resends it as it backs off; at
                # a call's tail, a probe per doubling wait. The probe is the oldest packet sent once:
                # every peer has sent it if any has, so it completes where this worker's run was lost,
                # and its result, of a send after all that is out, finds the rest of the run (RACK).
                # Where every packet out went again already (a run of results lost after their
                # resends), the oldest, once: their own timers learned their waits behind peers'
                # recoveries, and back off from there.
                probe = next((u for u in self._outstanding if not self._outstanding[u][1]), None)
                if probe is None and not self._probes:
                    probe = oldest
                if probe is not None:
                    best = (probe, self._probe_from + self.window.probe_timeout * 2.0 ** self._probes, PROBE)
        # While a lossy silence's bursts go, they alone resend: they go round all that is out
        timer = None if best is not None and best[2] == PROBE and self._probes and self._bursting \
            else self._first_timer()
        if timer is not None and (best is None or timer[0] < best[1]):
            return timer[1], timer[0], TIMEOUT
        return best

    def next_deadline(self) -> float:
        """When :meth:`tick` has something to do: a retransmission or the progress timeout."""
        stall = self.last_progress + self.progress_timeout
        loss = self._next_loss()
        return stall if loss is None else min(loss[1], stall)

    def tick(self, now: float) -> None:
        """Retransmit what is lost, timed out or probed; raise if progress stopped for too long.

        An RTO that runs out after an RTO of silence resends one packet per silence, the lowest
        chunk out (see ``docs/protocol.md``, section 4).
        """
        if now >= self.last_progress + self.progress_timeout and not self.done:
            raise self._stall_error(now)
        lost = False  # the losses found at one tick are one loss (a run), counted once below
        while (loss := self._next_loss()) is not None and loss[1] <= now:
            t, _, why = loss
            retries = self._outstanding[t][1]
            if why != LOST:  # silence: what is out now waited for it, and tells no round trip
                self._quiet_from = self._sends
            if why == PROBE:  # no sign of loss yet: the window stays
                if not self._probes:
                    self._bursting = self.window.lossy
                if self._bursting:
                    burst, copies = self._probe_burst(t, now)
                    for u in burst:
                        self._resend(u, why, now)
                    # round again as often as it takes: whatever part of the burst the dark run leaves
                    # holds every packet of it
                    self.outbox.extend(self.outbox[-len(burst):] * (copies - 1))
                    self._probes += 1
                    self._probe_from = now
                    continue
                self._probes += 1
                self._probe_from = now
            elif why == LOST or retries:  # random loss, or a resent packet lost again
                lost = True
                # The switch answers every QUERY (a peer that stalls is named in a PENDING): one that
                # went unanswered was lost, as the rest of the silence's sends likelier are too
                self._bursting = self._bursting or (why == TIMEOUT and self._outstanding[t][6] == ASKED)
            else:  # a packet sent once timed out
                entry = self._outstanding[t]
                if entry[0] < self.last_progress and (due := self.last_progress + self.window.rto) > now:
                    # Results still come, of packets sent before it (one sent after it would have found it lost:
                    # RACK): it waits in a queue behind them, not lost. Its timer runs from the last result, as
                    # TCP's restarts with every ACK (RFC 6298, 5.3). Run from its send with the RTO of then, it
                    # fired inside a queue that grew under it (a switch that serves a window's packets one at a
                    # time): in simulation of the gso bed at 10 us a packet, 17k resends in lossless calls.
                    # "Within an RTO" is tested as the new deadline itself, later than now. As last_progress >
                    # now - rto, rounding let a timer that fired at last_progress + rto re-arm at that same now
                    # (0.025 + 0.1 is 0.125, but 0.125 - 0.1 is 0.025 less an ulp), to fire again at once, forever:
                    # a tick that never returned (tests/test_tree.py, the call after the mismatched one, rank 23)
                    self._move_timer(t, entry, due)
                    continue
                if now - self.last_progress >= self.window.rto:
                    # Nothing came for an RTO: peers still on their way to the call, a stall or a
                    # blackout, not so many losses. One packet goes per silence (and again as it
                    # backs off), the others wait another RTO, and RACK once results come again. It
                    # is the lowest chunk out, which every peer that lacks its result also resends:
                    # were each to pick its own, each might wait on one only another resends.
                    lowest = min(self._outstanding)
                    if self._stalled or lowest != t:
                        self._move_timer(t, entry, now + self.window.rto)
                        if self._stalled or self._outstanding[lowest][1]:  # the lowest has its own timer
                            continue
                        t = lowest
                    self._stalled = True
                if self.n_done:  # before a call's first result, silence means peers on their way to it
                    self.window.on_timeout(now)
            self._resend(t, why, now)
        if lost:
            self.window.on_loss()

    def _burst_wait(self) -> float:
        """How long after the last probe of a lossy silence the next one goes: a probe timeout (two
        recent round trips: a burst's results had time to come) while the bursts grow
        (:data:`BURST_STEPS`), then twice the last wait, at most the RTO's maximum. Shorter waits
        (the tail timeout's floor, 2 ms) gained little in simulation, and on a loaded host go before
        the last burst's answers can come; waits of the learned resend timeout (which the dark runs'
        own recoveries stretch) made single calls take seconds in simulation."""
        return min(self.window.max_rto, self.window.probe_timeout * 2.0 ** max(0, self._probes - BURST_STEPS))

    def _probe_burst(self, t: int, now: float) -> tuple[list[int], int]:
        """What a probe of a silence that began on a lossy path resends, and how many times over: its
        first, ``t`` and every packet out whose resend has waited a burst's wait (:meth:`_burst_wait`)
        since, once; each after it ``4 ** probes`` packets (at most ``4 ** BURST_STEPS``), the packets
        out oldest send first, round them again as often as it takes where fewer are out.

        Loss in runs takes more than one packet however far apart they come: a hop gone dark drops
        the next N packets that reach it (a queue that stays full; the loss bench's nftables rule
        counts packets, not time), and in a silence only the probes reach it. This worker's input
        counts only what the switch sends it, an answer per packet it sends (a repeat of a finished
        sum, a QUERY's PENDING), so its own sends must pass the run, the last packets of a call
        again and again. One packet a probe, then the timers backing off, took N silences (on the
        loss bench in runs of 64, 30 s stalls); bursts growing fourfold pass 64 within four probes,
        and their rounds go in turn, so that what the run leaves of a burst holds every packet of
        it. Where the path lost nothing lately a silence is likelier a late or stalled peer, and
        probes one packet (:meth:`_next_loss`).
        """
        if not self._probes:
            due = now - self.window.probe_timeout
            return [t, *(u for u, e in self._outstanding.items() if e[1] and e[0] <= due and u != t)], 1
        order = list(self._outstanding)
        count = 4 ** min(self._probes, BURST_STEPS)
        return order[:count], -(-count // len(order))

    def _resend(self, t: int, why: int, now: float) -> None:
        """Send entry ``t`` again (``why``: LOST, PROBE or TIMEOUT), or ask the switch first where the
        job does, unless it said this worker's contribution is missing (and a lone worker has no one
        else to blame); its old timer goes stale. A job that resends without asking asks too about a
        run found lost at once (:meth:`_run_length`, at least :data:`RUN_ASK` packets)."""
        entry = self._outstanding[t]
        retries = entry[1]
        ask = self.params.n_workers > 1 and not (retries and entry[6] == SENT)
        if ask and why == LOST and not retries:
            # A run found lost at once (sent together, found together) asks one QUERY, whose answer
            # holds for all of it (_receive_pending): not a QUERY and a PENDING a packet of the run.
            run = (now, entry[2])
            if run == self._run_asked:
                self._send(t, now, 1, ASKED, post=False)
                return
            if self.params.ask_first or self._run_length(t) >= RUN_ASK:
                self._run_asked = run
            else:
                ask = False
        elif not self.params.ask_first and (why != PROBE or self._bursting):
            # Resending without asking, a probe of a silence on a path that lost nothing lately asks too: the
            # switch answers every QUERY, so its PENDING tells a late peer (wait) from a lost packet (resend),
            # and no answer at all tells a hop gone dark, whose silence then bursts (tick), as asking first does
            ask = False
        if ask:
            self.queries += 1
            self._send(t, now, retries + 1, ASKED)
            if why == PROBE:
                # A probe's QUERY waits behind whatever queue the call's packets wait in before its silence
                # counts as a lost answer (tick: bursts): a round trip as the path's are now, not the resend
                # timer's few shortest ones. Behind a switch that serves a window's packets one at a time the
                # first result of a call waits for the last peer's first packet, tens of ms: taken for a hop
                # gone dark, the silence burst the window again and again into the queue (in simulation, 7
                # workers, 0.2 ms a packet: a call of 4000 values 11 s and 100k resends)
                entry = self._outstanding[t]
                if (due := now + self.window.queued_rtt) > entry[4]:
                    self._move_timer(t, entry, due)
        else:
            self.retransmissions += 1
            self._send(t, now, retries + 1)

    def _run_length(self, t: int) -> int:
        """How many packets, up to :data:`RUN_ASK`, entry ``t`` (sent once, found lost) heads of a run found lost
        with it: the entries after it sent once, in the same batch (the same send time) and right after it
        (the next orders: no packet between them was answered, so neither was the latest answered, which
        found ``t`` lost: they all come before it, and are found lost at the same time).

        Where the job resends without asking, every worker resends its contribution to a slot that stays
        unfinished, and all but one of them in vain: ``(n - 1)`` packets per packet of a run, which in a
        GSO message lost whole is up to 64, and the switch drops them. A QUERY about the run's first
        costs a round trip and tells the worker whose run it was (and one whose results were lost) to
        resend it, the others to wait (:meth:`_receive_pending`). Loss one packet at a time leaves
        such runs rare (at 5% a hop and 7 workers a third of the slots lack a result, and 8 in a row
        1 in 2,000), and there resending at once costs less than the round trip.
        """
        sent, _, _, order, _, _, _ = self._outstanding[t]
        n = 1
        while n < RUN_ASK and (e := self._outstanding.get(t + n)) is not None and not e[1] and e[0] == sent \
                and e[3] == order + n:
            n += 1
        return n

    def pending(self) -> list[tuple[int, int, int]]:
        """(chunk id, slot, copy) of every outstanding packet, oldest first."""
        return [((self.first_id + t) & _U32, *self._slot_copy(t)) for t in sorted(self._outstanding)]

    def _stall_error(self, now: float) -> Exception:
        return stall_error(self.params, self.pending(), self.n_done, self.total, now - self.last_progress,
                           started=self.started)


Arena = _native.Arena  # the memory of a NativeReduction's per-call arrays, lent to one call at a time


class NativeReduction(_native.Stream):
    """:class:`Reduction` in C, for :class:`~switchagg.payloads.FloatPayloads` and ``Int32Payloads``
    (allreduce and reduce-scatter alike: ``layout``).

    The same constructor and the same interface, less :attr:`Reduction.outbox`: the packets due
    leave only through :meth:`emit`. ``_native.Stream`` holds the state and does the work.

    Two things cross between C and Python once per call, not per batch of packets. The window's state
    lives in C for the call and goes back into ``window`` when the call is over or stalls (reading
    :attr:`window` during a call hands it back then). ``arena`` (an :data:`Arena`, one per client) holds
    the per-call arrays, reused by the next call; without one, or while another call holds it, the
    call allocates its own. A :class:`StagedPayloads` goes as its rows (``staged``): quantized by it, a
    window at a time (:meth:`Reduction.prepare` and the rest are the C stream's too).
    """

    def __init__(self, params: StreamParams, window: Window, payloads, *, n_chunks: int, first_id: int,
                 copies: np.ndarray, now: float, progress_timeout: float, started: bool = False,
                 call: tuple[np.ndarray, bytes] | None = None, layout: Layout | None = None,
                 arena: Arena | None = None) -> None:
        self.params, self._window = params, window
        # floats: the stream proposes each chunk as it sends it (one read of the input, not two)
        proposals = True if getattr(payloads, "stream_proposes", False) else payloads.proposals()
        if call is None and proposals is not None:
            raise ValueError("floats need the call round: it carries their exponents")
        rounds, copy0 = start_call(copies, n_chunks, parts=call_parts(call, params))
        row, expect = (None, None) if call is None else (np.ascontiguousarray(call[0]).tobytes(), call[1])
        staged = isinstance(payloads, StagedPayloads)
        if proposals is not None and proposals is not True:
            proposals = np.ascontiguousarray(proposals, np.int8)
        super().__init__(window, payloads.rows if staged else payloads.flat, payloads.sums if staged else payloads.out,
                         proposals,
                         copy0.astype(np.uint8).tobytes(), params.job, params.worker, params.key, params.generation,
                         params.n_workers, params.values_per_packet, n_chunks, rounds, first_id, now,
                         progress_timeout, started, params.ask_first, row, expect,
                         layout.shard if layout is not None and layout.scatter else -1, arena, staged,
                         params.rank, params.ranks)

    @property
    def window(self) -> Window:
        """The call's window, with what the call has taught it so far (handed back from C now)."""
        self.hand_back()
        return self._window

    def tick(self, now: float) -> None:
        """Retransmit what timed out; raise if progress stopped for too long."""
        if super().tick(now):
            raise stall_error(self.params, self.pending(), self.n_done, self.total, now - self.last_progress,
                              started=self.started)


def call_parts(call: tuple[np.ndarray, bytes] | None, params: StreamParams) -> int:
    """The parts of a call round's values (:func:`switchagg.calls.rows`), checked against the call's ranks
    and K; 0 where there is no call round."""
    if call is None:
        return 0
    k, n_parts = params.values_per_packet, calls.parts(params.ranks, params.values_per_packet)
    if len(call[0]) != n_parts * k or len(call[1]) != 4 * n_parts * k:
        raise ValueError(f"the call round of {params.ranks} ranks at K = {k} is {n_parts} x {k} values and as many "
                         f"expected, not {len(call[0])} and {len(call[1]) // 4}: make it with calls.rows")
    return n_parts


def start_call(copies: np.ndarray, n_chunks: int, *, parts: int = 1,
               first_slot: int = 0) -> tuple[int, np.ndarray]:
    """The call round's size, and each slot's shadow copy at the call's start.

    ``copies[s]`` is the copy of slot ``s``'s next use; it is advanced past this call's uses. Data
    chunk ``d`` uses slot ``(first_slot + d) % len(copies)``. ``parts``: of the call round's values
    (:func:`switchagg.calls.parts`), 0 for no call round.
    """
    s = len(copies)
    rounds = calls.call_rounds(n_chunks, s, parts) if parts else 0
    copy0 = copies.copy()
    # data chunk d uses slot (first_slot + d) % s: each slot q times, the r from first_slot on once more
    # (counted per slot, not per chunk: a 64 MiB call at K = 64 has 262k chunks, and arrays of them cost
    # page faults)
    q, r = divmod(n_chunks, s)
    slot = np.arange(s)
    uses = q + ((slot - first_slot) % s < r) + (slot < rounds)
    copies[:] = (copies + uses) % 2
    return rounds, copy0


def stall_error(params: StreamParams, waiting: list[tuple[int, int, int]], n_done: int, total: int,
                seconds: float, *, started: bool) -> Exception:
    """What a call raises when no result came for the progress timeout; ``waiting`` is its pending()."""
    listed = ", ".join(f"chunk {c} (slot {s}, copy {k})" for c, s, k in waiting[:4])
    more = f" and {len(waiting) - 4} more" if len(waiting) > 4 else ""
    what = (f"worker {params.worker} of job {params.job}: {n_done}/{total} "
            f"packets done, no result for {seconds:.1f} s; waiting for {listed}{more}.")
    if not started:
        return JobNotStarted(
            f"{what} The job never started: check that the switch runs and admits this job "
            f"(`switchagg status`), and that all {params.n_workers} workers started.")
    return StallError(f"{what} A peer stopped or the switch stopped answering.")
