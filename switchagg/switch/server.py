"""The embedded software switch: the switch semantics behind a batched UDP socket.

It serves with :class:`NativeSwitch` (the model's rules in C, no Python object per
packet) unless asked for the pure :class:`SwitchModel`, which a test runs end to end.

It is the default target (no hardware, no BMv2) and runs in-process (threads)
or as ``switchagg switch``. An optional control port (TCP, one JSON object per
line, see :mod:`switchagg.switch.control`) lets another process read counters,
reset a job or see which workers a slot still waits for; it listens on loopback
unless ``control_public`` says otherwise (and then only with a ``control_token``).

**Several cores** (``cores`` > 1, ``switchagg switch --cores N``): ``N`` threads serve the one
:class:`NativeSwitch`, each from a socket of its own, all bound to the switch's address in one
``SO_REUSEPORT`` group, and a classic BPF program on the group (``SO_ATTACH_REUSEPORT_CBPF``, which
for UDP reads the payload from the switchagg header's first byte) steers each datagram to a shard:

* ``steer="job"`` (the default): shard ``job % N``, the header's ``job`` field (bytes 4-5). Every
  packet of a job, whatever its type, is served by one shard, so its results leave in the order
  its packets came, as from one core; jobs run side by side.
* ``steer="slot"``: a hash of the header's ``slot`` field (bytes 6-7), :func:`home_shard`, so one
  job's slots are served on every core. A worker takes a result that overtakes the result of a
  packet it sent earlier for a sign of loss (RACK, a reorder window of a quarter of the shortest
  round trip), and two shards serving one job's consecutive slots at once overtake each other all
  the time: on loopback with 4 workers at K = 64 a third of the packets were resent and a call
  took twice as long (README, "The embedded switch on several cores"). For workers that tolerate
  reordering.

A datagram too short to hold the field goes to shard 0. Every packet the switch takes carries
both fields: a CONTRIB and a QUERY the job and slot whose state they need, a PROBE its job and
slot 0 (it needs the job table alone). The kernel steers a *message*, though: a worker's
segmented send (GSO, up to 128 datagrams) reaches one shard whole, as a NIC's coalesced receive
would; its datagrams share their sender's job, not their slots. So the registers are not split
between the shards: they are one table, and a shard serves whatever reaches it, under a lock per
copy taken for the packet's stages (``_switch.c``). A datagram that reaches another shard than
the rule names is served exactly as there, and counted (``off_home``, per shard, in
:meth:`SoftSwitch.shard_stats` and the control port's ``status``). The C work and the socket
calls run without the GIL. Counters are kept per shard and summed; a job's install, reset or
removal takes the table from every shard at once (a batch in progress finishes first), so no
packet sees a job half installed.
"""

from __future__ import annotations

import ctypes
import socket
import struct
import threading
import time
from collections.abc import Callable

from ..config import Endpoint, JobConfig
from ..errors import ConfigError
from ..jobs import JobEntry, Lease, lapsed_jobs, new_generation
from ..transport import BATCHED_AVAILABLE, MAX_UDP, UdpSocket
from ..wire import FIELDS, UDP_PORT
from .control import ControlServer, check_control_address
from .model import SwitchModel
from .native import MAX_SHARDS, NativeSwitch
from .records import RESULTS_KEPT

Owner = tuple[str, int]  # the process that deployed a job: (host name, pid)
LEASE_COUNTERS = ("renewed", "expired")  # renewals served, jobs removed because their lease lapsed
NUM_SLOTS = 4096  # the pool: four jobs of K = 64 with their default 1024 slots each
OUT_PACKETS = 4096  # packets the C switch writes before they are sent: results of ~1000 contributions
OUT_BYTES = 8 << 20  # ... and their bytes (a multicast of 1 KiB of values or more takes them once, see _switch.c)

