"""A simulated network for the sans-I/O worker protocol and the switch model.

Workers (:class:`Reduction`) and a :class:`SwitchModel` exchange real packet
bytes over links that lose, duplicate and reorder (random latency), both
directions, on a virtual clock. No sockets, no sleeping: seeded and repeatable.
A tree (:func:`tree`) is several switches, leaves and a spine, whose links to one another lose as a
worker's do: ``up`` carries what goes towards the root, ``down`` what comes back.

By default a worker takes each datagram alone the moment it arrives. With :class:`Batching` it takes
what the kernel would hand its loop (``_udp.drive``): it wakes a little after a datagram arrives, and
takes what came meanwhile as one receive batch of recvmmsg messages, each a GRO run of consecutive
datagrams of one size, laid out in a receive buffer that keeps the bytes of earlier batches.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from switchagg import calls
from switchagg.jobs import Uplink
from switchagg.payloads import FloatPayloads, Int32Payloads
from switchagg.protocol import Arena, NativeReduction, Reduction, StagedPayloads, StreamParams
from switchagg.switch.model import JobEntry, SwitchModel
from switchagg.window import Window
from switchagg.wire import UDP_PORT, PacketType, datagram_size

IMPLEMENTATIONS = {"python": Reduction, "native": NativeReduction}
WAKE = "wake"  # an event's source that is a worker's wake to take its inbox (Batching), not a datagram
SWITCH = "switch"  # the one switch's address, where a net has one
UP = (PacketType.CONTRIB, PacketType.QUERY, PacketType.PROBE)  # what a switch sends towards the root
RUN_SPAN = 0.0002  # s: a lost run takes the packets of a link that follow within this long (a queue's overflow)


class Queued(NamedTuple):
    """An event's source that is a datagram from ``src`` that waited in a switch's queue (SimNet.service)."""

    src: object


@dataclass
class Impairment:
    loss: float = 0.0
    dup: float = 0.0
    latency: float = 0.001
    jitter: float = 0.0  # uniform extra latency: reordering when it exceeds the packet spacing
    # a loss takes this many consecutive packets of the link (one sender to one receiver), as a queue that
    # overflows or a GSO super-packet dropped whole does; ``loss`` stays the share of packets lost
    run: int = 1
    # the packets a worker sends at once go as one message (GSO: one super-packet, up to 64 datagrams) that a
    # loss takes whole: ``loss`` is then the share of messages lost
    whole: bool = False
    # a loss darkens the hop the link leads to: it then drops the next ``dark`` packets that reach it, from every
    # sender, however far apart they come (a count, not a time: the loss bench's nftables rule, ``numgen inc``, at
    # each hop's input); ``loss`` stays the share of packets lost
    dark: int = 0


@dataclass
class Batching:
    """How a worker's receives batch, as the kernel's: a wake lags the first datagram waiting by up to
    ``wake`` seconds (poll's return and the scheduler), and takes at most ``messages`` messages
    (recvmmsg's vector), each a GRO run of at most ``segments`` datagrams; each run's cap is drawn anew,
    so batches and runs come in every size from one datagram up."""

    wake: float = 0.002
    messages: int = 4
    segments: int = 8


@dataclass
class Job:
    job_id: int = 1
    n: int = 4
    slots: int = 8
    k: int = 16
    key: int = 0xABCD
    generation: int = 7
    slot_base: int = 0
    ask_first: bool = False  # job.loss_recovery = "query"
    # a leaf of a tree: the tree's ranks (0: a flat job), the first under this leaf, and where its partials go
    tree_size: int = 0
    rank_base: int = 0
    parent: Uplink | None = None

    def entry(self) -> JobEntry:
        return JobEntry(self.job_id, self.generation, self.key, self.slot_base, self.slots, self.k,
                        tuple(self.address(r) for r in range(self.n)), self.parent, (), self.rank_base,
                        self.tree_size)

    def address(self, rank: int) -> tuple[str, int]:
        return (f"10.0.{self.job_id}.{rank + 1}", 40000 + rank)

    @property
    def ranks(self) -> int:
        """The call's ranks: the tree's, or this job's workers."""
        return self.tree_size or self.n

    def rank(self, worker: int) -> int:
        """Worker ``worker``'s rank in the call (its tree rank in a tree)."""
        return self.rank_base + worker

    def params(self, rank: int) -> StreamParams:
        tree = (self.rank(rank), self.tree_size) if self.tree_size else (None, None)
        return StreamParams(self.job_id, rank, self.key, self.generation, self.n, self.slots, self.k, self.ask_first,
                            *tree)


@dataclass
class Tree:
    """A tree's switches and jobs (:func:`tree`): every leaf's job, and the spine's entry."""

    spine: tuple[str, int]
    leaves: list[tuple[str, int]]
    jobs: list[Job]
    spine_entry: JobEntry


def tree(switches: dict, leaves: int, per_leaf: int, *, spine_job: int = 100, first_leaf_job: int = 1, k: int = 64,
         slots: int = 8, key: int = 0xABCD, generation: int = 7, slot_base: int = 0, ask_first: bool = False,
         spine: tuple[str, int] = ("10.1.0.1", UDP_PORT), leaf_net: int = 1) -> Tree:
    """A two-level tree of ``leaves`` x ``per_leaf`` workers installed on ``switches`` (address -> SwitchModel,
    made where missing): a spine at ``spine`` whose job ``spine_job`` counts the leaves, and leaf ``l`` at
    10.``leaf_net + 1``.``l``.1 holding job ``first_leaf_job + l`` over its workers, tree ranks leaf-major.
    Another tree on the same ``spine`` (another ``spine_job`` and ``slot_base``) shares it."""
    ranks = leaves * per_leaf
    at = [(f"10.{leaf_net + 1}.{leaf}.1", UDP_PORT) for leaf in range(leaves)]
    jobs = [Job(first_leaf_job + leaf, per_leaf, slots, k, key, generation, slot_base, ask_first, ranks,
                leaf * per_leaf, Uplink(spine, spine_job, leaf, key ^ 0xFFFF)) for leaf in range(leaves)]
    entry = JobEntry(spine_job, generation, key ^ 0xFFFF, slot_base, slots, k, tuple(at), None,
                     (per_leaf,) * leaves, 0, ranks)
    for address in (spine, *at):
        if address not in switches:
            switches[address] = SwitchModel(num_slots=max(64, slot_base + slots))
    switches[spine].add_job(entry)
    for address, job in zip(at, jobs, strict=True):
        switches[address].add_job(job.entry())
    return Tree(spine, at, jobs, entry)


class Agreed:
    """A reduction whose switch agreed ``exponents`` for every data chunk: what a staged payload's
    ``advance`` asks of one (:class:`~switchagg.protocol.StagedPayloads`), to test a payload alone.
    ``summed``: data chunks [0, summed) whose sums are in (the test writes them into the payload's rows)."""

    def __init__(self, exponents: np.ndarray, slots: int = 8) -> None:
        self.params = StreamParams(1, 0, 0, 1, 1, slots, 1)
        self.mismatch = None
        self._exponents = np.asarray(exponents, np.int8)
        self.prepared = self.summed = 0

    def agreed_upto(self) -> int:
        return len(self._exponents)

    def exponents(self, start: int, stop: int) -> bytes:
        return self._exponents[start:stop].tobytes()

    def prepare(self, upto: int, now: float) -> None:
        self.prepared = upto

    def summed_upto(self) -> int:
        return self.summed


@dataclass
class Worker:
    job: Job
    rank: int
    window: Window
    copies: np.ndarray
    next_id: int = 0
    seq: int = 0  # the worker's calls so far: each call's place in its descriptor
    started: bool = False
    dead_after: int | None = None  # stops reacting after receiving this many packets
    received: int = 0
    red: Reduction | NativeReduction | None = None
    switch: tuple[str, int] | str = SWITCH  # where its packets go
    payloads: object = None  # the call's
    # its staged payload's step after each of the reduction's (StagedPayloads.advance), None where it is not
    # staged: asked once a call, not at every step (a Protocol's isinstance is slow)
    advance: Callable[[Reduction | NativeReduction, float], None] | None = None
    out: np.ndarray | None = None
    error: Exception | None = None
    sent: int = 0
    arena: Arena = field(default_factory=Arena)  # the C stream's per-call arrays, as a client keeps them
    inbox: list[bytes] = field(default_factory=list)  # datagrams arrived, not yet taken (with Batching)
    waking: bool = False  # a wake is due to take them
    buffer: bytearray = field(default_factory=bytearray)  # the receive buffer: earlier batches' bytes stay
    batches: list[tuple[int, int]] = field(default_factory=list)  # each receive batch's (messages, datagrams)
    # the call's first id and slot copies before it (what finish() rewinds to), and whether it said it failed
    call_start: tuple[int, np.ndarray] | None = None
    failed: bool = False


@dataclass
class SimNet:
    model: SwitchModel | None  # the one switch, at SWITCH; None: ``switches`` alone (a tree)
    up: Impairment = field(default_factory=Impairment)  # worker -> switch, and a switch towards the root
    down: Impairment = field(default_factory=Impairment)  # switch -> worker, and a switch towards the leaves
    seed: int = 0
    impl: str = "python"  # which Reduction the workers run: a key of IMPLEMENTATIONS
    batching: Batching | None = None  # None: each datagram taken alone as it arrives
    now: float = 0.0
    workers: dict[tuple[str, int], Worker] = field(default_factory=dict)
    sent_log: list[tuple[float, tuple[str, int], bytes]] = field(default_factory=list)  # every worker packet
    switches: dict = field(default_factory=dict)  # address -> SwitchModel: every switch, the one model's too
    # seconds a switch takes per packet: one in at a time, so that a burst queues there as at a real one's rate
    # (0: none, every packet at once)
    service: float = 0.0

    def __post_init__(self) -> None:
        if self.model is not None:
            self.switches[SWITCH] = self.model
        self.rng = random.Random(self.seed)
        self._dropping: dict = {}  # link -> (packets of its lost run still to drop, until when)
        self._dark: dict = {}  # hop -> packets reaching it still to drop (Impairment.dark)
        self.dropped = 0  # packets the links lost
        self._events: list = []
        self._seq = itertools.count()
        self._busy: dict = {}  # switch -> when it is done with the packets it holds (service)

    def add_tree_workers(self, t: Tree) -> list[Worker]:
        """A worker for every rank of tree ``t``, each sending to its leaf, in tree-rank order."""
        return [self.add_worker(job, w, switch=leaf) for job, leaf in zip(t.jobs, t.leaves, strict=True)
                for w in range(job.n)]

    def add_worker(self, job: Job, rank: int, **kw) -> Worker:
        w = Worker(job, rank, Window(job.slots), np.zeros(job.slots, np.int64), **kw)
        self.workers[job.address(rank)] = w
        return w

    def _transmit(self, imp: Impairment, dst, data: bytes, src) -> None:
        if imp.dark:  # the hop's count of packets, every sender's
            left = self._dark.get(dst, 0)
            if left or self.rng.random() < imp.loss / imp.dark:
                self._dark[dst] = (left or imp.dark) - 1
                self.dropped += 1
                return
        else:
            link = (src, dst)
            left, until = self._dropping.get(link, (0, 0.0))
            if left and self.now <= until:  # the rest of a lost run: the packets that follow at once
                self._dropping[link] = (left - 1, until)
                self.dropped += 1
                return
            if self.rng.random() < imp.loss / imp.run:
                self._dropping[link] = (imp.run - 1, self.now + RUN_SPAN)
                self.dropped += 1
                return
        copies = 2 if self.rng.random() < imp.dup else 1
        for _ in range(copies):
            at = self.now + imp.latency + self.rng.random() * imp.jitter
            heapq.heappush(self._events, (at, next(self._seq), dst, data, src))

    def _flush(self, w: Worker, addr) -> None:
        rows, lengths = np.empty((3, datagram_size(w.job.k)), np.uint8), np.zeros(3, np.uint32)
        lost, message = False, 0  # with whole messages: whether this one is lost, and its datagrams so far
        while n := w.red.emit(rows, lengths):
            for row, length in zip(rows[:n], lengths[:n].tolist(), strict=True):
                w.sent += 1
                self.sent_log.append((self.now, addr, row[:length].tobytes()))
                if not self.up.whole:
                    self._transmit(self.up, w.switch, row[:length].tobytes(), addr)
                    continue
                if message % 64 == 0:
                    lost = self.rng.random() < self.up.loss
                message += 1
                self.dropped += lost
                if not lost:
                    self._transmit(Impairment(0, self.up.dup, self.up.latency, self.up.jitter), w.switch,
                                   row[:length].tobytes(), addr)

    def start(self, w: Worker, x: np.ndarray, progress_timeout: float = 5.0, collective: str = "allreduce",
              staged: bool = False, failed: bool = False) -> None:
        """Start ``w``'s next call on ``x``: an allreduce, or a reduce-scatter (``w.out`` is then its shard).
        ``staged``: floats through :class:`~switchagg.torch_payloads.TorchPayloads` (a CPU tensor), a
        window at a time, as a GPU's go. ``failed``: a call whose input the rank could not reduce (its
        descriptor says so, and it sends no data), as ``Client`` makes one."""
        job = w.job
        if failed:
            x, collective = np.empty(0, np.int32), "allreduce"
        layout = calls.Layout.of(x.size, job.k, job.ranks, collective)
        size = layout.shard if layout.scatter else x.size
        if x.dtype == np.int32:
            w.out = np.empty(size, np.int32)
            payloads = Int32Payloads(x, w.out, job.k, layout)
        elif staged:
            import torch

            from switchagg.torch_payloads import TorchPayloads

            payloads = TorchPayloads(torch.from_numpy(x.astype(np.float32)), job.k, job.ranks, layout,
                                     job.rank(w.rank))
            w.out = payloads.out.numpy()
        else:
            w.out = np.empty(size, np.float32)
            payloads = FloatPayloads(x.astype(np.float32), w.out, job.k, job.ranks, layout)
        w.payloads = payloads
        w.advance = payloads.advance if isinstance(payloads, StagedPayloads) else None
        desc = calls.CallDescriptor(w.seq, x.size, "int32" if x.dtype == np.int32 else "float", "sum",
                                    collective=collective, failed=failed)
        w.call_start, w.failed = (w.next_id, w.copies.copy()), failed
        w.red = None  # the last call's stream gives its arena back, for this call to reuse
        native = {"arena": w.arena} if self.impl == "native" else {}
        w.red = IMPLEMENTATIONS[self.impl](
            job.params(w.rank), w.window, payloads, n_chunks=layout.n_chunks, first_id=w.next_id, copies=w.copies,
            now=self.now, progress_timeout=progress_timeout, started=w.started,
            call=calls.rows(desc, job.rank(w.rank), job.ranks, job.k), layout=layout, **native)
        w.next_id = (w.next_id + w.red.total) & 0xFFFFFFFF
        w.seq += 1
        w.error = None
        self._flush(w, job.address(w.rank))

    def finish(self, w: Worker) -> Exception | None:
        """What ``Client`` does once ``w``'s call is over: where its call round showed other calls, it takes
        the ids and slot copies that every rank takes as used (:func:`switchagg.calls.footprint`), so that
        the next call stays paired, and returns the error the rank raises (None: the call was summed, or
        this rank failed it, which raises its own)."""
        if w.red.mismatch is None:
            return None
        job, (first, before) = w.job, w.call_start
        used = calls.footprint(w.red.mismatch, job.ranks, job.k, job.slots)
        w.copies[:] = before
        w.copies[:used] ^= 1
        w.next_id = (first + used) & 0xFFFFFFFF
        return None if w.failed else calls.mismatch_error(w.red.mismatch, job.ranks, job.rank(w.rank))

    def launch(self, w: Worker, red: Reduction) -> None:
        """Start ``w`` on a reduction built elsewhere (the join's phases, whose slot and copy the join
        picks), and send what it can at once."""
        w.red, w.error, w.advance = red, None, None
        self._flush(w, w.job.address(w.rank))

    def _advance(self, w: Worker) -> None:
        """A staged payload's step after the reduction's (as the client's loop takes it)."""
        if w.advance is not None:
            w.advance(w.red, self.now)

    def _receive(self, w: Worker, addr, buf: bytes | bytearray, offsets: list[int], lengths: list[int]) -> None:
        """One receive batch into ``w``'s reduction, then what a client's loop does after it."""
        w.red.receive_batch(buf, np.array(offsets, np.uint32), np.array(lengths, np.uint32), self.now)
        w.started = w.started or w.red.started
        self._advance(w)
        self._flush(w, addr)

    def _schedule_wake(self, addr, delay: float) -> None:
        heapq.heappush(self._events, (self.now + delay, next(self._seq), addr, None, WAKE))

    def _wake(self, w: Worker, addr) -> None:
        """Take what the kernel would hand one recvmmsg: up to ``messages`` GRO runs from the inbox, each
        of datagrams of its first one's size (the kernel's last segment may be shorter), laid out a
        message per stride of the receive buffer; what is left waits for the next turn, at once."""
        b = self.batching
        if w.red is None or w.error is not None or self._dead(w):
            w.inbox.clear()
            w.waking = False
            return
        stride = b.segments * max(map(len, w.inbox))
        budget = len(w.inbox) if w.dead_after is None else w.dead_after - w.received  # a dying worker's last
        runs: list[list[bytes]] = []
        while w.inbox and budget and len(runs) < b.messages:
            run, cap = [w.inbox.pop(0)], self.rng.randint(1, b.segments)
            budget -= 1
            while w.inbox and budget and len(run) < cap and len(w.inbox[0]) <= len(run[0]):
                run.append(w.inbox.pop(0))
                budget -= 1
                if len(run[-1]) < len(run[0]):
                    break
            runs.append(run)
        w.buffer.extend(bytes(max(0, len(runs) * stride - len(w.buffer))))
        offsets, lengths = [], []
        for j, run in enumerate(runs):
            at = j * stride
            for datagram in run:
                w.buffer[at:at + len(datagram)] = datagram
                offsets.append(at)
                lengths.append(len(datagram))
                at += len(datagram)
        w.received += len(offsets)
        w.batches.append((len(runs), len(offsets)))
        w.waking = bool(w.inbox) and not self._dead(w)
        if w.waking:
            self._schedule_wake(addr, 0.0)
        else:
            w.inbox.clear()
        self._receive(w, addr, w.buffer, offsets, lengths)

    def _active(self) -> list[tuple[tuple[str, int], Worker]]:
        return [(a, w) for a, w in self.workers.items()
                if w.red is not None and not w.red.done and w.error is None and not self._dead(w)]

    @staticmethod
    def _dead(w: Worker) -> bool:
        return w.dead_after is not None and w.received >= w.dead_after

    def run(self, until: float = 1e9) -> None:
        """Run until every live worker's reduction is done or failed, or the clock reaches ``until`` (where it
        then stands). A worker's deadline is read again after whatever it did (a receive, a wake, a tick): a
        net of a thousand workers does not ask each at every event. The deadlines wait in a heap (an entry
        whose worker's deadline moved since is dropped when it comes up), and the workers due at once tick in
        the order they were added."""
        live = dict(self._active())
        order = {a: i for i, a in enumerate(live)}
        deadlines = {a: w.red.next_deadline() for a, w in live.items()}
        timers = [(deadline, order[a], a) for a, deadline in deadlines.items()]
        heapq.heapify(timers)

        def refresh(a, w: Worker) -> None:
            if a not in live:
                return
            if w.red.done or w.error is not None or self._dead(w):
                del live[a], deadlines[a]
            else:
                deadlines[a] = w.red.next_deadline()
                heapq.heappush(timers, (deadlines[a], order[a], a))

        def first_timer() -> float:
            while deadlines.get(timers[0][2]) != timers[0][0]:  # its worker is done, or its deadline moved
                heapq.heappop(timers)
            return timers[0][0]

        while live and self.now < until:
            next_timer = first_timer()
            if min(next_timer, self._events[0][0] if self._events else math.inf) > until:
                self.now = until  # nothing is due before it: the clock stops there, not at the next timer
                break
            if self._events and self._events[0][0] <= next_timer:
                at, _, dst, data, src = heapq.heappop(self._events)
                self.now = max(self.now, at)
                if dst in self.switches:
                    if isinstance(src, Queued):  # its turn came
                        src = src.src
                    elif self.service:  # its queue: a packet is taken once those before it are
                        turn = max(self.now, self._busy.get(dst, 0.0))
                        self._busy[dst] = turn + self.service
                        if turn > self.now:
                            heapq.heappush(self._events, (turn, next(self._seq), dst, data, Queued(src)))
                            continue
                    for emit in self.switches[dst].process(data, src):
                        toward = self.up if emit.header.type in UP else self.down
                        self._transmit(toward, emit.dst, emit.payload(), dst)
                elif src == WAKE:
                    self._wake(self.workers[dst], dst)
                    refresh(dst, self.workers[dst])
                else:
                    w = self.workers.get(dst)
                    if w is None or w.red is None or self._dead(w) or w.error is not None:
                        continue
                    if self.batching is None:
                        w.received += 1
                        self._receive(w, dst, data, [0], [len(data)])
                        refresh(dst, w)
                        continue
                    w.inbox.append(data)
                    if not w.waking:
                        w.waking = True
                        self._schedule_wake(dst, self.rng.random() * self.batching.wake)
            else:
                self.now = max(self.now, next_timer)
                due = set()
                while timers and timers[0][0] <= self.now:
                    _, i, a = heapq.heappop(timers)
                    if a in deadlines and deadlines[a] <= self.now:
                        due.add((i, a))
                for a, w in [(a, live[a]) for _, a in sorted(due)]:
                    try:
                        w.red.tick(self.now)
                    except Exception as exc:  # noqa: BLE001 - recorded for the test to inspect
                        w.error = exc
                        refresh(a, w)
                        continue
                    self._advance(w)
                    self._flush(w, a)
                    refresh(a, w)


def reduce_all(xs: list[np.ndarray], job: Job | None = None, *, up: Impairment | None = None,
               down: Impairment | None = None, seed: int = 0, rounds: int = 1,
               model: SwitchModel | None = None, impl: str = "python") -> tuple[list[list[np.ndarray]], SimNet]:
    """Allreduce ``xs`` (one array per rank) ``rounds`` times; returns each rank's results."""
    job = job or Job(n=len(xs))
    if model is None:
        model = SwitchModel(num_slots=max(64, job.slot_base + job.slots))
        model.add_job(job.entry())
    net = SimNet(model, up or Impairment(), down or Impairment(), seed=seed, impl=impl)
    workers = [net.add_worker(job, r) for r in range(job.n)]
    results: list[list[np.ndarray]] = [[] for _ in workers]
    for _ in range(rounds):
        for w, x in zip(workers, xs, strict=True):
            net.start(w, x)
        net.run()
        for r, w in enumerate(workers):
            assert w.error is None, w.error
            assert w.red.done
            results[r].append(w.out.copy())
    return results, net
