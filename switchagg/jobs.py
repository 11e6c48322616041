"""What every target shares: the job table's entry, generations, drop reasons and a job's status.

The embedded switch, BMv2 and Tofino hold the same jobs and count the same events, so these
live here, outside all of them. The numeric values of the counters are the indices of the P4
counter arrays (``p4/include/constants.p4``), and a test checks that the two agree.
"""

from __future__ import annotations

import dataclasses
import enum
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .wire import MAX_TREE_RANKS, MAX_WORKERS

if TYPE_CHECKING:
    from .config import JobConfig

Address = tuple[str, int]


class GlobalDrop(enum.IntEnum):
    """Drops before a packet is tied to a job, so they cannot be charged to one.

    The last two are of IPv4 that a switch seeing frames (the P4 program, ``SwitchModel.process_frame``)
    does not take; the embedded switch gets its datagrams from the kernel, which takes options and
    reassembles fragments, so it never counts them.
    """

    MALFORMED = 0  # too short, lengths disagree (IPv4, UDP, count), bad type, unknown flags, an owner without
    # FLAG_OWNER, worker >= 32
    BAD_VERSION = 1
    NOT_ADMITTED = 2  # no admission entry for (job, worker, source IP, source port, key)
    IP_OPTIONS = 3  # an IPv4 header other than 20 bytes (options), UDP, sent to the switch
    FRAGMENT = 4  # a fragment of a UDP datagram sent to the switch


class JobCounter(enum.IntEnum):
    """Per-job events: what was done, then each reason for a drop."""

    CONTRIBUTIONS = 0  # contributions counted into a sum
    RESULTS_MULTICAST = 1  # finished sums sent whole to every worker
    RESULTS_UNICAST = 2  # stored sums resent to a worker that retransmitted
    PROBES = 3  # probes answered
    WRONG_GENERATION = 4  # a packet of generation 0: no run's (every tag register powers up holding it)
    SLOT_OUT_OF_RANGE = 5
    BAD_COUNT = 6  # value count other than the job's K
    STALE = 7  # a chunk older than the one the slot copy holds
    DUPLICATE_PENDING = 8  # a repeat from a counted worker while the sum is unfinished
    QUERIES = 9  # queries answered (with a PENDING)
    # Finished sums of reduce-scatter chunks (FLAG_OWNER): whole to their owner, the header alone (count 0)
    # to every other worker. A finished sum counts here or in RESULTS_MULTICAST, never both.
    RESULTS_TO_OWNER = 10
    BAD_OWNER = 11  # FLAG_OWNER with an owner that is not one of the tree's ranks (owner >= its contributors)
    # A switch in a tree (a job with a parent, docs/protocol.md section 10): its finished partial sums go up as
    # one contribution to the parent, which the parent's RESULT completes on the way down.
    PARTIALS_UP = 12  # partial sums sent up once complete
    PARTIALS_RESENT = 13  # stored partials sent up again, for a child's repeat while the parent's sum was awaited
    RESULTS_FROM_PARENT = 14  # the parent's results stored and sent down to the children
    UNEXPECTED_RESULT = 15  # a parent's RESULT for a chunk the copy does not await (not complete here, or taken)


JOB_DROPS = (JobCounter.WRONG_GENERATION, JobCounter.SLOT_OUT_OF_RANGE, JobCounter.BAD_COUNT, JobCounter.BAD_OWNER,
             JobCounter.STALE, JobCounter.DUPLICATE_PENDING, JobCounter.UNEXPECTED_RESULT)


def new_generation(avoid: int = 0) -> int:
    """A fresh 32-bit generation: random, so no two deployments are likely to share one.

    Zero is never handed out: every register of a switch that just powered up holds it.
    """
    while True:
        g = secrets.randbits(32)
        if g not in (0, avoid):
            return g


@dataclass(frozen=True)
class Uplink:
    """Where a switch in a tree sends a job's partial sums: its parent switch, where the partial is one
    contribution of the parent's job (``worker`` of ``job_id`` under ``key``), and whose RESULTs it takes."""

    address: Address
    job_id: int
    worker: int
    key: int


