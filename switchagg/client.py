"""``switchagg.Client``: a worker's allreduce and reduce-scatter through the switch.

The client owns one UDP socket and one background thread. Calls are queued and
run in order on that thread (each is a collective: every worker must
issue the same calls in the same order), each as a :class:`~switchagg.protocol.Reduction`
driven by the socket and the clock. Before its first call the client joins its peers in a
session of their own (:mod:`switchagg.session`), and every call begins with a call round
(:mod:`switchagg.calls`) that every rank checks before any data moves.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np

from . import calls
from .calls import CallDescriptor
from .config import JobConfig
from .diagnosis import ASK_TRIES, ASK_WAIT, Diagnosis
from .errors import ClosedError, ConfigError, JobNotStarted, QuantizationError, StallError, SwitchAggError
from .payloads import Int32Payloads, Prepared, Request, array_payloads, check_op, flat_payloads, is_tensor
from .protocol import Arena, NativeReduction, Reduction, StagedPayloads, StreamParams
from .scheduling import batch_scheduling
from .session import Join, Phase
from .switch.control_client import request
from .transport import TransportStats, UdpSocket
from .window import Window
from .wire import (
    HEADER_SIZE,
    IP_UDP_OVERHEAD,
    Header,
    PacketType,
    datagram_size,
    make_header,
    max_values_for_mtu,
    unpack_header,
)

_U32 = 0xFFFFFFFF
_SEND_BYTES = 1 << 20  # what one send call may carry: a window's worth of small packets
_WAKE = 0.2  # s: how long the client's thread waits on its socket, or the C loop runs, between looks at the
# call from Python (close() wakes a wait at once: UdpSocket.interrupt)
_PROBE_EVERY = 0.2  # s: a probe that got no reply goes again
NONFINITE = ("propagate", "raise")


class _Paired(Exception):
    """A call's failure that every rank met at the same call: the client goes on, its peers in step."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def payloads_of(x: Any, request: Request, out: Any = None) -> Prepared:
    """The one place that looks at what a caller passed: a float tensor on a GPU stays there
    (:class:`~switchagg.torch_payloads.TorchPayloads`, which only queues work on the device here, in
    the caller's thread); a CPU tensor, a numpy array or a list takes the numpy payloads. Raises here,
    in the caller, on what cannot be reduced."""
    if not is_tensor(x):
        return array_payloads(x, request, out)
    from . import torch_payloads

    check_op(request.op)
    if torch_payloads.stays_on_device(x):
        layout = request.layout(x.numel())
        shape = request.result_shape(tuple(x.shape), out)
        gpu = torch_payloads.TorchPayloads(x, request.k, request.n_workers, layout, request.rank)

        def finish() -> Any:
            return gpu.result(x, mean=request.op == "mean", shape=shape, out=out)

        return Prepared(gpu, layout, finish, length=x.numel(), kind="float")
    flat, restore = torch_payloads.tensor_to_flat(x)
    return flat_payloads(flat, tuple(x.shape), restore, str(x.dtype).removeprefix("torch."), request, out)


