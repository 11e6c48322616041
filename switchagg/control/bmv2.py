"""Install, reset, remove and watch jobs on BMv2 over P4Runtime (p4runtime-shell).

p4runtime-shell keeps one process-wide client and calls ``sys.exit`` on some
errors; :class:`P4RuntimeSession` is the boundary: one session at a time, and
every exit or gRPC failure comes out as a :class:`SwitchAggError` that says what
to check. The job config is the workers' own file, with two more things per
worker for the switch: ``mac`` and ``switch_port``.
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from ..config import JobConfig, WorkerSpec
from ..errors import ConfigError, SwitchAggError
from ..switch.counters import GlobalDrop, JobCounter
from ..switch.server import new_generation
from ..wire import HEADER_SIZE, P4_VALUES_PER_PACKET, UDP_PORT, VERSION, PacketType
from .build import Pipeline
from .frames import mac_bytes, udp_headers

MAX_JOBS = 64  # SA_MAX_JOBS in p4/include/constants.p4
NUM_SLOTS = 1024  # SA_NUM_SLOTS
FLOOD_GROUP = 1000  # SA_FLOOD_GROUP
BROADCAST = "ff:ff:ff:ff:ff:ff"
ADMISSION = "SaIngress.admission.admission"
REPLICA = "SaEgress.replica"
L2 = "SaIngress.forwarding.l2"
_lock = threading.Lock()


class P4RuntimeSession:
    """The p4runtime-shell client, held for one ``with`` block."""

    def __init__(self, grpc_addr: str, device_id: int = 0, pipeline: Pipeline | None = None) -> None:
        self.grpc_addr, self.device_id, self.pipeline = grpc_addr, device_id, pipeline

    def __enter__(self) -> Any:
        try:
            import p4runtime_sh.shell as sh
        except ImportError:
            raise SwitchAggError("p4runtime-shell is not installed: pip install 'switchagg[p4]'") from None
        _lock.acquire()
        config = None
        if self.pipeline is not None:
            config = sh.FwdPipeConfig(str(self.pipeline.p4info), str(self.pipeline.json))
        try:
            with _no_exit(f"connecting to BMv2 at {self.grpc_addr} (device {self.device_id})"):
                sh.setup(device_id=self.device_id, grpc_addr=self.grpc_addr, election_id=(0, 1), config=config,
                         verbose=False)
        except BaseException:
            _lock.release()
            raise
        self.sh = sh
        return sh

    def __exit__(self, *exc: object) -> None:
        try:
            self.sh.teardown()
        finally:
            _lock.release()


@contextmanager
def _no_exit(what: str) -> Iterator[None]:
    try:
        yield
    except SystemExit as exc:
        raise SwitchAggError(f"{what} failed (p4runtime-shell gave up, code {exc.code}): is simple_switch_grpc "
                             "running there, with the switchagg pipeline pushed?") from None
    except SwitchAggError:
        raise
    except Exception as exc:  # grpc.RpcError and p4runtime-shell's own errors
        raise SwitchAggError(f"{what} failed: {exc}") from None


def _check_config(cfg: JobConfig) -> None:
    if cfg.values_per_packet != P4_VALUES_PER_PACKET:
        raise ConfigError(f"job.values_per_packet = {cfg.values_per_packet}: the P4 program sums "
                          f"{P4_VALUES_PER_PACKET} values per packet, set it to that")
    if cfg.switch.port != UDP_PORT:
        raise ConfigError(f"switch.address = '{cfg.switch.host}:{cfg.switch.port}': the P4 program takes "
                          f"switchagg packets on UDP port {UDP_PORT}, write '{cfg.switch.host}:{UDP_PORT}'")
    if cfg.slot_base + cfg.slot_count > NUM_SLOTS:
        raise ConfigError(f"job slots end at {cfg.slot_base + cfg.slot_count - 1}; the P4 program has "
                          f"{NUM_SLOTS} slots")
    missing = [r for r, w in enumerate(cfg.workers) if w.mac is None or w.switch_port is None]
    if missing:
        raise ConfigError(f"workers {missing} need 'mac' and 'switch_port' for the P4 target")


def _admission_entries(sh: Any) -> list[Any]:
    return list(sh.TableEntry(ADMISSION).read())


def _param(entry: Any, name: str) -> int:
    """An action parameter of an entry read back (p4runtime-shell gives the protobuf Param)."""
    return int.from_bytes(entry.action[name].value, "big")


class JobParams(NamedTuple):
    """What admission gives an admitted packet: the admit action's ``job`` parameter, packed as the P4
    program keeps it (``hdr.local.job`` in p4/include/metadata.p4), so that admission writes one field."""

    slot_count: int
    group: int  # the job's multicast group: its index among the deployed jobs + 1
    n_workers: int
    generation: int

    def pack(self) -> int:
        return self.slot_count << 48 | self.group << 40 | self.n_workers << 32 | self.generation

    @classmethod
    def of(cls, entry: Any) -> JobParams:
        """The parameters of an admission entry read back."""
        job = _param(entry, "job")
        return cls(job >> 48, job >> 40 & 0xFF, job >> 32 & 0xFF, job & 0xFFFFFFFF)


def _match(entry: Any, name: str) -> int:
    """An exact match field of an entry read back, as an integer."""
    return int.from_bytes(entry.match[name].exact.value, "big")


def _deployed_entries(sh: Any, cfg: JobConfig, grpc_addr: str) -> list[Any]:
    """The job's admission entries; a job that is not there is an error that says so."""
    entries = [e for e in _admission_entries(sh) if _match(e, "hdr.sa.job") == cfg.job_id]
    if not entries:
        raise ConfigError(f"job {cfg.job_id} is not deployed on {grpc_addr}")
    return entries