@dataclass(frozen=True)
class JobEntry:
    """What admission knows about an installed job (the P4 admission entry's parameters).

    In a tree (docs/protocol.md section 10) a job's "workers" are its children, hosts or switches below
    it; ``parent`` is where its partial sums go (None: it is the root, or a flat job). Ranks are the
    tree's, leaf-major: child ``c`` covers ``spans[c]`` of them (one each where ``spans`` is empty, as
    hosts do) from ``rank_base`` on, of ``tree_size`` in all (0: this job's own); a reduce-scatter's
    owner is such a rank, and a switch sends a chunk's sum whole only down the branch that holds it.
    """

    job_id: int
    generation: int
    key: int
    slot_base: int
    slot_count: int
    values_per_packet: int
    workers: tuple[Address, ...]
    parent: Uplink | None = None
    spans: tuple[int, ...] = ()
    rank_base: int = 0
    tree_size: int = 0

    @classmethod
    def from_config(cls, config: JobConfig, generation: int) -> JobEntry:
        p = config.parent
        return cls(config.job_id, generation, config.key, config.slot_base, config.slot_count,
                   config.values_per_packet, tuple(w.address.tuple for w in config.workers),
                   None if p is None else Uplink(p.address.tuple, p.job, p.index, p.key), config.spans,
                   config.rank_base, config.tree_size)

    @property
    def n_workers(self) -> int:
        return len(self.workers)

    @property
    def contributors(self) -> int:
        """The tree's ranks under this job: what its finished sum counts."""
        return sum(self.spans) if self.spans else self.n_workers

    @property
    def tree_ranks(self) -> int:
        """The ranks of the whole tree (a reduce-scatter's owner is one of them)."""
        return self.tree_size or self.contributors

    def child_bases(self) -> tuple[int, ...]:
        """The first tree rank under each child, and the end of the last's: ``n_workers + 1`` of them."""
        bases = [self.rank_base]
        for span in self.spans or (1,) * self.n_workers:
            bases.append(bases[-1] + span)
        return tuple(bases)

    def child_of(self, rank: int) -> int | None:
        """The child whose branch holds tree rank ``rank``, or None where it is under another switch."""
        bases = self.child_bases()
        for child in range(self.n_workers):
            if bases[child] <= rank < bases[child + 1]:
                return child
        return None


class JobTable:
    """The jobs installed on one switch of ``num_slots`` slots (and at most ``max_jobs`` jobs).

    Every target keeps one: the embedded switch as its state, BMv2 and Tofino rebuilt from the
    entries they read back, so that a job is refused for the same reasons, in the same words, on all.
    """

    def __init__(self, num_slots: int, max_jobs: int | None = None, entries: list[JobEntry] = ()) -> None:
        self.num_slots, self.max_jobs = num_slots, max_jobs
        self._jobs: dict[int, JobEntry] = {}
        for entry in entries:
            self._jobs[entry.job_id] = entry

    def __contains__(self, job_id: int) -> bool:
        return job_id in self._jobs

    def __iter__(self) -> Iterator[JobEntry]:
        return iter(list(self._jobs.values()))

    def __len__(self) -> int:
        return len(self._jobs)

    def as_dict(self) -> dict[int, JobEntry]:
        return dict(self._jobs)

    def check(self, entry: JobEntry) -> None:
        """Raise a ConfigError that says what to change when ``entry`` cannot join the table."""
        if entry.job_id in self._jobs:
            raise ConfigError(f"job {entry.job_id} is already installed: undeploy it, or reset it for a new run")
        if entry.slot_base + entry.slot_count > self.num_slots:
            raise ConfigError(
                f"job {entry.job_id} wants slots {entry.slot_base}..{entry.slot_base + entry.slot_count - 1}"
                f" but the switch has {self.num_slots}: lower slot_base or slot_count")
        mine = range(entry.slot_base, entry.slot_base + entry.slot_count)
        for other in self._jobs.values():
            theirs = range(other.slot_base, other.slot_base + other.slot_count)
            if mine.start < theirs.stop and theirs.start < mine.stop:
                raise ConfigError(
                    f"job {entry.job_id}'s slots {mine.start}..{mine.stop - 1} overlap job "
                    f"{other.job_id}'s {theirs.start}..{theirs.stop - 1}: give it another slot_base")
        if not 1 <= entry.n_workers <= MAX_WORKERS:
            raise ConfigError(f"job {entry.job_id} has {entry.n_workers} workers; 1..{MAX_WORKERS} are allowed")
        check_tree(entry)
        if self.max_jobs is not None and len(self._jobs) >= self.max_jobs:
            raise ConfigError(f"the switch already runs {self.max_jobs} jobs: undeploy one first")

    def add(self, entry: JobEntry) -> None:
        self.check(entry)
        self._jobs[entry.job_id] = entry

    def get(self, job_id: int) -> JobEntry:
        entry = self._jobs.get(job_id)
        if entry is None:
            raise ConfigError(f"job {job_id} is not installed on this switch: deploy it first")
        return entry

    def remove(self, job_id: int) -> JobEntry:
        entry = self.get(job_id)
        del self._jobs[job_id]
        return entry

    def replace(self, entry: JobEntry) -> None:
        """An installed job's entry anew (a reset: its new generation)."""
        self.get(entry.job_id)
        self._jobs[entry.job_id] = entry


