"""The Tofino targets: install, reset, remove and watch jobs on bf_switchd over BfRt, and compile
``p4/tna`` for Tofino 1 (``tofino``) and Tofino 2 (``tofino2``).

What a job needs is :mod:`~switchagg.targets.p4job`'s plan, as for BMv2; the layout the rows
serve (stages, passes, registers) is in ``docs/tofino.md``. The names below are the compiled
program's, as ``bfrt.json`` spells them; ``tests/test_tofino.py`` holds every one of them to the
``bfrt.json`` the compiler wrote, so a rename in the P4 cannot silently break a deployment.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from ..config import JobConfig
from ..errors import ConfigError
from ..jobs import GlobalDrop, JobCounter, JobEntry, JobStatus, JobTable, named_counters, new_generation
from ..wire import MAX_WORKERS  # rids are (group - 1) * MAX_WORKERS + rank + 1
from .base import Target, TargetOptions, UnsupportedOperation
from .bfrt import BfrtSession, Row, TableSession
from .p4job import (
    FLOOD_GROUP,
    JOB_COUNTER_STRIDE,
    MAX_JOBS,
    NUM_SLOTS,
    PARENT_FLAG,
    Admission,
    JobParams,
    ParentAdmission,
    Uplink,
    check_config,
    free_group,
    job_entry,
    l2_update,
    plan,
)
from .tofino_build import Chip, build, resources

PORTS_PER_PIPE = 128
PORT_MASK = 0x1FF  # a port id's 9 bits: the parser value set matches them all

ADMISSION = "pipe.SaIngress.admission.admission"
ADMIT = "SaIngress.admission.admit"
ADMIT_RESULT = "SaIngress.admission.admit_result"  # trees: a level's parent's RESULTs
REPLICA = "pipe.SaEgress.replica"
TO_WORKER = "SaEgress.to_worker"
TO_PARENT = "SaEgress.to_parent"  # trees: the one replica of a level's uplink group
L2 = "pipe.SaIngress.forwarding.l2"
TO_PORT = "SaIngress.forwarding.to_port"
FLOOD = "SaIngress.forwarding.flood"
RECIRCULATION_PORTS = "pipe.SaIngressParser.recirculation_ports"
GLOBAL_DROPS = "pipe.SaIngress.global_drops"
JOB_COUNTERS = "pipe.SaIngress.job_counters"
PRE_NODE = "$pre.node"  # the SDE's fixed tables of the packet replication engine
PRE_MGID = "$pre.mgid"

Tables = dict[str, tuple[tuple[str, ...], dict[str | None, tuple[str, ...]]]]
_ADMISSION_KEY = ("job", "worker", "src_addr", "src_port", "key")
_ADMIT = ("job_index", "slot_base", "slot_count", "generation", "worker_bit", "other_workers", "all_workers",
          "recirc_port")
_TO_WORKER = ("eth_dst", "ip_src", "ip_dst", "udp_dst", "worker")
# What the control plane writes, as bfrt.json must have it: table -> (key fields, {action: parameters}).
# Counters and parser value sets have their data fields instead of actions.
TABLES: Tables = {
    ADMISSION: (_ADMISSION_KEY, {ADMIT: _ADMIT}),
    REPLICA: (("rid",), {TO_WORKER: _TO_WORKER}),
    L2: (("eth_dst",), {TO_PORT: ("port",), FLOOD: ()}),
    RECIRCULATION_PORTS: (("f1",), {None: ()}),
    GLOBAL_DROPS: (("$COUNTER_INDEX",), {None: ("$COUNTER_SPEC_PKTS",)}),
    JOB_COUNTERS: (("$COUNTER_INDEX",), {None: ("$COUNTER_SPEC_PKTS",)}),
}
# The program that serves trees (SA_TREES: Chip.trees): the admission key holds the type's bit 0 (1 for a
# worker's packets, 0 for a parent's RESULT), admit the parent's bit, and the tree's own actions.
TREE_TABLES: Tables = {
    **TABLES,
    ADMISSION: ((*_ADMISSION_KEY, "type_bit"),
                {ADMIT: (*_ADMIT, "parent_bit"),
                 ADMIT_RESULT: ("job_index", "slot_base", "slot_count", "other_workers", "all_workers", "recirc_port",
                                "parent_bit", "job", "key")}),
    REPLICA: (("rid",), {TO_WORKER: _TO_WORKER, TO_PARENT: (*_TO_WORKER, "job", "key")}),
}


def tables(chip: Chip) -> Tables:
    """The names the control plane writes on ``chip``'s program."""
    return TREE_TABLES if chip.trees else TABLES


