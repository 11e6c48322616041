"""The BMv2 target: install, reset, remove and watch jobs on simple_switch_grpc over P4Runtime.

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
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from ..config import JobConfig, WorkerSpec
from ..errors import ConfigError, SwitchAggError
from ..frames import mac_bytes, udp_headers
from ..jobs import GlobalDrop, JobCounter, JobEntry, JobStatus, JobTable, named_counters, new_generation
from ..wire import HEADER_SIZE, P4_VALUES_PER_PACKET, UDP_PORT, VERSION, PacketType
from .base import Target, TargetOptions
from .p4c import Pipeline, build

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


def _deployed(sh: Any) -> dict[int, tuple[list[Any], JobParams]]:
    """Every deployed job's admission entries and parameters, by job id."""
    jobs: dict[int, list[Any]] = {}
    for e in _admission_entries(sh):
        jobs.setdefault(_match(e, "hdr.sa.job"), []).append(e)
    return {job: (entries, JobParams.of(entries[0])) for job, entries in jobs.items()}


def _entry(job: int, entries: list[Any], params: JobParams) -> JobEntry:
    """A deployed job as the job table holds it, from its admission entries."""
    workers = [("", 0)] * len(entries)
    for e in entries:
        source = _match(e, "source")
        workers[_match(e, "worker")] = (str(ipaddress.IPv4Address(source >> 96)), source >> 48 & 0xFFFF)
    return JobEntry(job, params.generation, _match(entries[0], "hdr.sa.key"), _param(entries[0], "slot_base"),
                    params.slot_count, P4_VALUES_PER_PACKET, tuple(workers))


def _counter(sh: Any, name: str, index: int) -> int:
    entry = sh.CounterEntry(name)
    entry.index = int(index)
    return sum(c.data.packet_count for c in entry.read())


class Bmv2Target(Target):
    """simple_switch_grpc at ``grpc_addr`` (device ``device_id``), running ``p4/v1model``."""

    name: ClassVar[str] = "bmv2"
    summary: ClassVar[str] = "BMv2 (simple_switch_grpc) over P4Runtime, default address 127.0.0.1:9559"

    def __init__(self, grpc_addr: str = "127.0.0.1:9559", device_id: int = 0, pipeline: str | None = None) -> None:
        self.grpc_addr, self.device_id, self.pipeline = grpc_addr, device_id, pipeline

    @classmethod
    def open(cls, options: TargetOptions) -> Bmv2Target:
        return cls(options.address or "127.0.0.1:9559", options.device_id, options.pipeline)

    @classmethod
    def build(cls, out_dir: Path) -> dict[str, Path]:
        pipeline = build(out_dir)
        return {"BMv2 JSON": pipeline.json, "P4Info": pipeline.p4info}

    def _session(self, pipeline: Pipeline | None = None) -> P4RuntimeSession:
        return P4RuntimeSession(self.grpc_addr, self.device_id, pipeline)

    def deploy(self, job: JobConfig) -> int:
        """Install a job: admission entries, its multicast group, egress rewrites, L2 entries."""
        _check_config(job)
        pipe = build(self.pipeline) if self.pipeline else None
        with self._session(pipe) as sh, _no_exit(f"deploying job {job.job_id}"):
            deployed = _deployed(sh)
            table = JobTable(NUM_SLOTS, MAX_JOBS, [_entry(j, *d) for j, d in deployed.items()])
            generation = job.generation or new_generation()
            table.check(JobEntry.from_config(job, generation))
            index = min(set(range(MAX_JOBS)) - {params.group - 1 for _, params in deployed.values()})
            _install_l2(sh, job)
            group = sh.MulticastGroupEntry(index + 1)
            for rank, (w, instance) in enumerate(zip(job.workers, replica_instances(job), strict=True)):
                group.add(w.switch_port, instance)
                rw = sh.TableEntry(REPLICA)(action="SaEgress.to_worker")
                rw.match["std.mcast_grp"] = str(index + 1)
                rw.match["std.egress_port"] = str(w.switch_port)
                rw.match["std.egress_rid"] = str(instance)
                rw.action["head"] = str(_result_head(job, w))
                rw.action["version_type_worker"] = str(VERSION << 24 | PacketType.RESULT << 16 | rank)
                rw.insert()
            group.insert()
            for rank in range(job.n_workers):
                _admission_entry(sh, job, rank, index, generation).insert()
        return generation

    def reset(self, job_id: int) -> int:
        """A new run of the job: every admission entry gets a fresh generation; no register is touched."""
        with self._session() as sh, _no_exit(f"resetting job {job_id}"):
            entries, params = self._job(sh, job_id)
            generation = new_generation(params.generation)
            for e in entries:
                e.action["job"] = str(params._replace(generation=generation).pack())
                e.modify()
        return generation

    def undeploy(self, job_id: int) -> None:
        with self._session() as sh, _no_exit(f"removing job {job_id}"):
            entries, params = self._job(sh, job_id)
            for e in entries:
                e.delete()
            for e in sh.TableEntry(REPLICA).read():
                if _match(e, "std.mcast_grp") == params.group:
                    e.delete()
            sh.MulticastGroupEntry(params.group).delete()

    def status(self, job_id: int) -> JobStatus:
        """Counters read over P4Runtime (BMv2 reads no registers there: none are needed)."""
        with self._session() as sh, _no_exit("reading counters"):
            drops, _ = named_counters([_counter(sh, "SaIngress.global_drops", d) for d in GlobalDrop], None)
            deployed = _deployed(sh).get(job_id)
            if deployed is None:
                return JobStatus(self.name, job_id, False, global_drops=drops)
            counts = [_counter(sh, f"SaIngress.admission.aggregation.job_{c.name.lower()}", job_id)
                      for c in JobCounter]
            return JobStatus.of(self.name, _entry(job_id, *deployed), named_counters(counts, counts)[1], drops)

    def _job(self, sh: Any, job_id: int) -> tuple[list[Any], JobParams]:
        """A deployed job's entries; a job that is not there is an error that says so."""
        deployed = _deployed(sh).get(job_id)
        if deployed is None:
            raise ConfigError(f"job {job_id} is not deployed on {self.grpc_addr}")
        return deployed
