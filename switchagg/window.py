"""The congestion window and the timers' estimates that a worker carries from one call to the next.

A :class:`Window` lives as long as its client: each call (:class:`~switchagg.protocol.Reduction`, or
the C stream behind :class:`~switchagg.protocol.NativeReduction`) starts with what the calls before it
learned about the path (round trips, the queue it stands, losses) and leaves what it learned. It is
its own module because two state machines share it: the Python one calls its methods, and the C one
takes its :class:`WindowState` at a call's start and gives it back once, at the call's end
(``_stream.c`` has the same arithmetic; ``tests/test_protocol.py`` holds the constants and the
fields to it). Sans-I/O: it is fed round trips and the time, and reads no clock.
"""

from __future__ import annotations

import math
from typing import NamedTuple

LOSS_SHARE = 1 / 8  # packets sent once whose timers ran out within a round trip, as a share of the window: congestion
QUEUE_LIMIT = 0.032  # s: the most queueing (round trip over the shortest ever seen) the window stands
LOSS_QUEUE = 0.0004  # s: on a lossy path, the queueing it stands times the share of packets lost
DELAY_SAMPLES = 4  # results, at least, whose shortest round trip judges the queue
DELAY_BETA = 0.8  # the window backs off by this share of the round trip queued beyond what it stands
MIN_RESEND = 0.002  # s: the least a resent packet waits for its result (Window.resend_timeout)
TAIL_RTTS = 4  # shortest round trips, the most a packet resent at a call's tail waits (Window.tail_timeout)
RESEND_DEVIATIONS = 3  # a resent packet waits the smoothed wait of those before it and this many deviations
MIN_PROBE = 0.01  # s: the shortest silence after which a call probes (Window.probe_timeout)
MIN_PROBE_LOSSY = 0.003  # s: the same on a path that lost a packet in its last LOSSY_RESULTS results
LOSSY_RESULTS = 1024  # results after a loss during which the path counts as losing packets (Window.lossy)


class WindowState(NamedTuple):
    """Everything a :class:`Window` knows, as one record: what the C stream (``_stream.c``) takes from
    :meth:`Window.state` at a call's start and gives back to :meth:`Window.restore` once the call is over
    or stalled (or when Python reads the call's window), not after every batch of packets."""

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
    delay_until: float
    delay_min: float
    delay_samples: int
    losses_seen: int
    since_loss: int
    recent_rtt: float
    resend_wait: float
    resend_dev: float
    losses: int
    max_size: int


