"""What a P4 switch holds for one job, whatever API writes it: the rows BMv2 and Tofino install.

A job on a P4 target is an admission entry per worker (which packets belong to it, with the job's
parameters), a multicast group of the job's workers, an egress rewrite per replica (the result's
headers to that worker), an owner branch per worker (which ranks of the tree are under it) and an L2
entry per worker host. A level of a tree (docs/protocol.md section 10) with a parent has three things
more: an admission entry for the parent's RESULTs, an uplink group of one replica and its rewrite
(the partial sum's headers to the parent), and an L2 entry for the parent. :func:`plan` works these out from the
job's config; :mod:`~switchagg.targets.bmv2` writes them over P4Runtime, ``tofino`` over BfRt, and
both read a deployed job back into a :class:`~switchagg.jobs.JobEntry` with :func:`job_entry`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import NamedTuple

from ..config import JobConfig
from ..errors import ConfigError
from ..frames import mac_bytes, udp_headers
from ..jobs import JobEntry
from ..wire import HEADER_SIZE, P4_VALUES_PER_PACKET, UDP_PORT, VERSION, PacketType

BROADCAST = "ff:ff:ff:ff:ff:ff"
# The P4 programs' sizes (p4/include/size.p4 and constants.p4; tests/test_p4_source.py holds them equal)
MAX_JOBS = 64  # SA_MAX_JOBS: a job's multicast group is its index + 1
NUM_SLOTS = 1024  # SA_NUM_SLOTS
FLOOD_GROUP = 1000  # SA_FLOOD_GROUP
JOB_COUNTER_STRIDE = 16  # SA_JOB_COUNTER_STRIDE
PARENT_FLAG = 0x80  # the group byte's top bit (LOCAL_PARENT): the job has a parent; its uplink group is group | 0x80


class JobParams(NamedTuple):
    """What admission gives an admitted packet: the admit action's ``job`` parameter, packed as the P4
    programs keep it, so that admission writes one field."""

    slot_count: int
    group: int  # the job's multicast group: its index among the deployed jobs + 1
    n_workers: int
    generation: int  # in a parent's entry, the owner limit (owners()): its RESULTs carry their own
    parent: bool = False

    def pack(self) -> int:
        return (self.slot_count << 48 | (self.group | PARENT_FLAG * self.parent) << 40 | self.n_workers << 32
                | self.generation)

    @classmethod
    def unpack(cls, job: int) -> JobParams:
        return cls(job >> 48, job >> 40 & 0x7F, job >> 32 & 0xFF, job & 0xFFFFFFFF, bool(job >> 40 & PARENT_FLAG))


def owners(tree_ranks: int) -> int:
    """What the P4 programs compare the header's owner and count (24 bits) with: below ``ranks << 16``
    where the owner is one of the tree's ranks (a count is under 2^16); every owner byte past 255 ranks."""
    return tree_ranks << 16 if tree_ranks < 256 else 0xFFFFFF


class Admission(NamedTuple):
    """One worker's admission entry: the match (job, worker, source, key) and the action's parameters."""

    job_id: int
    worker: int
    ip: int  # the worker's IPv4 source address
    port: int  # its UDP source port
    key: int
    slot_base: int
    params: JobParams
    owners: int = 0  # owners() of the job's tree


class ParentAdmission(NamedTuple):
    """A tree level's entry for its parent's RESULTs: the match names the parent's job, this switch's index among
    its children, the parent's address and key; the RESULT goes on as this job's (``own_job``, ``own_key``)."""

    job_id: int
    worker: int
    ip: int
    port: int
    key: int
    slot_base: int
    params: JobParams  # parent set, and the owner limit where a worker's entry has the generation
    own_job: int
    own_key: int


class Branch(NamedTuple):
    """Which ranks of the tree are under a child of a job: ``span`` from ``base`` on."""

    job_id: int
    worker: int
    base: int
    span: int