def check_tree(entry: JobEntry) -> None:
    """Raise a ConfigError that says what to change where a job's place in a tree does not add up."""
    where = f"job {entry.job_id}"
    if entry.spans and (len(entry.spans) != entry.n_workers or min(entry.spans) < 1):
        raise ConfigError(f"{where}: spans {list(entry.spans)} must give each of its {entry.n_workers} children the "
                          f"ranks under it (1 or more each)")
    if entry.rank_base < 0 or entry.tree_size < 0:
        raise ConfigError(f"{where}: rank_base {entry.rank_base} and tree_size {entry.tree_size} count ranks: 0 "
                          f"or more")
    if entry.rank_base + entry.contributors > entry.tree_ranks or entry.tree_ranks > MAX_TREE_RANKS:
        raise ConfigError(f"{where}: ranks {entry.rank_base}..{entry.rank_base + entry.contributors - 1} under it do "
                          f"not lie within its tree's {entry.tree_ranks} (at most {MAX_TREE_RANKS}): fix rank_base, "
                          f"spans or tree_size")
    up = entry.parent
    if up is not None and not (0 <= up.job_id <= 0xFFFF and 0 <= up.worker < MAX_WORKERS and 0 <= up.key <= 0xFFFFFFFF):
        raise ConfigError(f"{where}: its parent names job {up.job_id}, child {up.worker}, key {up.key}: a job id is "
                          f"16 bits, a child 0..{MAX_WORKERS - 1}, a key 32 bits")


MAX_LEASE = 86400.0  # seconds: past this a lease is no safeguard (and the switch's timer could not wait that long)


@dataclass(frozen=True)
class Lease:
    """A job's lease on a switch that expires jobs: it lasts ``seconds`` from its grant and from each
    renewal, until ``deadline`` on the switch's monotonic clock.

    A process group's job is removed when its group is destroyed, but a program killed (SIGKILL,
    SIGTERM, a forked child's exit) removes nothing: its ranks stop renewing, and the switch takes
    the job away once the lease lapses, instead of holding its slots for ever.
    """

    seconds: float
    deadline: float

    @classmethod
    def grant(cls, seconds: float, now: float) -> Lease:
        """A lease of ``seconds`` granted at ``now``; a ConfigError says what to send where ``seconds`` is no
        positive, finite number."""
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds <= MAX_LEASE:
            raise ConfigError(f"lease = {seconds!r}: a lease is a number of seconds, more than 0 and at most "
                              f"{MAX_LEASE:g} (a day; renew it, or deploy without one)")
        return cls(float(seconds), now + seconds)

    def renewed(self, now: float) -> Lease:
        """The lease renewed at ``now``: ``seconds`` more from then."""
        return Lease(self.seconds, now + self.seconds)

    def left(self, now: float) -> float:
        """Seconds until the lease lapses (0 once it has)."""
        return max(0.0, self.deadline - now)


def lapsed(now: float, deadline: float) -> bool:
    """Whether a lease whose deadline is ``deadline`` has lapsed at ``now``: the one rule by which a switch
    expires a job, a plain function so that a test drives it with any clock."""
    return now >= deadline


def lapsed_jobs(leases: dict[int, Lease], now: float) -> list[int]:
    """The jobs among ``leases`` whose lease has lapsed at ``now``, in id order."""
    return sorted(job for job, lease in leases.items() if lapsed(now, lease.deadline))


MIN_SHARED_SLOTS = 16  # the fewest slots a job is sized down to where the pool is shared (default_slot_count's floor)


