"""The worker's side of the streaming protocol, as sans-I/O state machines.

:class:`Reduction` is one allreduce call: it decides which packet goes out when,
takes the results that come back, and raises when the job never starts or
stops making progress. It owns no socket and reads no clock: the caller feeds
it packets and the current time and sends what it puts in :attr:`Reduction.outbox`,
having :meth:`Reduction.encode` write each packet's values where it will send them from.
:class:`Window` carries the congestion window and the round-trip estimate from
one call to the next.

The schedule (``docs/protocol.md`` has the whole story): a call of ``N`` data
chunks over a job with ``S`` slots first sends an exponent round, one packet per
slot in use (``R = min(S, N)``), that carries each worker's proposed exponent for
the slot's first data chunk. Data chunk ``d`` then goes on slot ``d % S`` with
the agreed (maximum) exponent that came back in the result of the slot's
previous use, and proposes the exponent of chunk ``d + S``. A slot's next use
goes out only when its previous result is back (self-clocking), and at most
``Window.size`` packets are outstanding. int32 reductions skip the exponent round.

:class:`NativeReduction` is the same state machine in C (``switchagg/_stream.c``) for numpy
data, which is what a client runs on the CPU: per packet it costs a fraction of the Python.
Both take datagrams with :meth:`~Reduction.receive_batch` and write the packets due into the
caller's send rows with :meth:`~Reduction.emit`; the tests run each simulated network on both
and require the same bytes at the same times.
"""

from __future__ import annotations