class Replica(NamedTuple):
    """One multicast replica of a job's result: where it leaves, and the worker egress addresses it to."""

    group: int
    port: int  # the switch port
    instance: int  # the replica's number among the group's replicas on that port
    worker: int
    mac: int
    ip: int
    udp_port: int
    switch_ip: int  # the source of the result: the address the workers send to

    def headers(self) -> bytes:
        """The result's Ethernet (source left zero: egress writes the address the sum was sent to), IPv4
        and UDP headers."""
        return udp_headers(mac_str(self.mac), "00:00:00:00:00:00", (str(ipaddress.IPv4Address(self.switch_ip)),
                           UDP_PORT), (str(ipaddress.IPv4Address(self.ip)), self.udp_port),
                           HEADER_SIZE + 4 * P4_VALUES_PER_PACKET)


class Uplink(NamedTuple):
    """A tree level's partial sums to its parent: the one replica of its uplink group, a CONTRIB of the parent's
    job ``job_id`` under ``key`` from child ``worker``."""

    group: int
    port: int
    mac: int
    ip: int
    udp_port: int
    switch_ip: int
    worker: int
    job_id: int
    key: int

    def headers(self) -> bytes:
        """The partial sum's Ethernet (source left zero, as a result's), IPv4 and UDP headers."""
        return udp_headers(mac_str(self.mac), "00:00:00:00:00:00", (str(ipaddress.IPv4Address(self.switch_ip)),
                           UDP_PORT), (str(ipaddress.IPv4Address(self.ip)), self.udp_port),
                           HEADER_SIZE + 4 * P4_VALUES_PER_PACKET)

    def version_type_worker(self) -> int:
        return VERSION << 24 | PacketType.CONTRIB << 16 | self.worker


@dataclass(frozen=True)
class JobPlan:
    """Everything a P4 switch holds for one job."""

    admission: list[Admission]
    replicas: list[Replica]
    hosts: list[tuple[int, int]]  # (worker MAC as an integer, switch port) for L2
    branches: list[Branch]
    parent: ParentAdmission | None = None
    uplink: Uplink | None = None


def check_config(cfg: JobConfig, trees: bool = False) -> None:
    """Refuse, saying what to change, a job that a P4 program cannot serve (``trees``: whether it serves a level
    of a tree, as the v1model program and Tofino 2's do)."""
    if cfg.values_per_packet != P4_VALUES_PER_PACKET:
        raise ConfigError(f"job.values_per_packet = {cfg.values_per_packet}: the P4 program sums "
                          f"{P4_VALUES_PER_PACKET} values per packet, set it to that")
    if cfg.switch.port != UDP_PORT:
        raise ConfigError(f"switch.address = '{cfg.switch.host}:{cfg.switch.port}': the P4 program takes "
                          f"switchagg packets on UDP port {UDP_PORT}, write '{cfg.switch.host}:{UDP_PORT}'")
    missing = [r for r, w in enumerate(cfg.workers) if w.mac is None or w.switch_port is None]
    if missing:
        raise ConfigError(f"workers {missing} need 'mac' and 'switch_port' for the P4 target")
    if not trees and (cfg.parent is not None or cfg.spans or cfg.tree_size):
        raise ConfigError(f"job {cfg.job_id} is a level of a tree ([parent] or [tree]), which Tofino 1's program "
                          "does not serve (it has no stages left for it: docs/tofino.md, \"Trees\"): run a tree's "
                          "switches as Tofino 2, BMv2 or embedded switches (target tofino2, bmv2 or soft)")
    if cfg.parent is not None and (cfg.parent.mac is None or cfg.parent.switch_port is None):
        raise ConfigError("[parent] needs 'mac' and 'switch_port' for the P4 target: the parent switch's Ethernet "
                          "address and the port it hangs off")


def replica_instances(cfg: JobConfig) -> list[int]:
    """Each worker's multicast instance: how many of the job's workers come before it on its port.

    A replica is (port, instance); with one worker per port (the usual case) every instance is 0.
    """
    seen: dict[int, int] = {}
    instances = []
    for w in cfg.workers:
        instances.append(seen.get(w.switch_port, 0))
        seen[w.switch_port] = instances[-1] + 1
    return instances


