"""The BMv2 target: install, reset, remove and watch jobs on simple_switch_grpc over P4Runtime.

p4runtime-shell keeps one process-wide client and calls ``sys.exit`` on some
errors; :class:`P4RuntimeSession` is the boundary: one session at a time, and
every exit or gRPC failure comes out as a :class:`SwitchAggError` that says what
to check. The job config is the workers' own file, with two more things per
worker for the switch: ``mac`` and ``switch_port``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from ..config import JobConfig
from ..errors import ConfigError, SwitchAggError
from ..jobs import GlobalDrop, JobCounter, JobEntry, JobStatus, JobTable, named_counters, new_generation
from ..wire import VERSION, PacketType
from .base import Target, TargetOptions, UnsupportedOperation
from .p4c import Pipeline, build
from .p4job import (
    FLOOD_GROUP,
    MAX_JOBS,
    NUM_SLOTS,
    PARENT_FLAG,
    Admission,
    JobParams,
    ParentAdmission,
    check_config,
    free_group,
    job_entry,
    l2_update,
    plan,
)

ADMISSION = "SaIngress.admission.admission"
ADMIT, ADMIT_RESULT = "SaIngress.admission.admit", "SaIngress.admission.admit_result"
REPLICA = "SaEgress.replica"
BRANCHES = ("SaIngress.admission.aggregation.branch.branch", "SaEgress.branch.branch")  # one in each pipeline
L2 = "SaIngress.forwarding.l2"
TYPE_BIT_0 = 1 << 16  # the admission key's worker field: type bit 0, 1 for a worker's packets, 0 for a RESULT
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


def _param(entry: Any, name: str) -> int:
    """An action parameter of an entry read back (p4runtime-shell gives the protobuf Param)."""
    return int.from_bytes(entry.action[name].value, "big")


def _match(entry: Any, name: str) -> int:
    """An exact match field of an entry read back, as an integer."""
    return int.from_bytes(entry.match[name].exact.value, "big")


def _admission_entry(sh: Any, row: Admission | ParentAdmission) -> Any:
    """A worker's entry (the job's id, the worker, its source address in ``outer.head``, the job's key), or a
    parent's (its job, this switch's index, its address and key), told apart by type bit 0 in the worker field."""
    parent = isinstance(row, ParentAdmission)
    e = sh.TableEntry(ADMISSION)(action=ADMIT_RESULT if parent else ADMIT)
    e.match["sa_valid"] = "1"
    e.match["hdr.sa.job"] = str(row.job_id)
    e.match["worker"] = str(row.worker if parent else TYPE_BIT_0 | row.worker)
    e.match["source"] = str(row.ip << 96 | row.port << 48)
    e.match["hdr.sa.key"] = str(row.key)
    e.action["slot_base"] = str(row.slot_base)
    e.action["job"] = str(row.params.pack())
    if parent:
        e.action["job_id"] = str(row.own_job)
        e.action["key"] = str(row.own_key)
    else:
        e.action["owners"] = str(row.owners)
    return e


def _admission_row(entry: Any) -> Admission:
    source = _match(entry, "source")
    return Admission(_match(entry, "hdr.sa.job"), _match(entry, "worker") & ~TYPE_BIT_0, source >> 96,
                     source >> 48 & 0xFFFF, _match(entry, "hdr.sa.key"), _param(entry, "slot_base"),
                     JobParams.unpack(_param(entry, "job")), _param(entry, "owners"))


def _install_l2(sh: Any, hosts: list[tuple[int, int]]) -> None:
    """The L2 entries and flood group of :func:`~switchagg.targets.p4job.l2_update`."""
    present = {_match(e, "eth_dst") >> 288: _param(e, "port") if e.action.action_name.endswith("to_port") else None
               for e in sh.TableEntry(L2).read()}
    update = l2_update(present, hosts)
    for mac, port in update.add:
        e = sh.TableEntry(L2)(action="SaIngress.forwarding.flood" if port is None else "SaIngress.forwarding.to_port")
        e.match["eth_dst"] = str(mac << 288)
        if port is not None:
            e.action["port"] = str(port)
        e.insert()
    flood = sh.MulticastGroupEntry(FLOOD_GROUP)
    for port in update.flood_ports:
        flood.add(port, 0)
    (flood.insert if update.first else flood.modify)()


def _deployed(sh: Any) -> dict[int, tuple[list[Any], list[Admission]]]:
    """Every deployed job's workers' admission entries, as read and as rows, by job id."""
    jobs: dict[int, tuple[list[Any], list[Admission]]] = {}
    for e in sh.TableEntry(ADMISSION).read():
        if e.action.action_name == ADMIT_RESULT:
            continue
        row = _admission_row(e)
        entries, rows = jobs.setdefault(row.job_id, ([], []))
        entries.append(e)
        rows.append(row)
    return jobs


def _check_uplink_free(sh: Any, parent: ParentAdmission) -> None:
    """Refuse a level of a tree whose parent's RESULTs another job here already takes (the same parent job, index,
    address and key): the parent's RESULTs would reach one job alone."""
    mine = (parent.job_id, parent.worker, parent.ip << 96 | parent.port << 48, parent.key)
    for e in sh.TableEntry(ADMISSION).read():
        if e.action.action_name == ADMIT_RESULT and (
                _match(e, "hdr.sa.job"), _match(e, "worker"), _match(e, "source"), _match(e, "hdr.sa.key")) == mine:
            raise ConfigError(f"job {_param(e, 'job_id')} on this switch already takes the RESULTs of job "
                              f"{parent.job_id} as its child {parent.worker}: give job {parent.own_job} another "
                              "[parent] index (or key), or undeploy that job first")