class Client:
    """One worker (``rank``) of the job described by ``config``.

    In a tree (``config`` a leaf's job: :meth:`switchagg.tree.TreeConfig.worker` gives it) ``rank`` is the
    worker's index under its leaf, which its packets carry; its calls' ranks are the tree's.

    ``start_timeout`` bounds the wait for the switch and the other workers at the
    start of the job; ``stall_timeout`` bounds any later wait for progress. Both
    end in an exception, never in a hang. ``batch_scheduling`` runs the client's thread
    under ``SCHED_BATCH`` (see :mod:`switchagg.scheduling`: where workers share cores, a
    woken worker then does not preempt the one that woke it); False keeps the default policy.
    ``nonfinite`` says what a float call whose input held NaN or infinity on any rank does:
    ``"propagate"`` (as allreduce does: NaN or inf in the positions of the chunks that held one,
    on every rank) or ``"raise"`` (:class:`QuantizationError`, on every rank, for that call).
    """

    def __init__(self, config: JobConfig, rank: int, *, start_timeout: float = 60.0,
                 stall_timeout: float = 5.0, batched: bool | None = None,
                 segmentation: bool | None = None, batch_scheduling: bool = True,
                 nonfinite: str = "propagate") -> None:
        if nonfinite not in NONFINITE:
            raise ConfigError(f"nonfinite={nonfinite!r}: use 'propagate' (NaN and inf reach every rank, as "
                              "allreduce does) or 'raise' (every rank raises for that call)")
        if not 0 <= rank < config.n_workers:
            raise ConfigError(f"rank {rank} is not a worker of job {config.job_id} "
                              f"(it has ranks 0..{config.n_workers - 1})")
        self.config, self.rank = config, rank
        self.start_timeout, self.stall_timeout = start_timeout, stall_timeout
        k = config.values_per_packet
        size = datagram_size(k)
        self._sock = UdpSocket(config.workers[rank].address.tuple, peer=config.switch.tuple,
                               batch=min(1024, max(64, _SEND_BYTES // size)), max_datagram=size, batched=batched,
                               segmentation=segmentation)
        mtu = self._sock.path_mtu()
        if size + IP_UDP_OVERHEAD > min(mtu, 65535):
            self._sock.close()
            raise ConfigError(
                f"values_per_packet = {k} makes {size + IP_UDP_OVERHEAD}-byte IPv4 packets, but "
                f"the path MTU towards {config.switch} is {mtu}: use values_per_packet <= "
                f"{max_values_for_mtu(min(mtu, 65535))} (no IP fragmentation)")
        self.window = Window(max_size=config.slot_count)
        self._arena = Arena()  # the C stream's per-call arrays, reused from one call to the next
        self._copies = np.zeros(config.slot_count, dtype=np.int64)
        self._next_id = 0
        self._seq = 0  # calls since the session began: each call's place, in its descriptor
        self._started = False
        self.nonfinite = nonfinite
        self.retransmissions = 0  # contributions sent again after a loss, over all calls
        self.queries = 0  # QUERY packets that asked the switch whose contribution it misses
        self.protocol_errors = 0  # results in a shape their packet does not have (owner, count): ignored
        self.foreign_datagrams = 0  # datagrams that were no result of this client's run (Reduction.foreign): ignored
        self.generation: int | None = None  # the job's installed one, where the join starts
        self.session: int | None = None  # this run's, agreed with the peers: what the calls carry
        self._failed: BaseException | None = None
        self._closing = False
        self._lock = threading.Lock()  # orders submit() against close(): nothing queued after the end
        self._batch_scheduling = batch_scheduling
        self._queue: queue.Queue[tuple[Future, Callable[[], Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"switchagg-client-{rank}", daemon=True)
        self._thread.start()

    @property
    def backend(self) -> str:
        """How the client's datagrams move (see :attr:`switchagg.transport.UdpSocket.backend`)."""
        return self._sock.backend

    @property
    def transport_stats(self) -> TransportStats:
        """The socket's counts: datagrams sent and received, system calls, refusals."""
        return self._sock.stats

    # ---- public API ------------------------------------------------------------------------------

    def allreduce(self, x: Any, op: str = "sum", out: Any = None) -> Any:
        """Sum (or average, ``op="mean"``) ``x`` over all workers; a new array unless ``out``."""
        return self.allreduce_async(x, op=op, out=out).result()

    def allreduce_async(self, x: Any, op: str = "sum", out: Any = None) -> Future:
        """Queue an allreduce; the Future holds the result (or the error).

        A float tensor on a GPU stays there (see :mod:`switchagg.torch_payloads`);
        everything else takes the numpy path (:func:`payloads_of`). Input that cannot be reduced
        (an unsupported dtype or op) fails this call on every rank, in its Future: this rank still
        takes part in the call round, saying so, so that its peers fail the same call and the
        ranks' next calls stay paired.
        """
        return self._collective_async(x, Request(self.config.values_per_packet, self.config.ranks, op), out)

    def reduce_scatter(self, x: Any, op: str = "sum", out: Any = None) -> Any:
        """This rank's shard of the sum (or mean) of ``x`` over all workers; a new 1-D array unless ``out``.

        ``x`` (any shape, taken flat) holds ``n_workers * s`` values; the result is values
        ``[rank * s, (rank + 1) * s)`` of the elementwise sum, with allreduce's dtypes, error bound
        and ``nonfinite`` handling. ``out`` (``s`` values, any shape) receives it in place; it may be
        this rank's own shard of ``x``.
        """
        return self.reduce_scatter_async(x, op=op, out=out).result()

    def reduce_scatter_async(self, x: Any, op: str = "sum", out: Any = None) -> Future:
        """Queue a reduce-scatter (:meth:`reduce_scatter`); the Future holds the shard (or the error).

        Each chunk's sum reaches its owner alone; the other ranks receive its header (the switch's
        side of ``docs/protocol.md``, section 4b). A length that the ranks do not divide evenly fails
        the call as an unsupported dtype does: here a ``ValueError`` saying so, on the peers
        :class:`~switchagg.errors.PeerFailed`, and the next calls stay paired. ``s = 0`` (an empty
        ``x``) is a call like any other, with an empty shard.
        """
        cfg = self.config
        return self._collective_async(x, Request(cfg.values_per_packet, cfg.ranks, op, "reduce_scatter",
                                                 cfg.rank_of(self.rank)), out)

    def fail_async(self, error: BaseException) -> Future:
        """Take part in the next call as a rank that cannot (a caller whose own step before the call failed):
        its peers' call fails with :class:`~switchagg.errors.PeerFailed` and the next calls stay paired;
        the Future holds ``error``."""

        def work() -> Any:
            self._call(None, CallDescriptor(self._seq, failed=True))
            raise _Paired(error)

        return self.submit(work)

    def _collective_async(self, x: Any, request: Request, out: Any) -> Future:
        """Queue the call ``request`` asks of ``x``; input that cannot be reduced fails it on every rank."""
        try:
            job: Prepared | None = payloads_of(x, request, out)
        except Exception as exc:  # noqa: BLE001 - becomes this call's outcome on every rank
            job, problem = None, exc

        def work() -> Any:
            if job is None:
                self._call(None, CallDescriptor(self._seq, failed=True))
                raise _Paired(problem)
            marked = self._call(job, CallDescriptor(self._seq, job.length, job.kind, request.op,
                                                    collective=request.collective))
            result = job.finish()
            # A marked chunk is known to every rank (a reduce-scatter's owner alone holds its NaN/inf)
            if self.nonfinite == "raise" and job.kind == "float" and (marked or not _all_finite(result)):
                raise _Paired(QuantizationError(
                    "this call's input held NaN or infinity on some rank, so its sum does too (every rank "
                    "raises for this call; Client(nonfinite='propagate') hands such sums back instead)"))
            return result

        return self.submit(work)

    def probe(self, timeout: float | None = None) -> int:
        """Ask the switch whether it admits this worker; returns the job's installed generation."""
        return self.submit(lambda: self._probe(self.start_timeout if timeout is None else timeout)).result()

    def join(self, timeout: float | None = None) -> int:
        """Probe, and agree with every peer on this run's session (:mod:`switchagg.session`); returns it.

        The first call does this by itself; calling it first says at once whether the whole job is there.
        """
        return self.submit(lambda: self._ensure_session(self.start_timeout if timeout is None else timeout)).result()

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the client's thread after the calls queued before it."""
        future: Future = Future()
        with self._lock:
            if self._closing:
                raise ClosedError("this client is closed: create a new one")
            self._queue.put((future, fn))
        return future

    def close(self) -> None:
        """Stop the thread (failing queued calls, and the one running at once: its wait on the socket is
        woken, :meth:`~switchagg.transport.UdpSocket.interrupt`) and release the socket."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._queue.put(None)
        self._sock.interrupt()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the client thread -----------------------------------------------------------------------

    def _run(self) -> None:
        if self._batch_scheduling:
            batch_scheduling()
        while (item := self._queue.get()) is not None:
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            if self._failed is not None:
                future.set_exception(ClosedError(
                    f"an earlier call of this client failed ({self._failed}); its workers are out of "
                    "step now: reset the job and create new clients"))
                continue
            try:
                future.set_result(fn())
            except _Paired as paired:  # every rank failed this call: still in step
                future.set_exception(paired.error)
            except BaseException as exc:  # whatever else broke a call leaves this worker out of step
                self._failed = exc
                future.set_exception(exc)
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not None:
                item[0].set_exception(ClosedError("the client was closed before this call ran"))

    def _probe(self, timeout: float) -> int:
        cfg = self.config
        probe = make_header(PacketType.PROBE, job=cfg.job_id, worker=self.rank, key=cfg.key).pack()
        deadline = time.monotonic() + timeout
        while True:
            self._check_open()
            self._sock.send([((probe,), None)])
            for h in self._replies(min(time.monotonic() + _PROBE_EVERY, deadline)):
                if (h.type == PacketType.PROBE_REPLY and h.job == cfg.job_id
                        and h.worker == self.rank and h.key == cfg.key):
                    return self._accept_generation(h.generation)
            if time.monotonic() >= deadline:
                raise JobNotStarted(
                    f"worker {self.rank} of job {cfg.job_id}: the switch at {cfg.switch} did not answer "
                    f"a probe for {timeout:.0f} s. Check that it runs and has this job installed "
                    f"(`switchagg status --config ...`), and that this worker sends from "
                    f"{cfg.workers[self.rank].address} with the job's key.")

    def _replies(self, until: float) -> Iterator[Header]:
        """The header-only datagrams (the switch's answers to a PROBE or a QUERY) that come until ``until``."""
        while (now := time.monotonic()) < until:
            self._check_open()
            for data, _ in self._sock.recv(min(until - now, _WAKE)):
                if len(data) == HEADER_SIZE:
                    yield unpack_header(data)

    def _accept_generation(self, generation: int) -> int:
        if self.config.generation is not None and generation != self.config.generation:
            raise ConfigError(
                f"the config says generation {self.config.generation} but the switch runs job "
                f"{self.config.job_id} at generation {generation}: remove 'generation' from the "
                "config to follow the switch, or redeploy the job")
        if self.generation is not None and generation != self.generation:
            raise StallError(f"job {self.config.job_id} was reset on the switch (generation "
                             f"{self.generation} -> {generation}) while this client used it: create new clients")
        self.generation = generation
        return generation

    def _check_open(self) -> None:
        if self._closing:
            raise ClosedError("the client was closed during this call")

    def _params(self, generation: int) -> StreamParams:
        cfg = self.config
        tree = (cfg.rank_of(self.rank), cfg.ranks) if cfg.tree_size else (None, None)
        return StreamParams(cfg.job_id, self.rank, cfg.key, generation, cfg.n_workers, cfg.slot_count,
                            cfg.values_per_packet, cfg.asks_first, *tree)

    def _ensure_session(self, timeout: float) -> int:
        """Probe (the installed generation) and join the peers in a session of this run's own."""
        if self.session is None:
            if self.generation is None:
                self._probe(timeout)
            cfg = self.config
            join = Join(self.generation, cfg.rank_of(self.rank), cfg.ranks, cfg.values_per_packet, cfg.slot_count)
            while join.session is None:
                join.take(self._exchange(join.phase, timeout))
            self.session = join.session
        return self.session

    def _exchange(self, phase: Phase, timeout: float) -> bytes:
        """One sum of the join: the phase's values (P x K big-endian int32) as chunks 0 to P - 1 in its
        slots (from ``phase.slot`` on) and copy, under its generation; returns the sum as it came back."""
        cfg = self.config
        flat = phase.values.astype(np.int32)
        out = np.empty_like(flat)
        n_chunks = flat.size // cfg.values_per_packet
        copies = np.zeros(cfg.slot_count, dtype=np.int64)
        copies[phase.slot:phase.slot + n_chunks] = phase.copy
        red = Reduction(self._params(phase.generation), self.window,
                        Int32Payloads(flat, out, cfg.values_per_packet), n_chunks=n_chunks, first_id=0, copies=copies,
                        now=time.monotonic(), progress_timeout=timeout, started=self._started,
                        first_slot=phase.slot)
        self._drive(red)
        return out.astype(">i4").tobytes()

    def _call(self, job: Prepared | None, desc: CallDescriptor) -> bool:
        """One call: its call round, then (where every rank's descriptor matched this one) its data.
        Returns whether a chunk of it went marked (some rank's input held NaN or infinity).

        Where the call round shows other calls, every rank has the same sum, so every rank takes the
        same ids and slot copies as used (:func:`switchagg.calls.footprint`) and raises alike.
        """
        self._ensure_session(self.start_timeout)
        cfg = self.config
        k, n, rank = cfg.values_per_packet, cfg.ranks, cfg.rank_of(self.rank)
        if job is None:  # this rank's input could not be reduced: it says so in the call round
            empty = np.empty(0, dtype=np.int32)
            payloads, layout = Int32Payloads(empty, np.empty_like(empty), k), calls.Layout(k, 0)
        else:
            payloads, layout = job.payloads, job.layout
        first, before = self._next_id, self._copies.copy()
        red = NativeReduction(self._params(self.session), self.window, payloads, n_chunks=layout.n_chunks,
                              first_id=first, copies=self._copies, now=time.monotonic(), started=self._started,
                              progress_timeout=self.stall_timeout if self._started else self.start_timeout,
                              call=calls.rows(desc, rank, n, k), layout=layout, arena=self._arena)
        self._next_id = (first + red.total) & _U32
        self._seq += 1
        self._drive(red, payloads.advance if isinstance(payloads, StagedPayloads) else None)
        if red.mismatch is not None:
            used = calls.footprint(red.mismatch, n, k, cfg.slot_count)
            self._copies[:] = before
            self._copies[:used] ^= 1
            self._next_id = (first + used) & _U32
            if not desc.failed:  # a rank that failed raises its own error
                raise _Paired(calls.mismatch_error(red.mismatch, n, rank))
        return red.marked

    def _drive(self, red: Reduction | NativeReduction,
               advance: Callable[[Reduction | NativeReduction, float], None] | None = None) -> None:
        """Move ``red``'s packets until it is done, raises, or the client closes; ``advance``: a staged
        payload's, after every step (:class:`~switchagg.protocol.StagedPayloads`). On a batched socket the
        loop runs in C (:meth:`~switchagg.transport.UdpSocket.drive`), back here every :data:`_WAKE`; the
        plain backend runs the same loop below."""
        sock = self._sock
        try:
            if sock.drives:  # the loop below, in C
                self._check_open()
                while not sock.drive(red, _WAKE, advance):
                    self._check_open()
                return
            while True:
                while n := red.emit(sock.out_rows, sock.out_lengths):
                    sock.send_rows(n)
                if red.done:
                    break
                self._check_open()
                wait = min(red.next_deadline() - time.monotonic(), _WAKE)
                got = sock.recv_packets(wait) if wait > 0 else sock.recv_packets()
                now = time.monotonic()
                if got:
                    red.receive_batch(sock.in_buf, sock.in_offsets[:got], sock.in_lengths[:got], now)
                red.tick(now)
                if advance is not None:
                    advance(red, now)
        except (StallError, JobNotStarted) as exc:
            raise type(exc)(str(exc) + self._diagnose(red)) from None
        finally:
            self._started = self._started or red.started
            self.retransmissions += red.retransmissions
            self.queries += red.queries
            self.protocol_errors += red.protocol_errors
            self.foreign_datagrams += red.foreign

    def _diagnose(self, red: Reduction | NativeReduction) -> str:
        """Which workers the stuck slots still wait for (:mod:`switchagg.diagnosis`): from the switch's
        control port where the config names one (the embedded switch), else from its answers to QUERYs."""
        up = self.config.parent
        parent = None if up is None else f"at {up.address} (job {up.job}, where this switch is child {up.index})"
        diagnosis = Diagnosis(red.params, red.pending(), parent)
        if not diagnosis.stuck:
            return ""
        if self.config.control is None:
            return self._ask_switch(diagnosis)
        try:
            states = request(self.config.control, diagnosis.slots_request())["slots"]
        except SwitchAggError as exc:
            return f" The switch's control port did not answer either: {exc}"
        return diagnosis.from_slots(states)

    def _ask_switch(self, diagnosis: Diagnosis) -> str:
        """Send the diagnosis's QUERYs, :data:`~switchagg.diagnosis.ASK_TRIES` times until every one is
        answered, and hand it the answers that come."""
        queries = [((query,), None) for query in diagnosis.queries()]
        for _ in range(ASK_TRIES):
            self._sock.send(queries)
            for h in self._replies(time.monotonic() + ASK_WAIT):
                if diagnosis.receive(h) and diagnosis.answered:
                    break
            if diagnosis.answered:
                break
        return diagnosis.from_answers(str(self.config.switch))



def _all_finite(result: Any) -> bool:
    """Whether a float call's result holds neither NaN nor infinity (numpy or torch)."""
    if is_tensor(result):
        import torch

        return bool(torch.isfinite(result).all())
    return bool(np.isfinite(result).all())