def mac_int(mac: str) -> int:
    return int.from_bytes(mac_bytes(mac), "big")


def mac_str(mac: int) -> str:
    return ":".join(f"{b:02x}" for b in mac.to_bytes(6, "big"))


def plan(cfg: JobConfig, group: int, generation: int, trees: bool = False) -> JobPlan:
    """The rows of job ``cfg`` as multicast group ``group``, running generation ``generation`` (``trees``: see
    :func:`check_config`)."""
    check_config(cfg, trees)
    up = cfg.parent
    entry = JobEntry.from_config(cfg, generation)
    params = JobParams(cfg.slot_count, group, cfg.n_workers, generation, up is not None)
    limit = owners(entry.tree_ranks)
    admission = [Admission(cfg.job_id, rank, int(ipaddress.IPv4Address(w.address.host)), w.address.port, cfg.key,
                           cfg.slot_base, params, limit) for rank, w in enumerate(cfg.workers)]
    switch_ip = int(ipaddress.IPv4Address(cfg.switch.host))
    replicas = [Replica(group, w.switch_port, instance, rank, mac_int(w.mac), admission[rank].ip, w.address.port,
                        switch_ip)
                for rank, (w, instance) in enumerate(zip(cfg.workers, replica_instances(cfg), strict=True))]
    bases = entry.child_bases()
    branches = [Branch(cfg.job_id, c, bases[c], bases[c + 1] - bases[c]) for c in range(cfg.n_workers)]
    hosts = [(mac_int(w.mac), w.switch_port) for w in cfg.workers]
    if up is None:
        return JobPlan(admission, replicas, hosts, branches)
    parent_ip = int(ipaddress.IPv4Address(up.address.host))
    parent = ParentAdmission(up.job, up.index, parent_ip, up.address.port, up.key, cfg.slot_base,
                             params._replace(generation=limit), cfg.job_id, cfg.key)
    uplink = Uplink(group | PARENT_FLAG, up.switch_port, mac_int(up.mac), parent_ip, up.address.port, switch_ip,
                    up.index, up.job, up.key)
    return JobPlan(admission, replicas, [*hosts, (mac_int(up.mac), up.switch_port)], branches, parent, uplink)


def job_entry(rows: list[Admission]) -> JobEntry:
    """A deployed job as the job table holds it, from its workers' admission entries read back (what the table
    checks a new job against: its id, slots and workers, not its place in a tree)."""
    workers = [("", 0)] * len(rows)
    for row in rows:
        workers[row.worker] = (str(ipaddress.IPv4Address(row.ip)), row.port)
    first = rows[0]
    return JobEntry(first.job_id, first.params.generation, first.key, first.slot_base, first.params.slot_count,
                    P4_VALUES_PER_PACKET, tuple(workers))


class L2Update(NamedTuple):
    """What the L2 table and the flood group need for a job's hosts, given the entries already there."""

    add: list[tuple[int, int | None]]  # (MAC, port) entries to add; port None: broadcast, which floods
    flood_ports: list[int]  # every host port, the flood group's members
    first: bool  # the table was empty: the flood group is created, not modified


def l2_update(present: dict[int, int | None], hosts: list[tuple[int, int]]) -> L2Update:
    """Hosts reach each other (and ARP works): one entry per worker MAC not yet in ``present`` (MAC ->
    port, None for the broadcast entry), broadcast flooding to every host port."""
    add: list[tuple[int, int | None]] = []
    ports = {port for port in present.values() if port is not None}
    known = set(present)
    for mac, port in hosts:
        if mac not in known:
            add.append((mac, port))
            known.add(mac)
            ports.add(port)
    if mac_int(BROADCAST) not in known:
        add.append((mac_int(BROADCAST), None))
    return L2Update(add, sorted(ports), not present)


def free_group(deployed: list[JobParams], max_jobs: int) -> int:
    """The lowest multicast group no deployed job uses (groups are 1..max_jobs)."""
    used = {p.group for p in deployed}
    return min(set(range(1, max_jobs + 1)) - used)
