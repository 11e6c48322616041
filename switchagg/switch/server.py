"""The embedded software switch: the switch semantics behind a batched UDP socket.

It serves with :class:`NativeSwitch` (the model's rules in C, no Python object per
packet) unless asked for the pure :class:`SwitchModel`, which a test runs end to end.

It is the default target (no hardware, no BMv2) and runs in-process (threads)
or as ``switchagg switch``. An optional control port (TCP, one JSON object per
line, see :mod:`switchagg.switch.control`) lets another process read counters,
reset a job or see which workers a slot still waits for; it listens on loopback
unless ``control_public`` says otherwise.
"""

from __future__ import annotations

import threading

from ..config import Endpoint, JobConfig
from ..errors import ConfigError
from ..jobs import JobEntry, new_generation
from ..transport import MAX_UDP, UdpSocket
from ..wire import UDP_PORT
from .control import ControlServer, check_control_address
from .model import SwitchModel
from .native import NativeSwitch
from .records import RESULTS_KEPT

NUM_SLOTS = 4096  # the pool: four jobs of K = 64 with their default 1024 slots each
OUT_PACKETS = 4096  # packets the C switch writes before they are sent: results of ~1000 contributions
OUT_BYTES = 8 << 20  # ... and their bytes: room for 32 multicasts of the largest datagrams


class SoftSwitch:
    """The software switch; ``with SoftSwitch(...) as sw:`` starts and stops it.

    ``batch`` is how many datagrams the pure model (``native=False``) takes before it sends their
    results: at most :data:`RESULTS_KEPT`, the results whose values it keeps. ``segmentation`` is
    the socket's (:class:`~switchagg.transport.UdpSocket`): None uses GSO/GRO where the kernel has them.
    The control port, where ``control`` names one, must be on loopback unless ``control_public``:
    whoever reaches it reads the counters, and whoever knows a job's key resets or removes the job.
    """

    def __init__(self, address: Endpoint | tuple[str, int] = ("127.0.0.1", UDP_PORT), *,
                 control: Endpoint | tuple[str, int] | None = None, num_slots: int = NUM_SLOTS,
                 batched: bool | None = None, batch: int = 64, native: bool = True,
                 segmentation: bool | None = None, control_public: bool = False) -> None:
        self.address = tuple(address.tuple if isinstance(address, Endpoint) else address)
        self.control_address = (control.tuple if isinstance(control, Endpoint) else control)
        if self.control_address is not None:  # refused here, before anything is bound
            check_control_address(self.control_address, control_public)
        self._control_public = control_public
        self.model = NativeSwitch(num_slots) if native else SwitchModel(num_slots)
        self.lock = threading.Lock()
        if not 1 <= batch <= RESULTS_KEPT:
            raise ConfigError(f"batch = {batch}: the switch receives 1..{RESULTS_KEPT} packets at a time")
        self._batched, self._batch, self._segmentation = batched, batch, segmentation
        self._sock: UdpSocket | None = None
        self._thread: threading.Thread | None = None
        self._control: ControlServer | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> SoftSwitch:
        if isinstance(self.model, NativeSwitch):  # results of a whole receive, grouped by worker when sent
            self._sock = UdpSocket(self.address, batch=OUT_PACKETS, max_datagram=MAX_UDP, out_bytes=OUT_BYTES,
                                   batched=self._batched, segmentation=self._segmentation)
        else:
            self._sock = UdpSocket(self.address, batch=self._batch, max_datagram=MAX_UDP, batched=self._batched,
                                   segmentation=self._segmentation)
        self.address = self._sock.address
        if self.control_address is not None:
            try:
                self._control = ControlServer(self.control_address, self, public=self._control_public)
            except BaseException:
                self._sock.close()
                self._sock = None
                raise
            self.control_address = self._control.address
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name="switchagg-switch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> SoftSwitch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def backend(self) -> str:
        return self._sock.backend if self._sock else "stopped"

    def _serve(self) -> None:
        try:
            if isinstance(self.model, NativeSwitch):
                self._serve_batches(self._sock, self.model)
            else:
                self._serve_model(self._sock, self.model)
        except BaseException as exc:  # surfaced by counters() and the CLI rather than lost
            self.error = exc
            raise

    def _serve_batches(self, sock: UdpSocket, model: NativeSwitch) -> None:
        """Datagrams in and packets out as the socket's arrays: no Python object per packet."""
        while not self._stop.is_set():
            got = sock.recv_packets(0.05)
            with self.lock:
                start = 0
                while start < got:
                    start, made = model.process_batch(sock.in_buf, sock.in_offsets, sock.in_lengths, sock.in_names,
                                                      start, got, sock.out_buf, sock.out_offsets, sock.out_lengths,
                                                      sock.out_names)
                    sock.send_packets(made)

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

    # ---- control ---------------------------------------------------------------------------------

    def add_job(self, config: JobConfig) -> int:
        """Install a job; returns its generation (the config's, or a fresh one)."""
        generation = config.generation or new_generation()
        with self.lock:
            self.model.add_job(JobEntry.from_config(config, generation))
        return generation

    def remove_job(self, job_id: int) -> None:
        with self.lock:
            self.model.remove_job(job_id)

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
        with self.lock:
            return self.model.counters()

    def slot_state(self, job_id: int, slots: list[int]) -> dict[int, list[dict[str, int | None]]]:
        """Both copies of each of the job's ``slots`` (its own numbers, 0..slot_count - 1)."""
        with self.lock:
            count = self.model.table.get(job_id).slot_count
            outside = [s for s in slots if not 0 <= s < count]
            if outside:  # past them lie another job's registers, or the end of the switch's
                raise ConfigError(f"slots {outside} are outside job {job_id}'s slots 0..{count - 1}")
            return {s: self.model.slot_state(job_id, s) for s in slots}
