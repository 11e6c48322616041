"""``switchagg bench --tree LEAVESxWORKERS``: a tree of switches against one switch and against gloo, under real loss.

Issue 38 asks what a tree costs. The bed is network namespaces, routed as racks are: a spine
namespace with a bridge (10.82.0.0/24, the spine's switch at 10.82.0.254) that every leaf's uplink
joins (leaf ``l`` at 10.82.0.<l+1>); in each leaf's namespace a bridge to its workers
(10.82.<l+1>.0/24, the leaf's switch at .254, its workers at .1, .2 ...). The spine and the leaves
forward (routes to every leaf's subnet in the spine, default routes towards the spine in the leaves
and towards their leaf in the workers, no reverse-path filter), so the same workers reach their leaf,
the spine and one another: their leaf's switch in the tree, the spine's switch in the flat job (the
leaves' kernels forward their packets), and one another in gloo (TCP).

On that bed, at each loss rate, the same worker processes run, one after another:

- the tree: an embedded switch in every leaf's namespace and the spine's, each started from its job
  file (:meth:`switchagg.tree.TreeConfig.switch_jobs`, every level under one generation), K = 64 (the
  P4 switch's packet);
- the flat job of the same ranks on the spine's switch alone (a second job there, slots of its own);
- gloo's allreduce (``torch.distributed``), once, at the first rate: the drop rules match switchagg's
  UDP only, so its TCP sees no loss at any rate, and its one time stands in every row.

Loss: nftables drops ``rate`` percent of switchagg's packets (port 16711 on either side) in the
prerouting hook of every namespace, the spine's, the leaves' and the workers', so every hop is lossy,
forwarded packets too: the flat job's packets cross as many lossy hops as the tree's. At the highest
rate 1% of the workers' sends are also duplicated. The links have no offloads, so that each datagram
meets the firewall alone (:func:`switchagg.netns.quiet_link`).

Each worker allreduces float32 and int32 arrays (``values`` of each, ``reps`` times, new inputs each
time, after a warm-up call that waits for every rank): every int32 sum must equal numpy's (each rank
computes every rank's seeded inputs, :func:`inputs`), and each float32 sum of the tree must equal the
flat job's bit for bit (both sum the same ranks under the same headroom). A call's time is the
slowest rank's: from the last rank's end of the warm-up to its end of the last call, over the calls.
The table gives per rate each side's milliseconds per call, the tree's over the flat job's and gloo's
over the tree's, the contributions resent (``Client.retransmissions``, after the warm-up) and the
packets nftables dropped (warm-ups included), and whether every sum was right; any wrong sum prints
``SUMS WRONG`` and the exit status is 1.

Needs root, ``ip``, ``nft``, ``ethtool`` and torch (gloo). Its namespaces are named after its process
(``stb<pid>-...``), so that benches side by side keep theirs, and are removed at the end, on an
error, on Ctrl-C and on SIGTERM.

``python -m switchagg.benchmarks.trees RANK`` is one worker: it reads tasks, one JSON object a line,
on stdin and answers each with a line on stdout.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..config import Endpoint, JobConfig, WorkerSpec
from ..errors import ConfigError, SwitchAggError
from ..jobs import new_generation
from ..loopback import spawn_switch
from ..tree import LeafSpec, TreeConfig
from ..wire import MAX_WORKERS, P4_VALUES_PER_PACKET, default_slot_count
from .links import qdisc_stats, shape_links, stopped_by_sigterm
from .loss import NETNS_TOOLS, digest, drop_match, own_prefix, teardown
from .tasks import TaskWorkers, serve

PREFIX = "stb"  # a bench's namespaces: stb<its process id>-spine, -l<leaf>, -w<rank>
TABLE = "satb"  # the nftables table of the drop rules, in every namespace
SPINE_IP = "10.82.0.254"
PORT = 16711  # every switch's; the drop rules match it on either side
TREE_PORT, FLAT_PORT = 45000, 45001  # a worker's, in the tree and in the flat job
STORE_PORT = 29500  # torch's store, on rank 0's address
K = P4_VALUES_PER_PACKET
SLOTS = default_slot_count(K)  # each job's: the tree's at every level, the flat job's after them on the spine
TREE_JOB, FLAT_JOB, KEY = 1, 2, 0x7EE5
RATES = (0.0, 1.0, 5.0)  # percent, on each hop
DUP = 1  # percent of the workers' sends duplicated at the highest rate
VALUES = 1 << 18  # float32 and int32 values of each call
REPS = 3
TASK_LIMIT = 600.0  # s every rank may take for one side's calls


def parse_shape(text: str) -> tuple[int, int]:
    """``LEAVESxWORKERS`` as (leaves, workers a leaf); a ConfigError says what to write instead."""
    found = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not found:
        raise ConfigError(f"--tree {text!r}: write LEAVESxWORKERS, the leaves under the spine and the workers "
                          "under each leaf, e.g. --tree 2x4")
    leaves, per_leaf = int(found[1]), int(found[2])
    if not (1 <= leaves <= MAX_WORKERS and 1 <= per_leaf <= MAX_WORKERS):
        raise ConfigError(f"--tree {text}: a switch has 1..{MAX_WORKERS} children; give 1..{MAX_WORKERS} leaves "
                          f"and 1..{MAX_WORKERS} workers a leaf")
    if leaves * per_leaf > MAX_WORKERS:
        raise ConfigError(f"--tree {text}: {leaves * per_leaf} ranks, but the flat job the bench compares the tree "
                          f"with holds at most {MAX_WORKERS} (one switch's bitmap): give at most {MAX_WORKERS} leaves "
                          "x workers, e.g. --tree 4x8")
    return leaves, per_leaf


def leaf_ip(leaf: int) -> str:
    """Where leaf ``leaf``'s switch receives: its bridge to its workers."""
    return f"10.82.{leaf + 1}.254"


