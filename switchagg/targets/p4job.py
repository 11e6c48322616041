"""What a P4 switch holds for one job, whatever API writes it: the rows BMv2 and Tofino install.

A job on a P4 target is an admission entry per worker (which packets belong to it, with the job's
parameters), a multicast group of the job's workers, an egress rewrite per replica (the result's
headers to that worker) and an L2 entry per worker host. :func:`plan` works these out from the
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
from ..wire import HEADER_SIZE, P4_VALUES_PER_PACKET, UDP_PORT

BROADCAST = "ff:ff:ff:ff:ff:ff"
# The P4 programs' sizes (p4/include/size.p4 and constants.p4; tests/test_p4_source.py holds them equal)
MAX_JOBS = 64  # SA_MAX_JOBS: a job's multicast group is its index + 1
NUM_SLOTS = 1024  # SA_NUM_SLOTS
FLOOD_GROUP = 1000  # SA_FLOOD_GROUP
JOB_COUNTER_STRIDE = 16  # SA_JOB_COUNTER_STRIDE


class JobParams(NamedTuple):
    """What admission gives an admitted packet: the admit action's ``job`` parameter, packed as the P4
    programs keep it, so that admission writes one field."""

    slot_count: int
    group: int  # the job's multicast group: its index among the deployed jobs + 1
    n_workers: int
    generation: int

    def pack(self) -> int:
        return self.slot_count << 48 | self.group << 40 | self.n_workers << 32 | self.generation

    @classmethod
    def unpack(cls, job: int) -> JobParams:
        return cls(job >> 48, job >> 40 & 0xFF, job >> 32 & 0xFF, job & 0xFFFFFFFF)


class Admission(NamedTuple):
    """One worker's admission entry: the match (job, worker, source, key) and the action's parameters."""

    job_id: int
    worker: int
    ip: int  # the worker's IPv4 source address
    port: int  # its UDP source port
    key: int
    slot_base: int
    params: JobParams


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


@dataclass(frozen=True)
class JobPlan:
    """Everything a P4 switch holds for one job."""

    admission: list[Admission]
    replicas: list[Replica]
    hosts: list[tuple[int, int]]  # (worker MAC as an integer, switch port) for L2


def check_config(cfg: JobConfig) -> None:
    """Refuse, saying what to change, a job that a P4 program cannot serve."""
    if cfg.values_per_packet != P4_VALUES_PER_PACKET:
        raise ConfigError(f"job.values_per_packet = {cfg.values_per_packet}: the P4 program sums "
                          f"{P4_VALUES_PER_PACKET} values per packet, set it to that")
    if cfg.switch.port != UDP_PORT:
        raise ConfigError(f"switch.address = '{cfg.switch.host}:{cfg.switch.port}': the P4 program takes "
                          f"switchagg packets on UDP port {UDP_PORT}, write '{cfg.switch.host}:{UDP_PORT}'")
    missing = [r for r, w in enumerate(cfg.workers) if w.mac is None or w.switch_port is None]
    if missing:
        raise ConfigError(f"workers {missing} need 'mac' and 'switch_port' for the P4 target")
    if cfg.parent is not None or cfg.spans or cfg.tree_size:
        raise ConfigError(f"job {cfg.job_id} is a level of a tree ([parent] or [tree]), which the P4 programs do not "
                          "serve yet (docs/protocol.md section 10): run a tree's switches as embedded switches "
                          "(target soft)")


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


def plan(cfg: JobConfig, group: int, generation: int) -> JobPlan:
    """The rows of job ``cfg`` as multicast group ``group``, running generation ``generation``."""
    check_config(cfg)
    params = JobParams(cfg.slot_count, group, cfg.n_workers, generation)
    admission = [Admission(cfg.job_id, rank, int(ipaddress.IPv4Address(w.address.host)), w.address.port, cfg.key,
                           cfg.slot_base, params) for rank, w in enumerate(cfg.workers)]
    switch_ip = int(ipaddress.IPv4Address(cfg.switch.host))
    replicas = [Replica(group, w.switch_port, instance, rank, mac_int(w.mac), admission[rank].ip, w.address.port,
                        switch_ip)
                for rank, (w, instance) in enumerate(zip(cfg.workers, replica_instances(cfg), strict=True))]
    return JobPlan(admission, replicas, [(mac_int(w.mac), w.switch_port) for w in cfg.workers])


def job_entry(rows: list[Admission]) -> JobEntry:
    """A deployed job as the job table holds it, from its admission entries read back."""
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