import heapq
import math
from array import array
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from . import _native
from .errors import JobNotStarted, StallError
from .wire import (
    EXP_NONE,
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


class Payloads(Protocol):
    """How a reduction gets its chunks' values and hands back the sums (the codec's side)."""

    def proposals(self) -> np.ndarray | None:
        """The proposed exponent of every data chunk, or None when the values are not floats."""

    def encode(self, chunk: int, exponent: int, out: np.ndarray) -> None:
        """Write data chunk ``chunk`` into ``out`` as K big-endian int32, quantized with ``exponent``."""

    def decode(self, chunk: int, exponent: int, sums: Buffer) -> None:
        """Store the summed data chunk ``chunk`` (quantized with ``exponent``): K big-endian int32."""


LOSS_SHARE = 1 / 8  # losses within a round trip, as a share of the window, that read as congestion
BACKOFF_CAP = 3  # once a call has results, a packet's timeout doubles at most this often
MIN_PROBE = 0.01  # s: the shortest silence after which a call with results probes (Window.probe_timeout)


class WindowState(NamedTuple):
    """Everything a :class:`Window` knows, as one record: what the C stream (``_stream.c``) takes from
    :meth:`Window.state` at a call's start and gives back to :meth:`Window.restore` when it changes."""

    cwnd: float
    ssthresh: float
    min_rto: float
    max_rto: float
    rto: float
    srtt: float | None
    rttvar: float
    recovery_until: float
    cwnd_before_loss: float
    min_rtt: float
    epoch_end: float
    epoch_losses: float
    losses: int
    max_size: int


class Window:
    """AIMD congestion window and a Jacobson/Karels retransmission timeout.

    It lives as long as the client, so a call starts with what the last one learned.
    Slow start doubles the window each round trip until the first congestion; after that
    it grows by one per round trip. Random loss is not congestion: the window halves only
    when more than :data:`LOSS_SHARE` of it (and more than two packets) is lost within one
    round trip, and then at most once per round trip, so a few percent of loss never
    collapses it.
    """

    def __init__(self, max_size: int, *, initial: int = 4, min_rto: float = 0.05,
                 initial_rto: float = 0.1, max_rto: float = 1.0) -> None:
        self.max_size = max_size
        self.cwnd = float(min(initial, max_size))
        self.ssthresh = float(max_size)
        self.min_rto, self.max_rto = min_rto, max_rto
        self.rto = initial_rto
        self.srtt: float | None = None
        self.rttvar = 0.0
        self._recovery_until = -math.inf
        self._cwnd_before_loss = self.cwnd
        self.min_rtt = math.inf
        self.losses = 0
        self._epoch_end = -math.inf  # the round trip whose losses are being counted ends here
        self._epoch_losses = 0

    @property
    def size(self) -> int:
        return max(1, int(self.cwnd))

    def state(self) -> WindowState:
        return WindowState(self.cwnd, self.ssthresh, self.min_rto, self.max_rto, self.rto, self.srtt, self.rttvar,
                           self._recovery_until, self._cwnd_before_loss, self.min_rtt, self._epoch_end,
                           self._epoch_losses, self.losses, self.max_size)

    def restore(self, state: WindowState | tuple) -> None:
        (self.cwnd, self.ssthresh, self.min_rto, self.max_rto, self.rto, self.srtt, self.rttvar, self._recovery_until,
         self._cwnd_before_loss, self.min_rtt, self._epoch_end, self._epoch_losses, self.losses,
         self.max_size) = state

    def on_result(self, rtt: float) -> None:
        """A new result ``rtt`` seconds after its packet was (last) sent: learn and grow."""
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.min_rtt = min(self.min_rtt, rtt)
        # At least 1.5 round trips: a result also waits for the slowest peer's packet.
        self.rto = min(self.max_rto, max(self.min_rto, self.srtt + max(4 * self.rttvar, self.srtt / 2)))
        growth = 1.0 if self.cwnd < self.ssthresh else 1.0 / self.cwnd
        self.cwnd = min(float(self.max_size), self.cwnd + growth)

    def is_spurious(self, since_last_send: float) -> bool:
        """A result sooner after a retransmission than any round trip answers the original: the timeout was early.

        No real loss then, only a peer that was slow (on a busy host, one descheduled
        for a few milliseconds): :meth:`undo` takes the window reduction back.
        """
        return since_last_send < self.min_rtt

    def undo(self) -> None:
        self.cwnd = max(self.cwnd, self._cwnd_before_loss)
        self.ssthresh = max(self.ssthresh, self._cwnd_before_loss)

    @property
    def probe_timeout(self) -> float:
        """Silence, after a result, that makes a call resend its oldest packet (a tail loss probe):
        two smoothed round trips, at least :data:`MIN_PROBE`."""
        return max(MIN_PROBE, 2 * (self.srtt or self.rto))

    @property
    def reorder_window(self) -> float:
        """How much later a packet must have been sent than one whose result is back, for its own
        missing result to mean it was lost: a quarter of the shortest round trip (RACK)."""
        return self.min_rtt / 4

    def on_timeout(self, now: float) -> None:
        """A packet was lost (its timer fired, or later packets' results came first).

        Counted; the window halves only when the round trip's losses exceed :data:`LOSS_SHARE`
        of it, once per round trip.
        """
        self.losses += 1
        if now >= self._epoch_end:
            self._epoch_end = now + (self.srtt or self.rto)
            self._epoch_losses = 0
        self._epoch_losses += 1
        if now < self._recovery_until or self._epoch_losses <= max(2.0, self.cwnd * LOSS_SHARE):
            return
        self._cwnd_before_loss = self.cwnd
        self.ssthresh = max(1.0, self.cwnd / 2)
        self.cwnd = self.ssthresh
        self._recovery_until = now + (self.srtt or self.rto)

    def timeout_for(self, retries: int) -> float:
        """Exponential backoff of the timeout for a packet sent ``retries`` times before."""
        return min(self.max_rto, self.rto * 2.0 ** retries)


class Send(NamedTuple):
    """A packet to send: its header, and what :meth:`Reduction.encode` turns into its values.

    The values are written only when the packet goes out, straight into the
    buffer it is sent from, so a call of any size allocates nothing per packet.
    """

    header: Header
    data_chunk: int  # the chunk of the tensor it carries; -1 in the exponent round (zeros)
    exponent: int  # the agreed exponent its values are quantized with


class Reduction:
    """One allreduce call over the switch (see the module docstring for the schedule)."""

    def __init__(self, params: StreamParams, window: Window, payloads: Payloads, *,
                 n_chunks: int, first_id: int, copies: np.ndarray, now: float,
                 progress_timeout: float, started: bool = False) -> None:
        """``copies[s]`` is the shadow copy of slot ``s``'s next use; this call advances it.

        ``progress_timeout`` is how long the call waits for a first result and then
        for each further one before it raises: :class:`JobNotStarted` if the job never
        produced a result (``started`` says whether an earlier call did), else
        :class:`StallError`.
        """
        self.params, self.window, self.payloads = params, window, payloads
        self.n_chunks, self.first_id = n_chunks, first_id
        proposals = payloads.proposals()
        # Per-packet state in compact arrays of Python ints: numpy scalars cost more per access.
        self._proposals = None if proposals is None else array("b", proposals.astype(np.int8).tobytes())
        self.rounds, copy0 = start_call(copies, n_chunks, floats=proposals is not None)
        self.total = self.rounds + n_chunks
        self._copy0 = copy0.tolist()
        self._agreed = array("b", [EXP_NONE]) * self.total  # the exponent each result carried
        self._result = (PacketType.RESULT, params.worker, params.job, params.generation, params.key,
                        params.values_per_packet)  # what a RESULT for this call carries
        self._done = bytearray(self.total)
        self.n_done = 0
        self._next = 0
        self._outstanding: dict[int, list[float]] = {}  # t -> [last send, retries, first send]
        self._timers: list[tuple[float, int, int]] = []  # (deadline, t, retries) with lazy removal
        self.outbox: list[Send] = []
        self.last_progress = now
        self.progress_timeout = progress_timeout
        self.started = started
        self.retransmissions = 0
        self._answered_sent = -math.inf  # the latest send of a packet, sent once, whose result came back
        self._probes = 0  # tail loss probes sent since the last new result
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
        prev = self._prev(t)
        return prev is None or bool(self._done[prev])

    def _slot_copy(self, t: int) -> tuple[int, int]:
        """The slot and shadow copy that entry ``t`` uses: each use of a slot flips its copy."""
        if t < self.rounds:
            return t, self._copy0[t]
        d = t - self.rounds
        slot = d % self.params.slot_count
        use = d // self.params.slot_count + (slot < self.rounds)
        return slot, (self._copy0[slot] + use) & 1

    def _packet(self, t: int) -> Send:
        p = self.params
        if t < self.rounds:
            data_chunk, exponent_used, proposal = -1, EXP_NONE, self._proposals[t]
        else:
            data_chunk = t - self.rounds
            prev = self._prev(t)
            exponent_used = EXP_NONE if prev is None else self._agreed[prev]
            nxt = data_chunk + p.slot_count
            proposal = self._proposals[nxt] if self._proposals is not None and nxt < self.n_chunks else EXP_NONE
        slot, copy = self._slot_copy(t)
        header = make_header(PacketType.CONTRIB, job=p.job, worker=p.worker, slot=slot, copy=copy,
                             chunk=(self.first_id + t) & _U32, generation=p.generation, key=p.key,
                             exponent=proposal, count=p.values_per_packet)
        return Send(header, data_chunk, exponent_used)

    def encode(self, send: Send, out: np.ndarray) -> None:
        """Write ``send``'s K values into ``out`` (big-endian int32), e.g. the row it is sent from."""
        if send.data_chunk < 0:
            out[:] = 0
        else:
            self.payloads.encode(send.data_chunk, send.exponent, out)

    def emit(self, rows: np.ndarray) -> int:
        """Write the packets due, oldest first, into ``rows`` (uint8, a packet per row); returns how many."""
        n = min(len(self.outbox), len(rows))
        end = HEADER_SIZE + 4 * self.params.values_per_packet
        for row, send in zip(rows, self.outbox[:n], strict=False):
            HEADER_STRUCT.pack_into(row, 0, *send.header)
            self.encode(send, row[HEADER_SIZE:end].view(VALUE_DTYPE))
        del self.outbox[:n]
        return n

    def _send(self, t: int, now: float, retries: int) -> None:
        self.outbox.append(self._packet(t))
        first = self._outstanding.pop(t)[2] if retries else now
        self._outstanding[t] = [now, retries, first]  # at the end: the dict is in order of last send
        # Full backoff while the job has not answered yet (peers may still be starting); after, a
        # bounded one, so that a packet lost twice is not left waiting for a second on a live job.
        backoff = min(retries, BACKOFF_CAP) if self.n_done else retries
        heapq.heappush(self._timers, (now + self.window.timeout_for(backoff), t, retries))

    def _fill(self, now: float) -> None:
        while (self._next < self.total and len(self._outstanding) < self.window.size
               and self._ready(self._next)):
            self._send(self._next, now, 0)
            self._next += 1

    # ---- inputs ----------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.n_done == self.total

    def receive_batch(self, buf: Buffer, offsets: np.ndarray, lengths: np.ndarray, now: float) -> int:
        """Take the datagrams received at ``now``: datagram i is ``lengths[i]`` bytes at ``buf[offsets[i]:]``.

        Whatever is not a RESULT for this call is ignored; returns how many were new.
        """
        view = memoryview(buf).cast("B")
        fresh = 0
        for at, length in zip(offsets.tolist(), lengths.tolist(), strict=False):
            data = view[at:at + length]
            if length < HEADER_SIZE:
                continue
            h = unpack_header(data)
            if h.type == PacketType.RESULT and length == HEADER_SIZE + 4 * h.count:
                fresh += self.receive(h, data[HEADER_SIZE:], now)
        return fresh

    def receive(self, h: Header, values: Buffer, now: float) -> bool:
        """Take a RESULT addressed to this worker (``values``: its K big-endian int32); returns whether it was new."""
        t = (h.chunk - self.first_id) & _U32
        if ((h.type, h.worker, h.job, h.generation, h.key, h.count) != self._result
                or t not in self._outstanding or (h.slot, h.copy) != self._slot_copy(t)):
            return False  # a duplicate, a stale result, or not ours
        sent, retries, first = self._outstanding.pop(t)
        self._done[t] = 1
        self.n_done += 1
        self._agreed[t] = h.exponent
        if t >= self.rounds:
            d = t - self.rounds
            prev = self._prev(t)
            self.payloads.decode(d, EXP_NONE if prev is None else self._agreed[prev], values)
        if retries == 0:
            self.window.on_result(now - sent)
            self._answered_sent = max(self._answered_sent, sent)
        elif self.window.is_spurious(now - sent):
            self.window.undo()
            self.window.on_result(now - first)  # the original's true round trip
        # else: ambiguous (Karn): learn nothing from it
        self.last_progress = now
        self._probes = 0
        self.started = True
        self._fill(now)
        return True

    def _first_timer(self) -> tuple[float, int, int] | None:
        """The live timer that fires first (stale ones, of packets answered or resent, are dropped)."""
        while self._timers:
            deadline, t, retries = self._timers[0]
            entry = self._outstanding.get(t)
            if entry is not None and entry[1] == retries:
                return self._timers[0]
            heapq.heappop(self._timers)
        return None

    def _next_loss(self) -> tuple[int, float, bool] | None:
        """The packet to resend next, when, and whether as a probe.

        The oldest sent, at once, when a packet sent a reorder window after it has its result
        back: it was lost (RACK). Else the earlier of its probe (once the call has results and
        then fell silent for :attr:`Window.probe_timeout`, doubling per probe: a lost packet with
        no successor to reveal it, at a call's tail or behind a full window, is resent without
        waiting out the RTO, one packet at a time) and the first timer's deadline.
        """
        probe = None
        if self._outstanding:
            oldest = next(iter(self._outstanding))
            if self._outstanding[oldest][0] + self.window.reorder_window <= self._answered_sent:
                return oldest, self._answered_sent, False
            if self.n_done:
                probe = (oldest, self.last_progress + self.window.probe_timeout * 2.0 ** self._probes, True)
        timer = self._first_timer()
        if timer is not None and (probe is None or timer[0] <= probe[1]):
            return timer[1], timer[0], False
        return probe

    def next_deadline(self) -> float:
        """When :meth:`tick` has something to do: a retransmission or the progress timeout."""
        stall = self.last_progress + self.progress_timeout
        loss = self._next_loss()
        return stall if loss is None else min(loss[1], stall)

    def tick(self, now: float) -> None:
        """Retransmit what is lost, timed out or probed; raise if progress stopped for too long."""
        if now - self.last_progress >= self.progress_timeout and not self.done:
            raise self._stall_error(now)
        while (loss := self._next_loss()) is not None and loss[1] <= now:
            t, _, probe = loss
            self._probes += probe
            if self.n_done:  # before a call's first result, silence means peers still on their way to it
                self.window.on_timeout(now)
            self.retransmissions += 1
            self._send(t, now, self._outstanding[t][1] + 1)  # its old timer goes stale

    def pending(self) -> list[tuple[int, int, int]]:
        """(chunk id, slot, copy) of every outstanding packet, oldest first."""
        return [((self.first_id + t) & _U32, *self._slot_copy(t)) for t in sorted(self._outstanding)]

    def _stall_error(self, now: float) -> Exception:
        return stall_error(self.params, self.pending(), self.n_done, self.total, now - self.last_progress,
                           started=self.started)


class NativeReduction(_native.Stream):
    """:class:`Reduction` in C, for :class:`~switchagg.payloads.FloatPayloads` and ``Int32Payloads``.

    The same constructor and the same interface, less :attr:`Reduction.outbox`: the packets due
    leave only through :meth:`emit`. ``_native.Stream`` holds the state and does the work.
    """

    def __init__(self, params: StreamParams, window: Window, payloads, *, n_chunks: int, first_id: int,
                 copies: np.ndarray, now: float, progress_timeout: float, started: bool = False) -> None:
        self.params, self.window = params, window
        proposals = payloads.proposals()
        rounds, copy0 = start_call(copies, n_chunks, floats=proposals is not None)
        super().__init__(window, payloads.flat, payloads.out,
                         None if proposals is None else proposals.astype(np.int8).tobytes(),
                         copy0.astype(np.uint8).tobytes(), params.job, params.worker, params.key, params.generation,
                         params.n_workers, params.values_per_packet, n_chunks, rounds, first_id, now,
                         progress_timeout, started)

    def tick(self, now: float) -> None:
        """Retransmit what timed out; raise if progress stopped for too long."""
        if super().tick(now):
            raise stall_error(self.params, self.pending(), self.n_done, self.total, now - self.last_progress,
                              started=self.started)


def start_call(copies: np.ndarray, n_chunks: int, *, floats: bool) -> tuple[int, np.ndarray]:
    """The exponent round's size, and each slot's shadow copy at the call's start.

    ``copies[s]`` is the copy of slot ``s``'s next use; it is advanced past this call's uses.
    """
    s = len(copies)
    rounds = min(s, n_chunks) if floats else 0
    copy0 = copies.copy()
    uses = np.bincount(np.arange(n_chunks) % s, minlength=s) + (np.arange(s) < rounds)
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
            f"(`switchagg status`), that all {params.n_workers} workers started, and that the "
            f"job's generation is current (a job that ran before needs `switchagg reset`).")
    return StallError(f"{what} A peer stopped or the switch stopped answering.")