def deploy(cfg: JobConfig, grpc_addr: str, *, device_id: int = 0, pipeline: str | None = None) -> int:
    """Install a job: admission entries, its multicast group, egress rewrites, L2 entries. Returns its generation."""
    _check_config(cfg)
    from .build import build

    pipe = build(pipeline) if pipeline else None
    with P4RuntimeSession(grpc_addr, device_id, pipe) as sh, _no_exit(f"deploying job {cfg.job_id}"):
        existing = _admission_entries(sh)
        used: dict[int, tuple[int, int, int]] = {}
        for e in existing:
            params = JobParams.of(e)
            used[_match(e, "hdr.sa.job")] = (params.group - 1, _param(e, "slot_base"), params.slot_count)
        if cfg.job_id in used:
            raise ConfigError(f"job {cfg.job_id} is already deployed: undeploy it, or reset it for a new run")
        for job, (_, base, count) in used.items():
            if cfg.slot_base < base + count and base < cfg.slot_base + cfg.slot_count:
                raise ConfigError(f"job {cfg.job_id}'s slots {cfg.slot_base}..{cfg.slot_base + cfg.slot_count - 1} "
                                  f"overlap job {job}'s {base}..{base + count - 1}: give it another slot_base")
        free = sorted(set(range(MAX_JOBS)) - {i for i, _, _ in used.values()})
        if not free:
            raise ConfigError(f"the switch already runs {MAX_JOBS} jobs: undeploy one first")
        index = free[0]
        generation = cfg.generation or new_generation()
        _install_l2(sh, cfg)
        group = sh.MulticastGroupEntry(index + 1)
        for rank, (w, instance) in enumerate(zip(cfg.workers, replica_instances(cfg), strict=True)):
            group.add(w.switch_port, instance)
            rw = sh.TableEntry(REPLICA)(action="SaEgress.to_worker")
            rw.match["std.mcast_grp"] = str(index + 1)
            rw.match["std.egress_port"] = str(w.switch_port)
            rw.match["std.egress_rid"] = str(instance)
            rw.action["head"] = str(_result_head(cfg, w))
            rw.action["version_type_worker"] = str(VERSION << 24 | PacketType.RESULT << 16 | rank)
            rw.insert()
        group.insert()
        for rank in range(cfg.n_workers):
            _admission_entry(sh, cfg, rank, index, generation).insert()
    return generation


def replica_instances(cfg: JobConfig) -> list[int]:
    """Each worker's multicast instance: how many of the job's workers come before it on its port.

    A replica is (port, instance), and BMv2 keeps one PRE node per instance, scanning all its ports
    for every packet; with one worker per port (the usual case) the whole group is one node.
    """
    seen: dict[int, int] = {}
    instances = []
    for w in cfg.workers:
        instances.append(seen.get(w.switch_port, 0))
        seen[w.switch_port] = instances[-1] + 1
    return instances


def _admission_entry(sh: Any, cfg: JobConfig, rank: int, index: int, generation: int) -> Any:
    """Worker ``rank``'s entry: the job's id, the worker, its source address and the job's key."""
    w = cfg.workers[rank]
    e = sh.TableEntry(ADMISSION)(action="SaIngress.admission.admit")
    e.match["sa_valid"] = "1"
    e.match["hdr.sa.job"] = str(cfg.job_id)
    e.match["worker"] = str(rank)
    e.match["source"] = str(int(ipaddress.IPv4Address(w.address.host)) << 96 | w.address.port << 48)
    e.match["hdr.sa.key"] = str(cfg.key)
    e.action["slot_base"] = str(cfg.slot_base)
    e.action["job"] = str(JobParams(cfg.slot_count, index + 1, cfg.n_workers, generation).pack())
    return e