def _job_counter(event: JobCounter) -> str:
    """The counter array of a per-job event, indexed by the job's id (aggregation.p4)."""
    return f"SaIngress.admission.aggregation.job_{event.name.lower()}"


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
        """At ``--address``, else the job file's ``[switch] control`` (every level of a tree file names its own),
        else 127.0.0.1:9559."""
        config = options.config
        control = str(config.control) if config is not None and config.control is not None else None
        return cls(options.address or control or "127.0.0.1:9559", options.device_id or 0, options.pipeline)

    @classmethod
    def build(cls, out_dir: Path) -> dict[str, Path]:
        pipeline = build(out_dir)
        return {"BMv2 JSON": pipeline.json, "P4Info": pipeline.p4info}

    def _session(self, pipeline: Pipeline | None = None) -> P4RuntimeSession:
        return P4RuntimeSession(self.grpc_addr, self.device_id, pipeline)

    def check(self, job: JobConfig) -> None:
        check_config(job, trees=True)

    def deploy(self, job: JobConfig, lease: float | None = None) -> int:
        """Install a job: admission entries, its multicast group, egress rewrites, owner branches, L2 entries; a
        level of a tree also its parent's admission entry and its uplink group. No lease (BMv2's control plane
        here runs no timer): one given is refused, see :meth:`renew`."""
        if lease is not None:
            raise UnsupportedOperation(self._no_leases())
        check_config(job, trees=True)
        pipe = build(self.pipeline) if self.pipeline else None
        with self._session(pipe) as sh, _no_exit(f"deploying job {job.job_id}"):
            deployed = _deployed(sh)
            table = JobTable(NUM_SLOTS, MAX_JOBS, [job_entry(rows) for _, rows in deployed.values()])
            generation = job.generation or new_generation()
            table.check(JobEntry.from_config(job, generation))
            rows = plan(job, free_group([rows[0].params for _, rows in deployed.values()], MAX_JOBS), generation,
                        trees=True)
            if rows.parent is not None:
                _check_uplink_free(sh, rows.parent)
            _install_l2(sh, rows.hosts)
            group = sh.MulticastGroupEntry(rows.replicas[0].group)
            for r in rows.replicas:
                group.add(r.port, r.instance)
                rw = sh.TableEntry(REPLICA)(action="SaEgress.to_worker")
                rw.match["std.mcast_grp"] = str(r.group)
                rw.match["std.egress_port"] = str(r.port)
                rw.match["std.egress_rid"] = str(r.instance)
                rw.action["head"] = str(int.from_bytes(r.headers(), "big"))
                rw.action["version_type_worker"] = str(VERSION << 24 | PacketType.RESULT << 16 | r.worker)
                rw.insert()
            group.insert()
            if (up := rows.uplink) is not None:
                rw = sh.TableEntry(REPLICA)(action="SaEgress.to_parent")
                rw.match["std.mcast_grp"] = str(up.group)
                rw.match["std.egress_port"] = str(up.port)
                rw.match["std.egress_rid"] = "0"
                rw.action["head"] = str(int.from_bytes(up.headers(), "big"))
                rw.action["version_type_worker"] = str(up.version_type_worker())
                rw.action["job"] = str(up.job_id)
                rw.action["key"] = str(up.key)
                rw.insert()
                sh.MulticastGroupEntry(up.group).add(up.port, 0).insert()
            for table in BRANCHES:
                for b in rows.branches:
                    e = sh.TableEntry(table)(action=table.rsplit(".", 1)[0] + ".ranks")
                    e.match["hdr.sa.job"] = str(b.job_id)
                    e.match["worker"] = str(b.worker)
                    e.action["base"] = str(b.base)
                    e.action["span"] = str(b.span)
                    e.insert()
            for row in rows.admission:
                _admission_entry(sh, row).insert()
            if rows.parent is not None:
                _admission_entry(sh, rows.parent).insert()
        return generation

    def reset(self, job_id: int) -> int:
        """A new run of the job: every worker's admission entry gets a fresh generation; no register is touched.
        A tree level's parent entry keeps its parameters (where a worker's have the generation, it has the owner
        limit: a RESULT carries its run's generation)."""
        with self._session() as sh, _no_exit(f"resetting job {job_id}"):
            entries, rows = self._job(sh, job_id)
            generation = new_generation(rows[0].params.generation)
            for e, row in zip(entries, rows, strict=True):
                e.action["job"] = str(row.params._replace(generation=generation).pack())
                e.modify()
        return generation

    def undeploy(self, job_id: int) -> None:
        """Remove every entry of the job and zero its counters; its registers stay as they are (P4Runtime writes
        none on BMv2), which no later job reads: the tag keeps every run's state apart."""
        with self._session() as sh, _no_exit(f"removing job {job_id}"):
            entries, rows = self._job(sh, job_id)
            for e in entries:
                e.delete()
            for e in sh.TableEntry(ADMISSION).read():
                if e.action.action_name == ADMIT_RESULT and _param(e, "job_id") == job_id:
                    e.delete()
            params = rows[0].params
            groups = {params.group, params.group | PARENT_FLAG} if params.parent else {params.group}
            for e in sh.TableEntry(REPLICA).read():
                if _match(e, "std.mcast_grp") in groups:
                    e.delete()
            for group in groups:
                sh.MulticastGroupEntry(group).delete()
            for table in BRANCHES:
                for e in sh.TableEntry(table).read():
                    if _match(e, "hdr.sa.job") == job_id:
                        e.delete()
            for c in JobCounter:  # the job's counters (by its id) start again from 0 for the next job of that id
                entry = sh.CounterEntry(_job_counter(c))
                entry.index = job_id
                entry.packet_count = 0
                entry.modify()

    def capacity(self) -> tuple[int, int | None]:
        return NUM_SLOTS, MAX_JOBS

    def jobs(self) -> dict[int, tuple[int, int]]:
        """The deployed jobs' slot ranges, read back from the admission table (a table read, not a register)."""
        with self._session() as sh, _no_exit("reading the deployed jobs"):
            return {j: (rows[0].slot_base, rows[0].params.slot_count) for j, (_, rows) in _deployed(sh).items()}

    def status(self, job_id: int) -> JobStatus:
        """Counters read over P4Runtime (BMv2 reads no registers there: none are needed)."""
        with self._session() as sh, _no_exit("reading counters"):
            drops, _ = named_counters([_counter(sh, "SaIngress.global_drops", d) for d in GlobalDrop], None)
            deployed = _deployed(sh).get(job_id)
            if deployed is None:
                return JobStatus(self.name, job_id, False, global_drops=drops)
            counts = [_counter(sh, _job_counter(c), job_id) for c in JobCounter]
            return JobStatus.of(self.name, job_entry(deployed[1]), named_counters(counts, counts)[1], drops)

    def _job(self, sh: Any, job_id: int) -> tuple[list[Any], list[Admission]]:
        """A deployed job's entries; a job that is not there is an error that says so."""
        deployed = _deployed(sh).get(job_id)
        if deployed is None:
            raise ConfigError(f"job {job_id} is not deployed on {self.grpc_addr}")
        return deployed