def uplink_ip(leaf: int) -> str:
    """Leaf ``leaf``'s address on the spine's bridge: the spine's route to its workers."""
    return f"10.82.0.{leaf + 1}"


def worker_ip(leaf: int, index: int) -> str:
    return f"10.82.{leaf + 1}.{index + 1}"


def inputs(rank: int, rep: int, values: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s seeded float32 and int32 arrays of call ``rep``."""
    rng = np.random.default_rng([rank, rep, values])
    return rng.standard_normal(values).astype(np.float32), rng.integers(-2**20, 2**20, values).astype(np.int32)


@functools.cache
def int_sums(ranks: int, reps: int, values: int) -> tuple[np.ndarray, ...]:
    """Each call's int32 sum over ``ranks`` ranks, by numpy: what every rank's switchagg and gloo sums must be."""
    return tuple(np.sum([inputs(r, rep, values)[1].astype(np.int64) for r in range(ranks)], axis=0).astype(np.int32)
                 for rep in range(reps))


class Bed:
    """The spine's, the leaves' and the workers' namespaces, linked and routed: built here, removed by
    :func:`switchagg.benchmarks.loss.teardown` of ``prefix``."""

    def __init__(self, leaves: int, per_leaf: int, prefix: str) -> None:
        self.leaves, self.per_leaf, self.prefix = leaves, per_leaf, prefix
        self.shaped = False
        teardown(prefix)
        self._router(self.spine, f"{SPINE_IP}/24")
        for leaf in range(leaves):
            self._leaf(leaf)
            for index in range(per_leaf):
                self._worker(leaf, index)

    @property
    def ranks(self) -> int:
        return self.leaves * self.per_leaf

    @property
    def spine(self) -> str:
        return f"{self.prefix}-spine"

    def leaf(self, leaf: int) -> str:
        return f"{self.prefix}-l{leaf}"

    def worker(self, rank: int) -> str:
        """Tree rank ``rank``'s namespace (ranks are leaf-major: leaf ``rank // per_leaf``)."""
        return f"{self.prefix}-w{rank}"

    def namespaces(self) -> list[str]:
        return [self.spine, *map(self.leaf, range(self.leaves)), *map(self.worker, range(self.ranks))]

    @staticmethod
    def _host(ns: str, *, forward: bool) -> None:
        """A namespace with no reverse-path filter (a reply may come back another way than its request went),
        forwarding and sending no ICMP redirects if ``forward`` (traffic between leaves goes through the spine)."""
        from .. import netns

        netns.add_namespace(ns)
        keys = ["net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"]
        if forward:
            keys += ["net.ipv4.ip_forward=1", "net.ipv4.conf.all.send_redirects=0",
                     "net.ipv4.conf.default.send_redirects=0"]
        netns.sh("sysctl", "-qw", *keys, ns=ns)

    def _router(self, ns: str, address: str) -> None:
        """A forwarding namespace with a bridge at ``address``, its ports added later."""
        from .. import netns

        self._host(ns, forward=True)
        netns.sh("ip", "link", "add", "br0", "type", "bridge", ns=ns)
        netns.quiet_link("br0", ns)
        netns.sh("ip", "addr", "add", address, "dev", "br0", ns=ns)

    def _leaf(self, leaf: int) -> None:
        """Leaf ``leaf``: its bridge to its workers, its uplink on the spine's bridge, and the routes both ways."""
        from .. import netns

        ns = self.leaf(leaf)
        self._router(ns, f"{leaf_ip(leaf)}/24")
        netns.veth_between(ns, "uplink", self.spine, f"l{leaf}")
        netns.sh("ip", "link", "set", f"l{leaf}", "master", "br0", ns=self.spine)
        netns.sh("ip", "addr", "add", f"{uplink_ip(leaf)}/24", "dev", "uplink", ns=ns)
        netns.sh("ip", "route", "add", "default", "via", SPINE_IP, ns=ns)
        netns.sh("ip", "route", "add", f"10.82.{leaf + 1}.0/24", "via", uplink_ip(leaf), ns=self.spine)

    def _worker(self, leaf: int, index: int) -> None:
        from .. import netns

        ns = self.worker(leaf * self.per_leaf + index)
        self._host(ns, forward=False)
        netns.veth_between(ns, "eth0", self.leaf(leaf), f"w{index}")
        netns.sh("ip", "link", "set", f"w{index}", "master", "br0", ns=self.leaf(leaf))
        netns.sh("ip", "addr", "add", f"{worker_ip(leaf, index)}/24", "dev", "eth0", ns=ns)
        netns.sh("ip", "route", "add", "default", "via", leaf_ip(leaf), ns=ns)

    def impair(self, rate: float, dup: int) -> None:
        """``rate`` percent of switchagg's packets dropped in every namespace's prerouting hook (forwarded ones
        too), and ``dup`` percent of the workers' sends duplicated; one nft transaction a namespace.

        A packet between two switches has port 16711 on both sides: the second rule leaves it to the first,
        so that no packet has two chances to be dropped.
        """
        from .. import netns

        match = drop_match(1, rate)
        for ns in self.namespaces():
            rules = [f"add table ip {TABLE}", f"delete table ip {TABLE}", f"add table ip {TABLE}",
                     f"add chain ip {TABLE} pre {{ type filter hook prerouting priority 0 ; }}",
                     f"add rule ip {TABLE} pre udp sport {PORT} {match} counter drop",
                     f"add rule ip {TABLE} pre udp sport != {PORT} udp dport {PORT} {match} counter drop"]
            rank = self._rank_of(ns)
            if dup and rank is not None:
                rules += [f"add chain ip {TABLE} out {{ type filter hook output priority 0 ; }}",
                          f"add rule ip {TABLE} out udp dport {PORT} numgen random mod 100 < {dup} "
                          f"dup to {leaf_ip(rank // self.per_leaf)} device eth0"]
            netns.sh("nft", " ; ".join(rules), ns=ns)

    def links(self) -> Iterator[tuple[str, str]]:
        """Both ends of every link, as (namespace, device): each worker's to its leaf, each leaf's to the spine."""
        for leaf in range(self.leaves):
            yield self.leaf(leaf), "uplink"
            yield self.spine, f"l{leaf}"
            for index in range(self.per_leaf):
                yield self.worker(leaf * self.per_leaf + index), "eth0"
                yield self.leaf(leaf), f"w{index}"

    def _rank_of(self, ns: str) -> int | None:
        """The rank whose namespace ``ns`` is, or None (a switch's)."""
        head = f"{self.prefix}-w"
        return int(ns[len(head):]) if ns.startswith(head) else None

    def shape(self, mbit: float) -> None:
        """Every link at ``mbit``, each end's egress by tbf (:func:`~switchagg.benchmarks.links.shape_links`)."""
        shape_links(self.links(), mbit, (K,), "the tree bench")
        self.shaped = True

    def queue_drops(self) -> int:
        """The packets tbf dropped on every shaped end so far (0 where no link is shaped)."""
        return sum(qdisc_stats(ns, dev)["drops"] for ns, dev in self.links()) if self.shaped else 0

    def drops(self) -> int:
        """The packets the drop rules took in every namespace since :meth:`impair`."""
        from .. import netns

        total = 0
        for ns in self.namespaces():
            listing = netns.sh("nft", "list", "table", "ip", TABLE, ns=ns, check=False).stdout
            total += sum(int(p) for p in re.findall(r"counter packets (\d+)", listing))
        return total

    def tree(self) -> TreeConfig:
        """The tree's file: the spine, each leaf at its bridge and its workers at their addresses."""
        leaves = tuple(LeafSpec(Endpoint(leaf_ip(leaf), PORT), None, tuple(
            WorkerSpec(Endpoint(worker_ip(leaf, i), TREE_PORT)) for i in range(self.per_leaf)))
            for leaf in range(self.leaves))
        return TreeConfig(TREE_JOB, KEY, 0, SLOTS, K, Endpoint(SPINE_IP, PORT), None, leaves)

    def flat(self, generation: int) -> JobConfig:
        """The same ranks as one job of the spine's switch, on slots after the tree's."""
        workers = tuple(WorkerSpec(Endpoint(worker_ip(r // self.per_leaf, r % self.per_leaf), FLAT_PORT))
                        for r in range(self.ranks))
        return JobConfig(Endpoint(SPINE_IP, PORT), FLAT_JOB, KEY, SLOTS, SLOTS, K, workers, generation=generation)


def missing() -> str | None:
    """Why the tree bench cannot run here, or None."""
    from .. import netns

    bed = netns.missing("the tree bench", "network namespaces and nftables", NETNS_TOOLS)
    if bed is not None:
        return bed
    if importlib.util.find_spec("torch") is None:
        return "the tree bench runs gloo beside the switches: pip install 'switchagg[torch]'"
    return None


# ---- a worker --------------------------------------------------------------------------------------------


def _timed(allreduce: Callable[[np.ndarray], np.ndarray], rank: int, task: dict[str, Any]) -> dict[str, Any]:
    """``reps`` float32 and int32 calls, the inputs made before the clock starts; when each ended, whether
    every int32 sum was numpy's, and each float32 sum's digest."""
    ranks, reps, values = task["ranks"], task["reps"], task["values"]
    sums = int_sums(ranks, reps, values)
    data = [inputs(rank, rep, values) for rep in range(reps)]
    marks, floats, exact = [time.perf_counter()], [], True
    for rep, (f, i) in enumerate(data):
        floats.append(allreduce(f))
        marks.append(time.perf_counter())
        exact = np.array_equal(allreduce(i), sums[rep]) and exact
        marks.append(time.perf_counter())
    return {"marks": marks, "exact": exact, "floats": [digest(f).tobytes().hex() for f in floats]}


def _switchagg(rank: int, task: dict[str, Any]) -> dict[str, Any]:
    """The task's calls through a switch: the tree's leaf or the flat job's switch, from its job file."""
    from ..client import Client

    with Client(JobConfig.from_file(task["config"]), task["index"], start_timeout=60, stall_timeout=30) as client:
        client.allreduce(np.zeros(K, np.int32))  # every rank is up: the timed part starts together
        warm = client.retransmissions  # while peers were still starting up: not the loss's
        answer = _timed(client.allreduce, rank, task)
        return {**answer, "resent": client.retransmissions - warm}


def _gloo(rank: int, task: dict[str, Any], store: Any) -> dict[str, Any]:
    """The task's calls through gloo, a process group of its own on the bench's store."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.PrefixStore(task["tag"] + "/", store), rank=rank,
                            world_size=task["ranks"], timeout=timedelta(seconds=TASK_LIMIT))
    try:
        def allreduce(x: np.ndarray) -> np.ndarray:
            tensor = torch.from_numpy(x)  # in place: each call's input is its own
            dist.all_reduce(tensor)
            return x

        allreduce(np.zeros(K, np.int32))
        return {**_timed(allreduce, rank, task), "resent": 0}
    finally:
        dist.destroy_process_group()


def _worker(rank: int) -> None:
    """Answer every task on stdin with a line on stdout; the store for gloo made at its first task."""
    store = None

    def answer(task: dict[str, Any]) -> dict[str, Any]:
        nonlocal store
        if task["kind"] != "gloo":
            return _switchagg(rank, task)
        if store is None:
            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)
            store = dist.TCPStore(task["store"], STORE_PORT, task["ranks"], rank == 0, timedelta(seconds=TASK_LIMIT))
        return _gloo(rank, task, store)

    serve(answer)


# ---- the bench ---------------------------------------------------------------------------------------------


def _workers(bed: Bed, workdir: Path, env: dict[str, str]) -> TaskWorkers:
    """One worker process per rank, each in its namespace, for the whole bench."""
    return TaskWorkers([["ip", "netns", "exec", bed.worker(r), sys.executable, "-m", "switchagg.benchmarks.trees",
                         str(r)] for r in range(bed.ranks)],
                       [env] * bed.ranks, [workdir / f"w{r}.log" for r in range(bed.ranks)], "tree bench")


@contextmanager
def _switches(bed: Bed, workdir: Path, env: dict[str, str]) -> Iterator[tuple[list[Path], Path]]:
    """The tree's switches (the spine's also holding the flat job), each in its namespace from its job files,
    every level under one fresh generation; yields the leaves' job files and the flat job's; stops them after."""
    generation = new_generation()
    spine, *leaves = (job.write(workdir / f"switch{i}.toml")
                      for i, job in enumerate(bed.tree().switch_jobs(generation=generation)))
    flat = bed.flat(generation).write(workdir / "flat.toml")
    started: list[subprocess.Popen] = []
    try:
        for ns, path, extra in [(bed.spine, spine, ("--config", str(flat))),
                                *((bed.leaf(i), p, ()) for i, p in enumerate(leaves))]:
            try:
                proc, _ = spawn_switch(path, workdir / "switch.ready", prefix=("ip", "netns", "exec", ns), env=env,
                                       switch_args=extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            except RuntimeError as exc:
                raise SwitchAggError(f"the switch of {path.name} did not start in namespace {ns}: {exc}") from None
            started.append(proc)
        yield leaves, flat
    finally:
        for proc in started:
            proc.terminate()
        for proc in started:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Run(NamedTuple):
    """One side's calls at one rate: milliseconds per call (the slowest rank's), what they resent and lost,
    and their sums."""

    ms: float
    resent: int  # contributions resent after the warm-up, all ranks
    dropped: int  # packets the drop rules took during the side's calls, warm-up included
    exact: bool  # every int32 sum numpy's, on every rank
    floats: list[list[str]]  # each rank's float32 sums' digests, a call each
    queue_drops: int = 0  # packets tbf dropped on the shaped links (--tree-link-rate), warm-up included


class Row(NamedTuple):
    """One loss rate: the tree, the flat job and gloo (its one run, at the first rate)."""

    rate: float
    tree: Run
    flat: Run
    gloo: Run

    def wrong(self) -> list[str]:
        """What came out wrong: nothing where every sum was right."""
        what = [f"{name}'s int32 sums" for name, run in (("tree", self.tree), ("flat job", self.flat),
                                                           ("gloo", self.gloo)) if not run.exact]
        if self.tree.floats != self.flat.floats:
            what.append("the tree's float32 sums are not the flat job's")
        if any(rank != self.tree.floats[0] for rank in self.tree.floats):
            what.append("the ranks' float32 sums differ")
        return what


def _side(bed: Bed, workers: TaskWorkers, tasks: list[dict[str, Any]]) -> Run:
    before, queued = bed.drops(), bed.queue_drops()
    answers = workers.run(tasks, TASK_LIMIT)
    marks = np.max([a["marks"] for a in answers], axis=0)  # the last rank's end of each call
    return Run(float(marks[-1] - marks[0]) / (len(marks) - 1) * 1e3, sum(a["resent"] for a in answers),
               bed.drops() - before, all(a["exact"] for a in answers), [a["floats"] for a in answers],
               bed.queue_drops() - queued)


def _rate(bed: Bed, workers: TaskWorkers, workdir: Path, env: dict[str, str], rate: float, common: dict[str, Any],
          gloo: Run | None) -> Row:
    """Every side at one rate (gloo only if it has not run yet), on switches started for it."""
    tag = f"{rate:g}pct"
    with _switches(bed, workdir, env) as (leaves, flat):
        tree = _side(bed, workers, [{**common, "tag": f"{tag}-tree", "kind": "tree",
                                     "config": str(leaves[r // bed.per_leaf]), "index": r % bed.per_leaf}
                                    for r in range(bed.ranks)])
        flat_run = _side(bed, workers, [{**common, "tag": f"{tag}-flat", "kind": "flat", "config": str(flat),
                                         "index": r} for r in range(bed.ranks)])
    if gloo is None:
        gloo = _side(bed, workers, [{**common, "tag": f"{tag}-gloo", "kind": "gloo", "store": worker_ip(0, 0)}
                                    for _ in range(bed.ranks)])
    return Row(rate, tree, flat_run, gloo)


def _check(rates: Sequence[float], values: int, reps: int) -> None:
    """Refuse what the bench cannot run, before it builds anything."""
    if not rates:
        raise ConfigError("--tree-loss: give one or more loss rates, percent per hop, e.g. --tree-loss 0 1 5")
    for rate in rates:
        if not 0 <= rate <= 99.9:
            raise ConfigError(f"--tree-loss {rate:g}: a loss rate is a percentage from 0 to 99.9")
    if values < 1 or reps < 1:
        raise ConfigError(f"values {values}, --reps {reps}: give 1 or more values a call and 1 or more reps")


def run_tree_bench(*, shape: str, rates: Sequence[float] = RATES, values: int = VALUES, reps: int = REPS,
                   link_rate: float | None = None) -> int:
    """The tree of ``shape`` (LEAVESxWORKERS), the flat job of its ranks and gloo at every loss rate; a line per
    rate and the table at the end. ``link_rate`` (Mbit/s): every link shaped to it, each end's egress by tbf
    (:func:`~switchagg.benchmarks.links.shape_links`), a leaf's uplink as a worker's link: where the tree
    sends one partial up a leaf's uplink, the flat job sends every worker's contribution, and gloo's ring
    crosses it too. Returns 1 if a sum came out wrong, else 0."""
    leaves, per_leaf = parse_shape(shape)
    _check(rates, values, reps)
    if link_rate is not None and not 1 <= link_rate <= 100_000:
        raise ConfigError(f"--link-rate {link_rate:g}: give the links' rate in Mbit/s, 1 to 100000")
    rates = tuple(dict.fromkeys(rates))
    problem = missing()
    if problem:
        raise SwitchAggError(problem)
    ranks = leaves * per_leaf
    print(f"tree bench {leaves}x{per_leaf}: a spine over {leaves} leaves of {per_leaf} workers against the flat job "
          f"of the same {ranks} ranks on the spine's switch alone, and gloo; K={K}, {values} float32 and {values} "
          f"int32 values a call, {reps} of each after a warm-up; {', '.join(f'{r:g}' for r in rates)}% loss in "
          f"every namespace's prerouting (every hop, forwarded packets too)"
          + (f", {DUP}% of the workers' sends duplicated at {max(rates):g}%" if max(rates) else "")
          + f"; gloo once, at {rates[0]:g}% (TCP: the drop rules match switchagg's UDP only)"
          + (f"; every link, uplinks too, shaped to {link_rate:g} Mbit/s each way" if link_rate else ""), flush=True)
    common = {"ranks": ranks, "values": values, "reps": reps}
    # a worker's gloo on its bed link; OpenBLAS on one thread, as every rank shares the machine's cores
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), OPENBLAS_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="eth0")
    prefix, rows = own_prefix(PREFIX), []
    with stopped_by_sigterm():
        try:
            bed = _build(leaves, per_leaf, prefix)
            if link_rate:
                bed.shape(link_rate)
            rows = _bench(bed, rates, common, env)
        finally:
            teardown(prefix)
    print(table(rows, f"{leaves}x{per_leaf}" + (f"@{link_rate:g}mbit" if link_rate else "")))
    return 1 if any(row.wrong() for row in rows) else 0


def _build(leaves: int, per_leaf: int, prefix: str) -> Bed:
    try:
        return Bed(leaves, per_leaf, prefix)
    except RuntimeError as exc:  # an `ip`, `sysctl` or `nft` command that failed, named in exc
        raise SwitchAggError(f"the tree bench could not build its namespaces: {exc}") from None


def _bench(bed: Bed, rates: Sequence[float], common: dict[str, Any], env: dict[str, str]) -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        workers = _workers(bed, Path(tmp), env)
        try:
            for rate in rates:
                bed.impair(rate, DUP if rate == max(rates) and rate else 0)
                rows.append(_rate(bed, workers, Path(tmp), env, rate, common, rows[0].gloo if rows else None))
                print(_line(rows[-1]), flush=True)
            workers.close()
        except BaseException:
            workers.kill()
            raise
    return rows


def _line(row: Row) -> str:
    wrong = row.wrong()
    queued = (f"; tbf dropped: tree {row.tree.queue_drops}, flat {row.flat.queue_drops}, gloo {row.gloo.queue_drops}"
              if row.tree.queue_drops or row.flat.queue_drops or row.gloo.queue_drops else "")
    return (f"{row.rate:g}% loss: tree {row.tree.ms:.2f} ms a call (resent {row.tree.resent}, dropped "
            f"{row.tree.dropped}), flat {row.flat.ms:.2f} ms (resent {row.flat.resent}, dropped {row.flat.dropped}), "
            f"gloo {row.gloo.ms:.2f} ms{queued}" + (f", SUMS WRONG: {'; '.join(wrong)}" if wrong else
                                                    ", every sum right"))


def table(rows: Sequence[Row], shape: str) -> str:
    """The bench's table and its summary lines (``tree_over_flat=2x4-1pct:1.234 ...``)."""
    lines = ["ms: a call's time, the slowest rank's; tree/flat: the tree's over the flat job's; gloo/tree: gloo's "
             "(lossless, its one run) over the tree's; resent: contributions sent again; dropped: packets nftables "
             "dropped, warm-ups included",
             "  loss%  tree_ms  flat_ms  gloo_ms  tree/flat  gloo/tree  tree_resent  flat_resent  tree_dropped  "
             "flat_dropped  exact"]
    for r in rows:
        lines.append(f"{r.rate:>7g}  {r.tree.ms:>7.2f}  {r.flat.ms:>7.2f}  {r.gloo.ms:>7.2f}  "
                     f"{r.tree.ms / r.flat.ms:>9.2f}  {r.gloo.ms / r.tree.ms:>9.2f}  {r.tree.resent:>11}  "
                     f"{r.flat.resent:>11}  {r.tree.dropped:>12}  {r.flat.dropped:>12}  "
                     f"{'SUMS WRONG' if r.wrong() else 'yes':>5}")
    lines.append("tree_over_flat=" + " ".join(f"{shape}-{r.rate:g}pct:{r.tree.ms / r.flat.ms:.3f}" for r in rows))
    lines.append("gloo_over_tree=" + " ".join(f"{shape}-{r.rate:g}pct:{r.gloo.ms / r.tree.ms:.3f}" for r in rows))
    return "\n".join(lines)


if __name__ == "__main__":
    _worker(int(sys.argv[1]))