def recirculation_port(chip: Chip, cfg: JobConfig) -> int:
    """The recirculation port of the pipe all of the job's workers (and a level's parent, whose RESULTs take the
    same registers) are on: registers are per pipe."""
    ports = [w.switch_port for w in cfg.workers] + ([cfg.parent.switch_port] if cfg.parent is not None else [])
    pipes = {port // PORTS_PER_PIPE for port in ports}
    if len(pipes) != 1:
        raise ConfigError(f"job {cfg.job_id}'s workers{' and parent' if cfg.parent is not None else ''} are on pipes "
                          f"{sorted(pipes)}: a job's state lives in one pipe's registers, so connect all of them to "
                          "ports of one pipe")
    return pipes.pop() * PORTS_PER_PIPE + chip.recirculation_port


def _rid(group: int, worker: int) -> int:
    """A replica's id, unique across jobs and uplink groups (group | PARENT_FLAG; 0 is the flood group's node)."""
    return (group - 1) * MAX_WORKERS + worker + 1


def _admission_key(row: Admission | ParentAdmission, trees: bool) -> dict[str, int]:
    key = {"job": row.job_id, "worker": row.worker, "src_addr": row.ip, "src_port": row.port, "key": row.key}
    if trees:  # the type's bit 0: a worker's packets have it, a parent's RESULT not
        key["type_bit"] = int(isinstance(row, Admission))
    return key


def _bits(params: JobParams) -> tuple[int, int]:
    """The job's workers as the program counts them, and its parent's bit among them (0 without a parent): a level
    of a tree counts its parent's RESULT as worker n (docs/tofino.md, "Trees")."""
    parent = params.parent << params.n_workers
    return (1 << params.n_workers) - 1 | parent, parent


def _admit(row: Admission, recirc_port: int, trees: bool) -> dict[str, int]:
    workers, parent = _bits(row.params)
    data = {"job_index": row.params.group - 1, "slot_base": row.slot_base, "slot_count": row.params.slot_count,
            "generation": row.params.generation, "worker_bit": 1 << row.worker,
            "other_workers": workers & ~(1 << row.worker), "all_workers": workers, "recirc_port": recirc_port}
    if trees:
        data["parent_bit"] = parent
    return data


def _admit_result(row: ParentAdmission, recirc_port: int) -> dict[str, int]:
    workers, parent = _bits(row.params)
    return {"job_index": row.params.group - 1, "slot_base": row.slot_base, "slot_count": row.params.slot_count,
            "other_workers": workers & ~parent, "all_workers": workers, "recirc_port": recirc_port,
            "parent_bit": parent, "job": row.own_job, "key": row.own_key}


def _to_parent(up: Uplink) -> dict[str, int]:
    return {"eth_dst": up.mac, "ip_src": up.switch_ip, "ip_dst": up.ip, "udp_dst": up.udp_port, "worker": up.worker,
            "job": up.job_id, "key": up.key}


def _admission_row(row: Row) -> Admission:
    d = row.data
    parent = d.get("parent_bit", 0) != 0
    params = JobParams(d["slot_count"], d["job_index"] + 1, bin(d["all_workers"]).count("1") - parent,
                       d["generation"], parent)
    return Admission(row.key["job"], row.key["worker"], row.key["src_addr"], row.key["src_port"], row.key["key"],
                     d["slot_base"], params)


class TofinoTarget(Target):
    """bf_switchd at ``address`` (device ``device_id``) running ``p4/tna`` compiled for Tofino 1."""

    name: ClassVar[str] = "tofino"
    summary: ClassVar[str] = "Tofino 1 (bf_switchd) over BfRt gRPC, default address 127.0.0.1:50052"
    chip: ClassVar[Chip] = Chip.TOFINO

    def __init__(self, address: str = "127.0.0.1:50052", device_id: int = 0,
                 session: Callable[[], TableSession] | None = None) -> None:
        self.address, self.device_id = address, device_id
        self._session = session or (lambda: BfrtSession(address, device_id))

    @classmethod
    def open(cls, options: TargetOptions) -> TofinoTarget:
        """At ``--address``, else the job file's ``[switch] control`` (every level of a tree file names its own BfRt
        address there), else 127.0.0.1:50052."""
        if options.pipeline:
            raise ConfigError("--pipeline: bf_switchd loads the program at start (its --conf-file); build it with "
                              f"`switchagg build-p4 --target {cls.name}` and start bf_switchd with it")
        config = options.config
        control = str(config.control) if config is not None and config.control is not None else None
        return cls(options.address or control or "127.0.0.1:50052", options.device_id or 0)

    @classmethod
    def build(cls, out_dir: Path) -> dict[str, Path]:
        return build(cls.chip, out_dir)

    @classmethod
    def resources(cls, out_dir: Path) -> str:
        return resources(cls.chip, out_dir)

    def check(self, job: JobConfig) -> None:
        """Refuse what this chip's program cannot serve: a level of a tree where it serves none, and one whose
        children leave no bit for its parent."""
        check_config(job, trees=self.chip.trees)
        if job.parent is not None and job.n_workers >= MAX_WORKERS:
            raise ConfigError(f"job {job.job_id} has {job.n_workers} children and a parent: on {self.name} a level "
                              f"of a tree holds at most {MAX_WORKERS - 1} (its parent's RESULT takes the "
                              f"{MAX_WORKERS}th bit): split its workers over more leaves")

    def deploy(self, job: JobConfig, lease: float | None = None) -> int:
        """Install a job: L2 and flood group, recirculation port, multicast nodes and group, egress
        rewrites, zeroed counters, then the admission entries that let its packets in. No lease (BfRt here runs
        no timer): one given is refused, see :meth:`renew`."""
        if lease is not None:
            raise UnsupportedOperation(self._no_leases())
        self.check(job)
        trees = self.chip.trees
        recirc = recirculation_port(self.chip, job)
        with self._session() as s:
            deployed = _deployed(s)
            table = JobTable(NUM_SLOTS, MAX_JOBS, [job_entry(rows) for rows in deployed.values()])
            generation = job.generation or new_generation()
            table.check(JobEntry.from_config(job, generation))
            rows = plan(job, free_group([rows[0].params for rows in deployed.values()], MAX_JOBS), generation, trees)
            _install_l2(s, rows.hosts)
            if not any(r.key["f1"] == (recirc, PORT_MASK) for r in s.entries(RECIRCULATION_PORTS)):
                s.add(RECIRCULATION_PORTS, {"f1": (recirc, PORT_MASK)}, {})
            _install_group(s, rows.replicas[0].group, [
                (_rid(r.group, r.worker), r.port, {"eth_dst": r.mac, "ip_src": r.switch_ip, "ip_dst": r.ip,
                                                   "udp_dst": r.udp_port, "worker": r.worker}, TO_WORKER)
                for r in rows.replicas])
            index = rows.replicas[0].group - 1
            for c in JobCounter:
                s.modify(JOB_COUNTERS, {"$COUNTER_INDEX": index * JOB_COUNTER_STRIDE + c}, {"$COUNTER_SPEC_PKTS": 0})
            if (up := rows.uplink) is not None:  # one replica, to the parent
                _install_group(s, up.group, [(_rid(up.group, 0), up.port, _to_parent(up), TO_PARENT)])
            for row in rows.admission:
                s.add(ADMISSION, _admission_key(row, trees), _admit(row, recirc, trees), ADMIT)
            if rows.parent is not None:
                s.add(ADMISSION, _admission_key(rows.parent, trees), _admit_result(rows.parent, recirc), ADMIT_RESULT)
        return generation

    def reset(self, job_id: int) -> int:
        """A new run of the job: every admission entry gets a fresh generation; no register is touched."""
        with self._session() as s:
            rows = self._job(s, job_id)
            generation = new_generation(rows[0].params.generation)
            for e in s.entries(ADMISSION):
                if e.action == ADMIT and e.key["job"] == job_id:
                    s.modify(ADMISSION, e.key, {**e.data, "generation": generation}, ADMIT)
        return generation

    def undeploy(self, job_id: int) -> None:
        with self._session() as s:
            rows = self._job(s, job_id)
            for e in s.entries(ADMISSION):  # the parent's RESULTs first: they name the job by their action's job
                if e.action == ADMIT_RESULT and e.data["job"] == job_id:
                    s.delete(ADMISSION, e.key)
            for row in rows:
                s.delete(ADMISSION, _admission_key(row, self.chip.trees))
            group = rows[0].params.group
            _remove_group(s, group, [_rid(group, row.worker) for row in rows])
            if rows[0].params.parent:
                _remove_group(s, group | PARENT_FLAG, [_rid(group | PARENT_FLAG, 0)])

    def capacity(self) -> tuple[int, int | None]:
        return NUM_SLOTS, MAX_JOBS

    def jobs(self) -> dict[int, tuple[int, int]]:
        """The deployed jobs' slot ranges, read back from the admission table."""
        with self._session() as s:
            return {j: (rows[0].slot_base, rows[0].params.slot_count) for j, rows in _deployed(s).items()}

    def status(self, job_id: int) -> JobStatus:
        """Counters read over BfRt; the job's parameters from its admission entries."""
        with self._session() as s:
            drops, _ = named_counters([s.counter(GLOBAL_DROPS, d) for d in GlobalDrop], None)
            rows = _deployed(s).get(job_id)
            if rows is None:
                return JobStatus(self.name, job_id, False, global_drops=drops)
            base = (rows[0].params.group - 1) * JOB_COUNTER_STRIDE
            counts = [s.counter(JOB_COUNTERS, base + c) for c in JobCounter]
            return JobStatus.of(self.name, job_entry(rows), named_counters(counts, counts)[1], drops)

    def _job(self, s: TableSession, job_id: int) -> list[Admission]:
        rows = _deployed(s).get(job_id)
        if rows is None:
            raise ConfigError(f"job {job_id} is not deployed on {self.address}")
        return rows


class Tofino2Target(TofinoTarget):
    """The same, for Tofino 2 (``p4/tna`` compiled for T2NA)."""

    name: ClassVar[str] = "tofino2"
    summary: ClassVar[str] = "Tofino 2 (bf_switchd) over BfRt gRPC, default address 127.0.0.1:50052"
    chip: ClassVar[Chip] = Chip.TOFINO2


def _deployed(s: TableSession) -> dict[int, list[Admission]]:
    """Every deployed job's workers' admission rows, by job id, in rank order."""
    jobs: dict[int, list[Admission]] = {}
    for e in s.entries(ADMISSION):
        if e.action != ADMIT:
            continue
        row = _admission_row(e)
        jobs.setdefault(row.job_id, []).append(row)
    return {job: sorted(rows, key=lambda r: r.worker) for job, rows in jobs.items()}


def _install_group(s: TableSession, group: int, replicas: list[tuple[int, int, dict[str, int], str]]) -> None:
    """A multicast group of the packet replication engine: per replica (rid, port, egress rewrite, its action), a
    node on that port and a ``replica`` entry by rid; then the group of those nodes."""
    for rid, port, _, _ in replicas:
        s.add(PRE_NODE, {"$MULTICAST_NODE_ID": rid},
              {"$MULTICAST_RID": rid, "$MULTICAST_LAG_ID": [], "$DEV_PORT": [port]})
    nodes = [rid for rid, _, _, _ in replicas]
    s.add(PRE_MGID, {"$MGID": group}, {"$MULTICAST_NODE_ID": nodes,
                                       "$MULTICAST_NODE_L1_XID_VALID": [False] * len(nodes),
                                       "$MULTICAST_NODE_L1_XID": [0] * len(nodes)})
    for rid, _, rewrite, action in replicas:
        s.add(REPLICA, {"rid": rid}, rewrite, action)


def _remove_group(s: TableSession, group: int, rids: list[int]) -> None:
    """What :func:`_install_group` installed."""
    s.delete(PRE_MGID, {"$MGID": group})
    for rid in rids:
        s.delete(REPLICA, {"rid": rid})
        s.delete(PRE_NODE, {"$MULTICAST_NODE_ID": rid})


def _install_l2(s: TableSession, hosts: list[tuple[int, int]]) -> None:
    """The L2 entries and flood group (node 0, rid 0) of :func:`~switchagg.targets.p4job.l2_update`."""
    update = l2_update({e.key["eth_dst"]: e.data["port"] if e.action == TO_PORT else None for e in s.entries(L2)},
                       hosts)
    for mac, port in update.add:
        if port is None:
            s.add(L2, {"eth_dst": mac}, {}, FLOOD)
        else:
            s.add(L2, {"eth_dst": mac}, {"port": port}, TO_PORT)
    node = {"$MULTICAST_RID": 0, "$MULTICAST_LAG_ID": [], "$DEV_PORT": update.flood_ports}
    if update.first:
        s.add(PRE_NODE, {"$MULTICAST_NODE_ID": 0}, node)
        s.add(PRE_MGID, {"$MGID": FLOOD_GROUP},
              {"$MULTICAST_NODE_ID": [0], "$MULTICAST_NODE_L1_XID_VALID": [False], "$MULTICAST_NODE_L1_XID": [0]})
    else:
        s.modify(PRE_NODE, {"$MULTICAST_NODE_ID": 0}, node)