def fit_jobs(installed: dict[int, tuple[int, int]], num_slots: int, count: int, wanted: int,
             max_jobs: int | None = None, shrink: bool = True, least: int = 1) -> tuple[int, list[int]] | None:
    """Where ``count`` new jobs of equal size go among ``installed`` ``{job: (base, count)}``: ``(size, bases)``.

    A pool is shared by every process group on the switch (FSDP2, HSDP and DeviceMesh programs make
    several), so a job is not handed the ``wanted`` slots whatever is left: it takes ``wanted`` (a
    window's worth) only while that leaves as many slots free for the groups after it, and else the
    largest power of two that does, down to :data:`MIN_SHARED_SLOTS`, which it takes wherever they
    fit, and never below ``least`` (the job's own floor, ``JobConfig.least_slots``). None when not even
    that fits (or the switch's job table is full): the caller falls back. ``shrink=False`` asks for
    ``wanted`` slots exactly, wherever they fit (a count the user gave).
    """
    if count < 1 or wanted < 1:
        return None
    if max_jobs is not None and len(installed) + count > max_jobs:
        return None
    gaps, start = [], 0
    for base, size in sorted(installed.values()):
        if base > start:
            gaps.append((start, base - start))
        start = max(start, base + size)
    if start < num_slots:
        gaps.append((start, num_slots - start))
    free = sum(g for _, g in gaps)
    sizes = [wanted] + [1 << b for b in range(wanted.bit_length() - 1, -1, -1) if 1 << b < wanted]
    sizes = [s for s in sizes if s >= max(least, min(MIN_SHARED_SLOTS, wanted))] if shrink else [wanted]
    for size in sizes:
        bases = _first_fit(gaps, count, size)
        last = size == sizes[-1]
        if bases is not None and (2 * count * size <= free or last):
            return size, bases
    return None


def _first_fit(gaps: list[tuple[int, int]], count: int, size: int) -> list[int] | None:
    """The bases of ``count`` runs of ``size`` slots placed lowest first in ``gaps``, or None."""
    bases = []
    for start, length in gaps:
        while length >= size and len(bases) < count:
            bases.append(start)
            start, length = start + size, length - size
    return bases if len(bases) == count else None


def named_counters(global_counts: list[int], job_counts: list[int] | None) -> tuple[dict[str, int], dict[str, int]]:
    """Counter arrays indexed as the P4 program indexes them, by name: switch-wide drops, one job's events."""
    return ({d.name.lower(): int(global_counts[d]) for d in GlobalDrop},
            {c.name.lower(): int(job_counts[c]) for c in JobCounter} if job_counts is not None else {})


@dataclass(frozen=True)
class JobStatus:
    """What a target says about one job: whether it is installed there, how, and its counters.

    The switch-wide drops are there either way, since they are what tells a user why a job's
    packets never reached it.
    """

    target: str
    job_id: int
    installed: bool
    generation: int = 0
    slot_base: int = 0
    slot_count: int = 0
    n_workers: int = 0
    counters: dict[str, int] = field(default_factory=dict)  # JobCounter names
    global_drops: dict[str, int] = field(default_factory=dict)  # GlobalDrop names
    transport: str = ""  # how the embedded switch's datagrams move, where there is one
    # the embedded switch's counters outside its data plane: its control port's (control_*), its sockets' drops
    host_counters: dict[str, int] = field(default_factory=dict)
    lease: float | None = None  # seconds left of the job's lease on a switch that expires jobs; None: no lease
    owner: str = ""  # the process that deployed the job, "host pid N", where the switch recorded one
    # every job on the switch, where the target lists them with their leases (the embedded switch): by id,
    # its slots, workers, lease (seconds left, None: none) and owner, so leftovers of killed programs show
    switch_jobs: dict[int, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, target: str, entry: JobEntry, counters: dict[str, int], global_drops: dict[str, int],
           transport: str = "") -> JobStatus:
        """An installed job's status."""
        return cls(target, entry.job_id, True, entry.generation, entry.slot_base, entry.slot_count,
                   entry.n_workers, counters, global_drops, transport)

    def to_json(self) -> dict[str, Any]:
        """The status as a plain dict (what ``switchagg status --json`` prints). A job that is not
        installed has no generation, slots or counters: those keys are left out rather than zero."""
        out = dataclasses.asdict(self)
        if not self.installed:
            for name in ("generation", "slot_base", "slot_count", "n_workers", "counters", "lease", "owner"):
                del out[name]
        return out