class Window:
    """The congestion window and the timers' estimates, carried from one call to the next.

    It lives as long as the client, so a call starts with what the last one learned.
    Slow start doubles the window each round trip until the first congestion; after that
    it grows by one per round trip. Random loss is not congestion, a queue is: once per round
    trip, when even its shortest round trip shows more queueing than the window stands, it
    backs off by that excess's share (at most half). It stands :data:`QUEUE_LIMIT` of queue
    (a busy host's batches: a larger window costs less CPU per packet), and on a lossy path
    less, :data:`LOSS_QUEUE` over the share of packets lost, since every loss recovery waits
    behind the queue. It also halves when more than :data:`LOSS_SHARE` of it times out within
    a round trip (a burst, not the scattered losses that RACK finds, which leave it alone).
    So a few percent of loss never collapses it.

    Three waits come from it: the RTO of a packet sent once (Jacobson/Karels, at least
    ``min_rto``), :attr:`resend_timeout` for a packet resent, and :attr:`probe_timeout`.
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
        self._epoch_end = -math.inf  # the round trip whose timeouts are being counted ends here
        self._epoch_losses = 0
        self._delay_until = -math.inf  # the round trip whose shortest round trip is being taken ends here
        self._delay_min = math.inf
        self._delay_samples = 0
        self._losses_seen = 0  # losses counted when the last round trip's queue was judged
        self.since_loss = LOSSY_RESULTS  # results since the last loss, counted up to LOSSY_RESULTS
        self.recent_rtt = math.inf  # the shortest round trip of recent ones (fast down, slowly up)
        self.resend_wait = math.inf  # from a packet's first resend to its result, smoothed
        self.resend_dev = 0.0  # and its mean deviation

    @property
    def size(self) -> int:
        return max(1, int(self.cwnd))

    def state(self) -> WindowState:
        return WindowState(self.cwnd, self.ssthresh, self.min_rto, self.max_rto, self.rto, self.srtt, self.rttvar,
                           self._recovery_until, self._cwnd_before_loss, self.min_rtt, self._epoch_end,
                           self._epoch_losses, self._delay_until, self._delay_min, self._delay_samples,
                           self._losses_seen, self.since_loss, self.recent_rtt, self.resend_wait, self.resend_dev,
                           self.losses, self.max_size)

    def restore(self, state: WindowState | tuple) -> None:
        (self.cwnd, self.ssthresh, self.min_rto, self.max_rto, self.rto, self.srtt, self.rttvar, self._recovery_until,
         self._cwnd_before_loss, self.min_rtt, self._epoch_end, self._epoch_losses, self._delay_until,
         self._delay_min, self._delay_samples, self._losses_seen, self.since_loss, self.recent_rtt, self.resend_wait,
         self.resend_dev, self.losses, self.max_size) = state

    def on_result(self, rtt: float, now: float, settled: bool = True) -> None:
        """A result ``rtt`` seconds after its packet's one send, at ``now``: :meth:`on_results` of one.

        ``settled``: the packet left after its call's first result, so its round trip holds no wait
        for peers still on their way to the call; only those round trips tell of a queue.
        """
        self.on_results(now, 1, rtt, rtt, int(settled), rtt)

    def on_results(self, now: float, count: int, longest: float, shortest: float, settled: int,
                   settled_shortest: float) -> None:
        """``count`` results taken together at ``now`` (a receive batch, as TCP takes an ACK of many
        segments), of packets sent once: learn once, and grow the window as much as ``count`` results
        grow it, or shrink it when even the shortest round trip of the last one shows more queue than
        it stands.

        ``longest`` (the oldest send's round trip, TCP's sample; -inf where none of them is a round
        trip of the path, every one having waited for a recovery) is the RTO's one sample: a batch's
        results mostly left together, and one sample per packet would turn the smoothed round trip
        into the last few packets' (RFC 7323's appendix G) at a cost per packet. ``shortest`` is the
        path's; ``settled`` of the results are of packets that left after their call's first result,
        so their round trips hold no wait for peers still on their way to the call, and only those
        (the shortest of them ``settled_shortest``) tell of a queue.
        """
        if longest >= 0:  # a round trip of the path among them (-inf: none, they waited for a recovery)
            if self.srtt is None:
                self.srtt, self.rttvar = longest, longest / 2
            else:
                self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - longest)
                self.srtt = 0.875 * self.srtt + 0.125 * longest
            self.min_rtt = min(self.min_rtt, shortest)
            # At least 1.5 round trips: a result also waits for the slowest peer's packet.
            self.rto = min(self.max_rto, max(self.min_rto, self.srtt + max(4 * self.rttvar, self.srtt / 2)))
        self.since_loss = min(self.since_loss + count, LOSSY_RESULTS)
        if settled:
            if not self._delay_samples:  # a round trip's results are taken from the first one on, for two
                # recent round trips: after a peer's stall, the burst of late results that ends it and
                # the results of what left after it, not only the burst
                self._delay_until = now + 2 * min(settled_shortest, self.recent_rtt)
            self._delay_min = min(self._delay_min, settled_shortest)
            self._delay_samples += settled
            if self._delay_samples >= DELAY_SAMPLES and now >= self._delay_until:
                # Its shortest round trip is the queue's (a result that waited for a peer, stalled or
                # resending a lost contribution, is never the shortest of many).
                low = self._delay_min
                self.recent_rtt = low if low < self.recent_rtt else 0.875 * self.recent_rtt + 0.125 * low
                lost = self.losses - self._losses_seen  # the queue it stands: less, the more it loses
                stood = min(QUEUE_LIMIT, LOSS_QUEUE * (lost + self._delay_samples) / lost) if lost else QUEUE_LIMIT
                self._delay_min, self._delay_samples, self._losses_seen = math.inf, 0, self.losses
                queue = low - self.min_rtt - stood
                if queue > 0:
                    self.cwnd = max(1.0, self.cwnd * max(0.5, 1 - DELAY_BETA * queue / low))
                    self.ssthresh = self.cwnd
                    return
        # +1 a result in slow start, up to ssthresh, and 1/cwnd a result after (as Linux's Reno
        # takes an ACK's count of segments)
        if self.cwnd < self.ssthresh:
            steps = min(count, math.ceil(self.ssthresh - self.cwnd))
            self.cwnd += steps
            count -= steps
        if count:
            self.cwnd += count / self.cwnd
        self.cwnd = min(float(self.max_size), self.cwnd)

    def on_resend_result(self, wait: float) -> None:
        """A resent packet's result came ``wait`` seconds after its first resend (which may have had to
        wait for a peer to resend its own contribution too)."""
        # one long stall must not stretch the next many waits
        wait = min(wait, 2 * (self.probe_timeout if self.resend_wait == math.inf else self.resend_wait))
        if self.resend_wait == math.inf:
            self.resend_wait, self.resend_dev = wait, wait / 2
            return
        self.resend_dev = 0.75 * self.resend_dev + 0.25 * abs(self.resend_wait - wait)
        self.resend_wait = 0.875 * self.resend_wait + 0.125 * wait

    def is_spurious(self, since_last_send: float) -> bool:
        """A result sooner after a retransmission than any round trip answers the original: the timeout was early.

        No real loss then, only a peer that was slow (on a busy host, one descheduled
        for a few milliseconds): :meth:`undo` takes the window reduction back. Before any round
        trip was measured nothing tells (Karn): the result may answer the retransmission, and
        taking the original's wait, a whole RTO, for a round trip made every timer of the job's
        first calls four times that (in simulation at 5% loss, calls of 0.1 s took 0.4 s).
        """
        return since_last_send < self.min_rtt < math.inf

    def undo(self) -> None:
        self.cwnd = max(self.cwnd, self._cwnd_before_loss)
        self.ssthresh = max(self.ssthresh, self._cwnd_before_loss)

    @property
    def probe_timeout(self) -> float:
        """Silence that makes a call probe (resend its newest packet sent once): two recent shortest
        round trips (before any, two smoothed ones), at least :data:`MIN_PROBE`, or
        :data:`MIN_PROBE_LOSSY` on a path that is losing packets (silence is likelier loss there)."""
        rtt = self.recent_rtt if self.recent_rtt < math.inf else self.min_rtt if self.min_rtt < math.inf else 0.0
        return max(MIN_PROBE_LOSSY if self.lossy else MIN_PROBE, 2 * rtt)

    @property
    def resend_timeout(self) -> float:
        """How long a resent packet waits for its result before it is resent again (doubling each time):
        the smoothed wait of those before it and :data:`RESEND_DEVIATIONS` deviations, at least
        :data:`MIN_RESEND` and a recent shortest round trip; before any, :attr:`probe_timeout`. Only
        the packets resent are resent again when it runs out, never a window, so it can be short."""
        if self.resend_wait == math.inf:
            return self.probe_timeout
        floor = max(MIN_RESEND, self.recent_rtt if self.recent_rtt < math.inf else 0.0)
        return max(floor, self.resend_wait + RESEND_DEVIATIONS * self.resend_dev)

    @property
    def tail_timeout(self) -> float:
        """The most a packet resent with at most :data:`EARLY_PROBE` packets out waits (before backoff):
        :data:`TAIL_RTTS` shortest round trips, at least :data:`MIN_RESEND`. :attr:`resend_timeout`
        learns its waits behind a window's queue, and at a call's tail that queue has drained: there
        a wait as long (tens of ms with backoff) held every peer's next call up too."""
        return max(MIN_RESEND, TAIL_RTTS * self.min_rtt)

    @property
    def queued_rtt(self) -> float:
        """A round trip as long as the path's are now, queue and all: the smoothed round trip and four deviations
        (0 before any). What an answer that the switch always sends (a QUERY's PENDING) may take before its
        silence says it was lost; the other waits learn the shortest round trips, which leave the queue out."""
        return 0.0 if self.srtt is None else self.srtt + 4 * self.rttvar

    @property
    def reorder_window(self) -> float:
        """How much later than expected a packet's result may come, after a later packet's, before it
        counts as lost: a quarter of the shortest round trip (RACK)."""
        return self.min_rtt / 4

    @property
    def lossy(self) -> bool:
        """Whether the path lost a packet within its last :data:`LOSSY_RESULTS` results. A memory of
        many round trips, not the last one's: at 1% loss most round trips of a short call lose
        nothing, and judged by the last one alone, a short call's lost tail waited out the lossless
        floor (in simulation, 7 workers at 1% a hop: calls of 127 and 509 values took 11 ms, not 0.4)."""
        return self.since_loss < LOSSY_RESULTS

    def on_loss(self) -> None:
        """A packet found lost by RACK, or a resent one lost again: counted; random loss, so the window stays."""
        self.losses += 1
        self.since_loss = 0

    def on_timeout(self, now: float) -> None:
        """The timer of a packet sent once ran out: nothing else found it lost.

        Counted; the window halves only when the round trip's timeouts exceed :data:`LOSS_SHARE`
        of it, and then not again for an RTO: every packet out at the cut times out within one,
        so the cut answers them all. (Once per round trip, a burst of timeouts of packets that
        had waited behind a long queue halved a window of 256 eight times over in 25 ms, in
        simulation at 5% loss, and the worker with a window of one held up its peers.)
        """
        self.losses += 1
        self.since_loss = 0
        if now >= self._epoch_end:
            self._epoch_end = now + (self.srtt or self.rto)
            self._epoch_losses = 0
        self._epoch_losses += 1
        if now < self._recovery_until or self._epoch_losses <= max(2.0, self.cwnd * LOSS_SHARE):
            return
        self._cwnd_before_loss = self.cwnd
        self.ssthresh = max(1.0, self.cwnd / 2)
        self.cwnd = self.ssthresh
        self._recovery_until = now + self.rto

    def timeout_for(self, retries: int) -> float:
        """Exponential backoff of the timeout for a packet sent ``retries`` times before."""
        return min(self.max_rto, self.rto * 2.0 ** retries)

