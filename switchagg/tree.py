"""A tree of jobs described once: a spine over leaf switches, each leaf over its workers.

One TOML file names the whole tree (``docs/protocol.md`` section 10)::

    [job]                          # every level's job: one id, key, slots and K
    id = 1
    key = 0x5eed5eed
    slot_count = 64
    values_per_packet = 64

    [spine]
    address = "10.9.0.1:16711"     # where the spine receives (UDP), and its control port
    control = "10.9.0.1:16712"

    [[leaves]]                     # leaf 0: tree ranks 0.., in its workers' order
    address = "10.9.1.1:16711"
    control = "10.9.1.1:16712"
    workers = ["10.1.0.1:40000", "10.1.0.2:40000"]

    [[leaves]]                     # leaf 1: the ranks after leaf 0's
    address = "10.9.2.1:16711"
    control = "10.9.2.1:16712"
    workers = ["10.2.0.1:40000", "10.2.0.2:40000"]

On a P4 switch (BMv2) every level's ``control`` is its P4Runtime address, and the links need the
Ethernet addresses and ports the P4 program writes into packets: ``mac`` of the spine and of each
leaf, each leaf's ``uplink_port`` (its port towards the spine) and ``spine_port`` (the spine's towards
it), and each worker as a table, ``{ address = "...", mac = "...", switch_port = 1 }``, as a job
file's ``[[workers]]``.

From it :class:`TreeConfig` makes every switch's job (:meth:`~TreeConfig.switch_jobs`: what
``switchagg deploy`` installs, the spine first so that no partial finds it missing) and each worker's
view (:meth:`~TreeConfig.worker`: its leaf's job and its index there). Every level is installed under
one generation, the spine's: a worker learns where its run's join starts from its own leaf, and the
join's sums cross the whole tree, so leaves of different generations would never agree on one. Ranks
are leaf-major. A job sums each switch's children and sends the partial up: the job id and key are
every level's, since each level is another switch. Two levels hold 32 x 32 = 1,024 workers; a spine's
children are leaves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import (
    JOB_KEYS,
    WORKER_KEYS,
    Endpoint,
    JobConfig,
    ParentSpec,
    WorkerSpec,
    build_from,
    check_keys,
    check_link,
    get_key,
    read_toml,
    table_of,
)
from .errors import ConfigError
from .wire import MAX_WORKERS, P4_VALUES_PER_PACKET, default_slot_count

SPINE_KEYS = ("address", "control", "mac")
LEAF_KEYS = ("address", "control", "workers", "mac", "uplink_port", "spine_port")


@dataclass(frozen=True)
class LeafSpec:
    """One leaf switch: where it receives, its control port, and its workers (their tree ranks in order); for a
    P4 switch, its Ethernet address and the ports of its link to the spine, at each end."""

    address: Endpoint
    control: Endpoint | None
    workers: tuple[WorkerSpec, ...]
    mac: str | None = None
    uplink_port: int | None = None
    spine_port: int | None = None


@dataclass(frozen=True)
class TreeConfig:
    """A two-level tree: the job every level runs, the spine, and the leaves under it."""

    job_id: int
    key: int
    slot_base: int
    slot_count: int
    values_per_packet: int
    spine: Endpoint
    spine_control: Endpoint | None
    leaves: tuple[LeafSpec, ...]
    loss_recovery: str = "auto"
    spine_mac: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= len(self.leaves) <= MAX_WORKERS:
            raise ConfigError(f"a tree has 1..{MAX_WORKERS} leaves under its spine, this one lists "
                              f"{len(self.leaves)}: fix the [[leaves]] tables")
        switches = [self.spine, *(leaf.address for leaf in self.leaves)]
        if len(set(switches)) != len(switches):
            raise ConfigError("the spine and the leaves must each receive at an address of their own: "
                              f"{', '.join(map(str, switches))}")
        check_link("spine", self.spine_mac, None)
        for i, leaf in enumerate(self.leaves):
            check_link(f"leaves[{i}]", leaf.mac, leaf.uplink_port, "uplink_port")
            check_link(f"leaves[{i}]", None, leaf.spine_port, "spine_port")
            for j, w in enumerate(leaf.workers):
                check_link(f"leaves[{i}].workers[{j}]", w.mac, w.switch_port)
        self.switch_jobs()  # each level's JobConfig checks its own fields, naming them

    def p4_gaps(self) -> list[str]:
        """What a P4 switch needs of the links and the file leaves out, as the keys to write (none: nothing)."""
        gaps = ["[spine] mac"] if self.spine_mac is None else []
        for i, leaf in enumerate(self.leaves):
            gaps += [f"leaves[{i}].{key}" for key in ("mac", "uplink_port", "spine_port") if getattr(leaf, key) is None]
            gaps += [f"leaves[{i}].workers[{j}].{key}" for j, w in enumerate(leaf.workers)
                     for key in ("mac", "switch_port") if getattr(w, key) is None]
        return gaps

    @property
    def ranks(self) -> int:
        """Every worker of the tree: the ranks of each call."""
        return sum(len(leaf.workers) for leaf in self.leaves)

    def _job(self, switch: Endpoint, control: Endpoint | None, workers: tuple[WorkerSpec, ...],
             **tree: Any) -> JobConfig:
        return JobConfig(switch, self.job_id, self.key, self.slot_base, self.slot_count, self.values_per_packet,
                         workers, control=control, loss_recovery=self.loss_recovery, tree_size=self.ranks, **tree)

    def spine_job(self) -> JobConfig:
        """The spine's job: its children are the leaves, each over its workers' ranks."""
        return self._job(self.spine, self.spine_control,
                         tuple(WorkerSpec(leaf.address, leaf.mac, leaf.spine_port) for leaf in self.leaves),
                         spans=tuple(len(leaf.workers) for leaf in self.leaves))

    def leaf_job(self, leaf: int) -> JobConfig:
        """Leaf ``leaf``'s job: its workers, its first tree rank, and the spine as its parent."""
        spec = self.leaves[leaf]
        base = sum(len(other.workers) for other in self.leaves[:leaf])
        return self._job(spec.address, spec.control, spec.workers, rank_base=base, parent=ParentSpec(
            self.spine, self.job_id, leaf, self.key, self.spine_mac, spec.uplink_port))

    def switch_jobs(self, generation: int | None = None) -> list[JobConfig]:
        """Every switch's job, the spine's first (deploy it first: a leaf's partial then finds it there), each
        with ``generation`` (None: the switch draws one; give the leaves the one the spine drew)."""
        jobs = [self.spine_job(), *(self.leaf_job(i) for i in range(len(self.leaves)))]
        return [job.with_generation(generation) for job in jobs]

    def worker(self, rank: int) -> tuple[JobConfig, int]:
        """Tree rank ``rank``'s view: its leaf's job, and its index among that leaf's workers."""
        if not 0 <= rank < self.ranks:
            raise ConfigError(f"rank {rank} is not one of the tree's ranks 0..{self.ranks - 1}")
        for leaf, spec in enumerate(self.leaves):
            if rank < len(spec.workers):
                return self.leaf_job(leaf), rank
            rank -= len(spec.workers)
        raise AssertionError("unreachable: the ranks were counted above")

    @classmethod
    def from_file(cls, path: str | Path) -> TreeConfig:
        """Read a tree file; errors name the file and the field to fix."""
        return build_from(path, read_toml(path, "tree file"), cls.from_dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TreeConfig:
        """A tree from a parsed TOML document: [job], [spine] and [[leaves]], each key checked."""
        for name in data:
            if name not in ("job", "spine", "leaves"):
                raise ConfigError(f"[{name}] is not a table of a tree file: it holds [job], [spine] and [[leaves]]")
        job, spine = table_of(data, "job"), table_of(data, "spine")
        check_keys(job, tuple(k for k in JOB_KEYS if k != "generation"), "job")
        check_keys(spine, SPINE_KEYS, "spine")
        leaves = data.get("leaves")
        if not isinstance(leaves, list) or not leaves:
            raise ConfigError("list the leaves as [[leaves]] tables, each with an 'address' and its 'workers'")
        specs = []
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, dict):
                raise ConfigError(f"leaves[{i}] = {leaf!r}: each leaf is a [[leaves]] table")
            check_keys(leaf, LEAF_KEYS, f"leaves[{i}]")
            workers = get_key(leaf, "workers", f"leaves[{i}]")
            if not isinstance(workers, list) or not workers:
                raise ConfigError(f"leaves[{i}].workers = {workers!r}: list its workers' 'IPv4:port' addresses")
            specs.append(LeafSpec(Endpoint.parse(get_key(leaf, "address", f"leaves[{i}]"), f"leaves[{i}].address"),
                                  Endpoint.parse(leaf["control"], f"leaves[{i}].control") if "control" in leaf
                                  else None,
                                  tuple(_worker(w, f"leaves[{i}].workers[{j}]") for j, w in enumerate(workers)),
                                  leaf.get("mac"), leaf.get("uplink_port"), leaf.get("spine_port")))
        k = job.get("values_per_packet", P4_VALUES_PER_PACKET)
        return cls(get_key(job, "id", "job"), get_key(job, "key", "job"), job.get("slot_base", 0),
                   job.get("slot_count", default_slot_count(k) if isinstance(k, int) else 0), k,
                   Endpoint.parse(get_key(spine, "address", "spine"), "spine.address"),
                   Endpoint.parse(spine["control"], "spine.control") if "control" in spine else None,
                   tuple(specs), job.get("loss_recovery", "auto"), spine.get("mac"))


def _worker(w: Any, where: str) -> WorkerSpec:
    """A leaf's worker: its 'IPv4:port' address, or a table with its address and, for a P4 switch, its link."""
    if isinstance(w, dict):
        check_keys(w, WORKER_KEYS, where)
        return WorkerSpec(Endpoint.parse(get_key(w, "address", where), f"{where}.address"), w.get("mac"),
                          w.get("switch_port"))
    return WorkerSpec(Endpoint.parse(w, where))


def load(path: str | Path) -> JobConfig | TreeConfig:
    """A job file, or a tree file (one with a [spine]): what ``switchagg deploy`` and ``undeploy`` take."""
    data = read_toml(path, "job file")
    return build_from(path, data, TreeConfig.from_dict if "spine" in data else JobConfig.from_dict)