def _install_l2(sh: Any, cfg: JobConfig) -> None:
    """Hosts reach each other (and ARP works): one entry per worker MAC; broadcast floods to every host port."""
    entries = list(sh.TableEntry(L2).read())
    ports = {_param(e, "port") for e in entries if e.action.action_name.endswith("to_port")}
    present = {_match(e, "eth_dst") >> 288 for e in entries}
    first = not entries
    for w in cfg.workers:
        if _mac_int(w.mac) in present:
            continue
        e = sh.TableEntry(L2)(action="SaIngress.forwarding.to_port")
        e.match["eth_dst"] = str(_mac_int(w.mac) << 288)
        e.action["port"] = str(w.switch_port)
        e.insert()
        present.add(_mac_int(w.mac))
        ports.add(w.switch_port)
    if _mac_int(BROADCAST) not in present:
        e = sh.TableEntry(L2)(action="SaIngress.forwarding.flood")
        e.match["eth_dst"] = str(_mac_int(BROADCAST) << 288)
        e.insert()
    flood = sh.MulticastGroupEntry(FLOOD_GROUP)
    for port in sorted(ports):
        flood.add(port, 0)
    (flood.insert if first else flood.modify)()


def _result_head(cfg: JobConfig, w: WorkerSpec) -> int:
    """A result's Ethernet, IPv4 and UDP headers to worker ``w`` as egress writes them (``outer.head``), but
    for the Ethernet source (zero here), which egress fills in with the address the sum was sent to."""
    head = udp_headers(w.mac, "00:00:00:00:00:00", (cfg.switch.host, cfg.switch.port), (w.address.host, w.address.port),
                       HEADER_SIZE + 4 * P4_VALUES_PER_PACKET)
    return int.from_bytes(head, "big")


def _mac_int(mac: str) -> int:
    return int.from_bytes(mac_bytes(mac), "big")


def reset_job(cfg: JobConfig, grpc_addr: str, *, device_id: int = 0) -> int:
    """A new run of the job: every admission entry gets a fresh generation; no register is touched."""
    with P4RuntimeSession(grpc_addr, device_id) as sh, _no_exit(f"resetting job {cfg.job_id}"):
        entries = _deployed_entries(sh, cfg, grpc_addr)
        params = JobParams.of(entries[0])
        generation = new_generation(params.generation)
        for e in entries:
            e.action["job"] = str(params._replace(generation=generation).pack())
            e.modify()
    return generation


def undeploy(cfg: JobConfig, grpc_addr: str, *, device_id: int = 0) -> None:
    with P4RuntimeSession(grpc_addr, device_id) as sh, _no_exit(f"removing job {cfg.job_id}"):
        entries = _deployed_entries(sh, cfg, grpc_addr)
        group = JobParams.of(entries[0]).group
        for e in entries:
            e.delete()
        for e in sh.TableEntry(REPLICA).read():
            if _match(e, "std.mcast_grp") == group:
                e.delete()
        sh.MulticastGroupEntry(group).delete()


def _counter(sh: Any, name: str, index: int) -> int:
    entry = sh.CounterEntry(name)
    entry.index = int(index)
    return sum(c.data.packet_count for c in entry.read())


def read_status(cfg: JobConfig, grpc_addr: str, *, device_id: int = 0) -> dict[str, Any]:
    """The same shape as the embedded switch's status: jobs, and counters by name."""
    with P4RuntimeSession(grpc_addr, device_id) as sh, _no_exit("reading counters"):
        status: dict[str, Any] = {"jobs": {}, "counters": {"global": {}, "jobs": {}}}
        for d in GlobalDrop:
            status["counters"]["global"][d.name.lower()] = _counter(sh, "SaIngress.global_drops", d)
        jobs: dict[int, list[Any]] = {}
        for e in _admission_entries(sh):
            jobs.setdefault(_match(e, "hdr.sa.job"), []).append(e)
        for job, entries in jobs.items():
            params = JobParams.of(entries[0])
            status["jobs"][str(job)] = {
                "generation": params.generation, "slot_base": _param(entries[0], "slot_base"),
                "slot_count": params.slot_count, "workers": [None] * len(entries)}
            status["counters"]["jobs"][str(job)] = {
                c.name.lower(): _counter(sh, f"SaIngress.admission.aggregation.job_{c.name.lower()}", job)
                for c in JobCounter}
        return status