SO_ATTACH_REUSEPORT_CBPF = 51  # asm-generic/socket.h
STEERING = ("job", "slot")
_AT = {f.name: sum(g.bits for g in FIELDS[:i]) // 8 for i, f in enumerate(FIELDS)}
assert (_AT["job"], _AT["slot"]) == (4, 6) and {f.bits for f in FIELDS if f.name in ("job", "slot")} == {16}
SPREAD = 0x9E3779B1  # 2^32 / the golden ratio, odd: slots a power of two apart still spread over the shards
# linux/bpf_common.h: ld h [k] (big-endian, as the header has it); a *= k; a >>= k; a %= k; ret a
_LD_H_ABS, _MUL_K, _RSH_K, _MOD_K, _RET_A = 0x28, 0x24, 0x74, 0x94, 0x16


def home_shard(job: int, slot: int, shards: int, steer: str = "job") -> int:
    """The shard the steering sends a datagram of ``job`` and ``slot`` to (``_switch.c`` counts the others).

    By job: ``job % shards``. By slot: ``((slot * SPREAD) mod 2^32 >> 16) % shards``, not plain
    ``slot % shards``: a worker's segmented message is 64 or 128 datagrams of consecutive slots,
    steered by its first, and its messages start at slots a power of two apart, which went to
    shard 0 every one.
    """
    if steer == "job":
        return job % shards
    return (((slot * SPREAD) & 0xFFFFFFFF) >> 16) % shards


def steering_program(shards: int, steer: str = "job") -> bytes:
    """The classic BPF program that picks a datagram's shard, :func:`home_shard` (its sock_filter array).

    A reuseport program for UDP sees the UDP payload from its first byte; a load past the end of
    a short datagram ends the program with 0, so such a datagram goes to shard 0. Classic BPF's
    arithmetic is 32-bit, as the hash's.
    """
    if steer == "job":
        program = ((_LD_H_ABS, _AT["job"]), (_MOD_K, shards), (_RET_A, 0))
    else:
        program = ((_LD_H_ABS, _AT["slot"]), (_MUL_K, SPREAD), (_RSH_K, 16), (_MOD_K, shards), (_RET_A, 0))
    return b"".join(struct.pack("=HBBI", code, 0, 0, k) for code, k in program)


def _attach_steering(sock: socket.socket, shards: int, steer: str) -> None:
    code = steering_program(shards, steer)
    filters = ctypes.create_string_buffer(code, len(code))  # the kernel copies it during the call
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF,
                    struct.pack("@HP", len(code) // 8, ctypes.addressof(filters)))


def shard_sockets(address: tuple[str, int], shards: int, steer: str = "job", **options) -> list[UdpSocket]:
    """One :class:`UdpSocket` per shard on ``address`` (port 0: a free one), steered as ``steer`` says
    (:func:`home_shard`); for one shard, a plain one.

    The first binds as a lone socket would (a port 0 it picks is free, and a port another
    process holds is refused, even one in an SO_REUSEPORT group of its own) and then lets the
    others join it.
    """
    first = UdpSocket(address, **options)
    if shards == 1:
        return [first]
    socks = [first]
    try:
        first.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        socks += [UdpSocket(first.address, reuse_port=True, **options) for _ in range(shards - 1)]
        _attach_steering(first.sock, shards, steer)  # the group's sockets in the order they joined: shard i is socks[i]
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


class SoftSwitch:
    """The software switch; ``with SoftSwitch(...) as sw:`` starts and stops it.

    ``batch`` is how many datagrams the pure model (``native=False``) takes before it sends their
    results: at most :data:`RESULTS_KEPT`, the results whose values it keeps. ``segmentation`` is
    the socket's (:class:`~switchagg.transport.UdpSocket`): None uses GSO/GRO where the kernel has them.
    The control port, where ``control`` names one, must be on loopback unless ``control_public``, and
    off loopback needs a ``control_token`` (:func:`~switchagg.switch.control.control_token` reads the
    operator's): whoever reaches it reads the counters, whoever knows a job's key resets or removes
    the job, and ``add_job`` needs the token where one is set.
    ``cores`` is how many threads serve the C switch, each from its own socket, ``steer`` which
    field picks a datagram's (``"job"`` or ``"slot"``, see the module's doc); more than one core
    needs Linux's batched sockets.

    A job may hold a lease (:class:`~switchagg.jobs.Lease`, ``add_job(..., lease=seconds)``): a timer
    thread removes the job once the lease lapses unrenewed (:meth:`renew_job`), as ``remove_job`` does,
    so a killed program's jobs do not hold the pool. ``clock`` is the leases' (a test's own, to move
    time on rather than wait).
    """

    def __init__(self, address: Endpoint | tuple[str, int] = ("127.0.0.1", UDP_PORT), *,
                 control: Endpoint | tuple[str, int] | None = None, num_slots: int = NUM_SLOTS,
                 batched: bool | None = None, batch: int = 64, native: bool = True,
                 segmentation: bool | None = None, control_public: bool = False, cores: int = 1,
                 steer: str = "job", control_token: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.address = tuple(address.tuple if isinstance(address, Endpoint) else address)
        self.control_address = (control.tuple if isinstance(control, Endpoint) else control)
        if self.control_address is not None:  # refused here, before anything is bound
            check_control_address(self.control_address, control_public, control_token)
        self._control_public, self._control_token = control_public, control_token
        if not 1 <= cores <= MAX_SHARDS:
            raise ConfigError(f"cores = {cores}: the switch runs on 1..{MAX_SHARDS} cores")
        if cores > 1 and not native:
            raise ConfigError(f"cores = {cores}: only the C switch (native=True) runs on several cores")
        if steer not in STEERING:
            raise ConfigError(f"steer = {steer!r}: the shards are steered by {' or '.join(STEERING)}")
        if cores > 1 and (batched is False or not BATCHED_AVAILABLE):
            raise ConfigError(f"cores = {cores}: several cores need Linux's batched sockets (SO_REUSEPORT "
                              "and its steering program); use cores=1")
        self.cores, self.steer = cores, steer
        self.model = NativeSwitch(num_slots, cores, steer) if native else SwitchModel(num_slots)
        self.lock = threading.Lock()  # the control operations' (and the pure model's, which has no lock of its own)
        if not 1 <= batch <= RESULTS_KEPT:
            raise ConfigError(f"batch = {batch}: the switch receives 1..{RESULTS_KEPT} packets at a time")
        self._batched, self._batch, self._segmentation = batched, batch, segmentation
        self._sock: UdpSocket | None = None
        self._socks: list[UdpSocket] = []
        self._threads: list[threading.Thread] = []
        self._control: ControlServer | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._clock = clock
        self._leases: dict[int, Lease] = {}  # under self.lock, as the job table
        self._owners: dict[int, Owner] = {}
        self._lease_counts = dict.fromkeys(LEASE_COUNTERS, 0)
        self._leases_changed = threading.Event()  # wakes the lease timer for a new deadline, or to stop

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> SoftSwitch:
        if isinstance(self.model, NativeSwitch):  # results of a whole receive, grouped by worker when sent
            self._socks = shard_sockets(self.address, self.cores, self.steer, batch=OUT_PACKETS, max_datagram=MAX_UDP,
                                        out_bytes=OUT_BYTES, batched=self._batched, segmentation=self._segmentation)
        else:
            self._socks = [UdpSocket(self.address, batch=self._batch, max_datagram=MAX_UDP, batched=self._batched,
                                     segmentation=self._segmentation)]
        self._sock = self._socks[0]
        self.address = self._sock.address
        if self.control_address is not None:
            try:
                self._control = ControlServer(self.control_address, self, public=self._control_public,
                                              token=self._control_token)
            except BaseException:
                self._close_sockets()
                raise
            self.control_address = self._control.address
        self._stop.clear()
        self._threads = [threading.Thread(target=self._serve, args=(shard,), daemon=True,
                                          name="switchagg-switch" + (f"-{shard}" if self.cores > 1 else ""))
                         for shard in range(len(self._socks))]
        self._threads.append(threading.Thread(target=self._keep_leases, daemon=True, name="switchagg-leases"))
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._leases_changed.set()
        for thread in self._threads:
            thread.join()
        self._threads = []
        if self._control is not None:
            self._control.close()
            self._control = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in self._socks:
            sock.close()
        self._socks, self._sock = [], None

    def __enter__(self) -> SoftSwitch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def num_slots(self) -> int:
        """The slot pool every job's slots come from."""
        return self.model.num_slots

    @property
    def backend(self) -> str:
        return self._sock.backend if self._sock else "stopped"

    @property
    def sockets(self) -> list[UdpSocket]:
        """The shards' sockets, shard 0's first (one without ``cores``); empty while stopped."""
        return list(self._socks)

    def _serve(self, shard: int) -> None:
        try:
            if isinstance(self.model, NativeSwitch):
                self._serve_batches(self._socks[shard], self.model, shard)
            else:
                self._serve_model(self._sock, self.model)
        except BaseException as exc:  # surfaced by counters() and the CLI rather than lost
            self.error = exc
            raise

    def _serve_batches(self, sock: UdpSocket, model: NativeSwitch, shard: int) -> None:
        """Datagrams in and packets out as the socket's arrays: no Python object per packet, and a large result's
        values written once for its whole multicast (each packet a header of its own and a body they share).
        The C switch locks what it touches (a control operation waits for the batch), and runs without the
        GIL."""
        while not self._stop.is_set():
            got = sock.recv_packets(0.05)
            start = 0
            while start < got:
                start, made = model.process_batch(sock.in_buf, sock.in_offsets, sock.in_lengths, sock.in_names,
                                                  start, got, sock.out_buf, sock.out_offsets, sock.out_lengths,
                                                  sock.out_names, sock.out_body_offsets, sock.out_body_lengths,
                                                  shard)
                sock.send_packets(made, bodies=True)

    def _serve_model(self, sock: UdpSocket, model: SwitchModel) -> None:
        while not self._stop.is_set():
            packets = sock.recv(0.05)
            for start in range(0, len(packets), self._batch):
                out = []
                with self.lock:
                    for data, src in packets[start:start + self._batch]:
                        for emit in model.process(data, src):
                            head = emit.header.pack()
                            out.append(((head,) if emit.values is None else (head, emit.values), emit.dst))
                if out:
                    sock.send(out)  # `batch` datagrams emit at most `batch` results: their values are still valid

    def _keep_leases(self) -> None:
        """The lease timer: sleeps until the earliest deadline (or a change of the leases) and calls
        :meth:`expire`, which alone decides what lapsed. A fault is kept in ``error``, as a shard's is."""
        try:
            while True:
                self._leases_changed.clear()
                with self.lock:
                    deadlines = [lease.deadline for lease in self._leases.values()]
                self._leases_changed.wait(max(0.0, min(deadlines) - self._clock()) if deadlines else None)
                if self._stop.is_set():
                    return
                self.expire()
        except BaseException as exc:  # surfaced by the CLI and the tests' fixtures rather than lost
            self.error = exc
            raise

    # ---- control ---------------------------------------------------------------------------------

    def add_job(self, config: JobConfig, lease: float | None = None, owner: Owner | None = None) -> int:
        """Install a job; returns its generation (the config's, or a fresh one). With ``lease`` (seconds) the
        job is removed once that long passes without a renewal; ``owner`` is recorded for status."""
        generation = config.generation or new_generation()
        with self.lock:
            granted = None if lease is None else Lease.grant(lease, self._clock())
            self.model.add_job(JobEntry.from_config(config, generation))
            if granted is not None:
                self._leases[config.job_id] = granted
            if owner is not None:
                self._owners[config.job_id] = owner
        self._leases_changed.set()
        return generation

    def remove_job(self, job_id: int) -> None:
        with self.lock:
            self._remove(job_id)

    def _remove(self, job_id: int) -> None:
        """Remove the job and its lease and owner (under self.lock)."""
        self.model.remove_job(job_id)
        self._leases.pop(job_id, None)
        self._owners.pop(job_id, None)

    def renew_job(self, job_id: int) -> float:
        """Renew the job's lease for its whole length again; returns that length (seconds)."""
        with self.lock:
            self.model.table.get(job_id)  # a job that is not installed: the table's error says so
            lease = self._leases.get(job_id)
            if lease is None:
                raise ConfigError(f"job {job_id} holds no lease, so there is nothing to renew: it stays until it "
                                  "is removed (deploy it with a lease to have it expire)")
            self._leases[job_id] = lease.renewed(self._clock())
            self._lease_counts["renewed"] += 1
            return lease.seconds

    def expire(self, now: float | None = None) -> list[int]:
        """Remove every job whose lease has lapsed at ``now`` (by default the switch's clock), clearing its
        slots as ``remove_job`` does, and count them; returns their ids."""
        with self.lock:
            gone = lapsed_jobs(self._leases, self._clock() if now is None else now)
            for job_id in gone:
                self._remove(job_id)
            self._lease_counts["expired"] += len(gone)
        return gone

    def leases(self) -> dict[int, tuple[float, float]]:
        """Each leased job's lease: its length and the seconds left of it."""
        with self.lock:
            now = self._clock()
            return {job: (lease.seconds, lease.left(now)) for job, lease in self._leases.items()}

    def owners(self) -> dict[int, Owner]:
        """The process that deployed each job, where its ``add_job`` said."""
        with self.lock:
            return dict(self._owners)

    def lease_counters(self) -> dict[str, int]:
        """:data:`LEASE_COUNTERS`: leases renewed, and jobs removed because theirs lapsed."""
        with self.lock:
            return dict(self._lease_counts)

    def reset_job(self, job_id: int) -> int:
        """Start a new run of the job: a new generation, old state reads as empty."""
        with self.lock:
            generation = new_generation(self.model.table.get(job_id).generation)
            self.model.set_generation(job_id, generation)
        return generation

    def jobs(self) -> dict[int, JobEntry]:
        with self.lock:
            return dict(self.model.jobs)

    def counters(self) -> dict[str, object]:
        """Every counter, summed over the shards."""
        with self.lock:
            return self.model.counters()

    def shard_stats(self) -> list[dict[str, int]]:
        """Per shard (one with one core; none for the pure model): the datagrams it served, and how many of
        them the steering would have sent elsewhere: those that came inside a message steered by
        another datagram's field (``off_home``; served all the same)."""
        if not isinstance(self.model, NativeSwitch):
            return []  # the pure model counts no datagrams of its own
        with self.lock:
            return self.model.shard_stats()

    def socket_counters(self) -> dict[str, int]:
        """What the switch's sockets dropped before any shard saw it, summed over them: datagrams cut short
        (longer than a receive's room), those of a coalesced message past a receive's room, and sends the
        kernel refused or ICMP errors it reported."""
        socks = list(self._socks)
        return {name: sum(getattr(sock.stats, name) for sock in socks) for name in ("truncated", "dropped", "refused")}

    def slot_state(self, job_id: int, slots: list[int]) -> dict[int, list[dict[str, int | None]]]:
        """Both copies of each of the job's ``slots`` (its own numbers, 0..slot_count - 1)."""
        with self.lock:
            count = self.model.table.get(job_id).slot_count
            outside = [s for s in slots if not 0 <= s < count]
            if outside:  # past them lie another job's registers, or the end of the switch's
                raise ConfigError(f"slots {outside} are outside job {job_id}'s slots 0..{count - 1}")
            return {s: self.model.slot_state(job_id, s) for s in slots}
