"""``switchagg bench --loss``: what packet loss costs an allreduce, on network namespaces with real kernel loss.

The embedded switch runs in a namespace of its own, each worker in another, joined by a bridge.
nftables drops switchagg packets on every namespace's input (so a packet crosses two lossy hops:
contribution into the switch, result into the worker; at 0% the same rule drops none) and
duplicates 1% of what the workers send at the highest loss rate. How it drops is the bed's run
length (``runs``), since loss in real networks comes in runs (issue 40): ``1`` drops each packet at
random on its own, on links without offloads, so that every datagram crosses the firewall alone;
``N`` drops runs of N consecutive packets at the same average rate, as a queue that overflows under
incast does (:func:`drop_match`); ``gso`` drops each packet at random on links with the kernel's
default offloads, where a segmented send (``UDP_SEGMENT``, :mod:`switchagg.transport`) crosses the
veths and the bridge whole, so that one drop takes a whole super-packet of up to 128 datagrams, as
a NIC ring overrun drops a batch (the nft counters' bytes per packet say how many it took on
average: the table's run length for ``gso``). Each worker allreduces int32 and float32 arrays of
prime lengths (about 205k values of each, K = 64); the same job runs at every loss rate of every
bed, ``rounds`` times over, and the bench prints per rate and run length the time over the same
round's and bed's lossless time (the median over the rounds, and its range), the contributions
resent and the QUERY packets sent (in the timed calls, not the warm-up that waits for every rank to
start), each over the datagrams nftables dropped (its own counters), and whether every sum came out
bit-exact (int32 against numpy, float32 against the lossless run, on every rank), for each
``loss_recovery`` of the job (``resend``: every worker resends; ``query``: workers ask the switch
first). Then each worker runs two sequences of calls, the same on every rank and in every run: a
seeded one of random sizes (``RANDOM_CALLS`` of 1 to 256k values, int32 or float32 at random) and
one of growing sizes (1, 2, 4 ... 256k values, ``GROWING_PASSES`` times, int32 and float32 in
turn). A call's time is the slowest rank's, and the bench prints the median, p99 and worst of each
call's time over the same call's in the lossless run, and the sequence's total over the lossless
total. The fixed sequence starts with its largest calls in a fresh client; the random one mixes
small calls between large ones, whatever the window learned before (issue 27: small calls then
stalled for 0.1-0.6 s at 5% loss); the growing one starts each call from what one of half its size
left, and its second pass small calls from what the largest left. Needs root, ``ip``, ``nft`` and
``ethtool``; it makes its namespaces (named after its process, so that benches side by side keep
theirs) and addresses (10.81.0.0/24, inside them only) and removes them when done.

``python -m switchagg.benchmarks.loss CONFIG RANK OUT`` is one worker.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..config import Endpoint, JobConfig, WorkerSpec
from ..errors import SwitchAggError
from ..loopback import spawn_switch
from ..wire import IP_UDP_OVERHEAD, datagram_size

PRIMES = (131071, 65521, 8191, 509, 127, 3)  # lengths of the arrays each worker reduces
PREFIX = "slb"  # a bench's namespaces are slb<its process id>-sw and -w<rank>
SWITCH_IP = "10.81.0.254"
RATES = (0.0, 0.1, 1.0, 5.0)  # percent, on each hop
DUP = 1  # percent duplicated at the highest rate
RANDOM_CALLS = 40  # calls in the random sequence
RANDOM_MAX = 1 << 18  # values in its largest call, and in the growing sequence's
RANDOM_SEED = 27
GROWING_PASSES = 2  # times the growing sequence climbs from 1 value to RANDOM_MAX
GSO = "gso"  # the run length of the bed whose links keep the kernel's offloads
NETNS_TOOLS = (("ip", "iproute2"), ("nft", "nftables"), ("ethtool", "ethtool"))  # what a lossy bed runs
RUN_LIMIT = 1800  # s a run may take before the bench calls it failed and goes on

Runs = int | str  # a bed's run length: the packets a drop takes (1, or N in a row), or GSO


class Calls(NamedTuple):
    """A sequence of calls in one row of the table: all rounds' runs of one loss rate and run length."""

    seconds: float  # the sequence's time, the median over the rounds
    total: float  # its time over the lossless one, the median over the rounds
    median: float  # each call's time over its lossless time, all rounds' calls: the median,
    p99: float  # the 99th percentile
    worst: float  # and the most


class Row(NamedTuple):
    """One loss rate's runs in one bed, one per round."""

    recovery: str  # the job's loss_recovery
    runs: Runs  # the bed's run length
    run_length: float | None  # datagrams a drop took on average: N, or measured in the gso bed (None: no drop)
    rate: float  # percent per hop
    seconds: float  # the slowest rank's timed calls, the median over the rounds
    slowdown: float  # the median over the rounds of the time over the same round's lossless time
    low: float  # and the least and the most of those
    high: float
    resent: int  # contributions sent again, all ranks and rounds
    asked: int  # QUERY packets, all ranks and rounds
    dropped: int  # datagrams nftables dropped, all rounds
    exact: bool  # in every round that finished
    sequences: dict[str, Calls]  # each sequence's figures, by its name in SEQUENCES
    finished: int  # runs that finished (the figures are theirs)
    failed: int  # and runs that failed (a stalled call, say), or had no lossless run to compare with

    def verdict(self) -> str:
        """Whether every sum was bit-exact, and how many runs failed and left no sums to check."""
        if not self.finished:
            return "failed"
        word = "yes" if self.exact else "NO"
        return f"{word}, {self.failed} failed" if self.failed else word

    def per_drop(self, what: int) -> str:
        return f"{what / self.dropped:.2f}" if self.dropped else "-"

    def length(self) -> str:
        """The run length as the table prints it: N, or the gso bed's measured mean."""
        if self.runs != GSO:
            return str(self.runs)
        return f"{self.run_length:.1f}" if self.run_length is not None else "-"


def random_calls(count: int = RANDOM_CALLS, seed: int = RANDOM_SEED) -> list[tuple[int, bool]]:
    """The random sequence: (length, whether float32) of each call, 1 to ``RANDOM_MAX`` values."""
    rng = np.random.default_rng(seed)
    return [(int(n), bool(f)) for n, f in zip(rng.integers(1, RANDOM_MAX + 1, count), rng.random(count) < 0.5,
                                              strict=True)]


def growing_calls(top: int = RANDOM_MAX, passes: int = GROWING_PASSES) -> list[tuple[int, bool]]:
    """The growing sequence: (length, whether float32) of each call, 1, 2, 4 ... ``top`` values,
    ``passes`` times over, int32 and float32 in turn: an odd number of sizes a pass (19 up to 256k)
    gives the second pass each size in the other type."""
    sizes = [1 << b for b in range(top.bit_length())] * passes
    return [(n, i % 2 == 1) for i, n in enumerate(sizes)]


SEQUENCES = {"random": random_calls(), "growing": growing_calls()}  # after the fixed calls, in this order


def drop_match(runs: Runs, rate: float) -> str:
    """The nftables expression that picks ``rate`` percent of a hop's packets to drop, in runs of ``runs``.

    ``1`` and ``GSO`` pick each packet at random (a GSO super-packet is one packet to the firewall).
    A run of N is ``numgen inc mod P >= P - N`` with P = N * 100 / rate: the last N of every P
    packets that reach the rule, on its own counter, one per hop. The runs are periodic on that
    counter, which every packet of the hop advances (every worker's at the switch's input, the
    retransmissions, the calls before), so they fall anywhere in a call; the first P - N packets
    pass, so that the first run is not the workers' joins. A run counts packets, not time: where a
    call waits and only its timers' resends and probes reach a hop, a run there takes the next N of
    them however far apart they come, as a queue that overflows under load would not. At 0% the
    same counter runs and drops none.
    """
    if runs in (1, GSO):
        return f"numgen random mod 1000 < {round(rate * 10)}"
    if not rate:
        return f"numgen inc mod {runs} < 0"
    period = round(runs * 100 / rate)
    return f"numgen inc mod {period} >= {period - runs}"


def dropped_datagrams(runs: Runs, packets: int, nbytes: int, values_per_packet: int) -> int:
    """The datagrams that the drop rules' ``packets`` held: one each, but in the gso bed, where a
    packet may be a super-packet (one IP and UDP header, all its datagrams' bytes), its bytes over a
    full datagram's; a short one (a QUERY, an array's last chunk) counts as part of one there."""
    if runs != GSO:
        return packets
    return round((nbytes - IP_UDP_OVERHEAD * packets) / datagram_size(values_per_packet))


def run_length(runs: Runs, dropped: int, packets: int) -> float | None:
    """The datagrams a drop took on average: N in a run bed; in the gso bed, the dropped datagrams
    over the dropped packets (None where nothing was dropped)."""
    if runs != GSO:
        return float(runs)
    return dropped / packets if packets else None


def call_slowdowns(times: np.ndarray, lossless: np.ndarray) -> tuple[float, float, float, float]:
    """Each call's time over the same call's lossless time: its median, p99 and worst, and the total's."""
    ratios = np.asarray(times) / np.asarray(lossless)
    return (float(np.median(ratios)), float(np.percentile(ratios, 99)), float(ratios.max()),
            float(np.sum(times) / np.sum(lossless)))


def inputs(rank: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s seeded float32 and int32 arrays of ``length`` values."""
    rng = np.random.default_rng([rank, length])
    return rng.standard_normal(length).astype(np.float32), rng.integers(-2**20, 2**20, length).astype(np.int32)


def digest(values: np.ndarray) -> np.ndarray:
    """A sum's fingerprint, 16 bytes of BLAKE2b over its values: a 256k-value result of every call of
    a sequence, on every rank, compared whole without being saved."""
    return np.frombuffer(hashlib.blake2b(np.ascontiguousarray(values).tobytes(), digest_size=16).digest(), np.uint8)


def _worker(config: str, rank: int, out: str) -> None:
    from ..client import Client

    cfg = JobConfig.from_file(config)
    results = {}
    with Client(cfg, rank, start_timeout=60, stall_timeout=30) as client:
        client.allreduce(np.zeros(64, np.int32))  # every rank is up: the timed part starts together
        warmup = client.retransmissions, client.queries  # while peers were still starting up: not the loss's
        start = time.perf_counter()
        for length in PRIMES:
            f, i = inputs(rank, length)
            results[f"f{length}"] = client.allreduce(f)
            results[f"i{length}"] = client.allreduce(i)
        results["seconds"] = np.array(time.perf_counter() - start)
        results["resent"] = np.array(client.retransmissions - warmup[0])
        results["asked"] = np.array(client.queries - warmup[1])
        # when each call of a sequence ended (the system's monotonic clock, which every rank shares):
        # the last rank's end of one call to the last rank's end of the next is that call's time
        for name, calls in SEQUENCES.items():
            marks = [time.perf_counter()]
            costs = [(client.retransmissions, client.queries)]  # what each call resent and asked, on this rank
            for i, (length, floats) in enumerate(calls):
                f, ints = inputs(rank, length)
                results[f"{name}{i}"] = digest(client.allreduce(f if floats else ints))
                marks.append(time.perf_counter())
                costs.append((client.retransmissions, client.queries))
            results[f"{name}_marks"] = np.array(marks)
            results[f"{name}_costs"] = np.diff(np.array(costs), axis=0)
    np.savez(out, **results)


def teardown(prefix: str) -> None:
    """Remove the namespaces of the bed ``prefix`` names (``prefix-...``): the dash keeps a bench of pid 123
    from taking those of a live bench of pid 1234."""
    from .. import netns

    for ns in netns.namespaces(f"{prefix}-"):
        netns.delete_namespace(ns)


def own_prefix(base: str = PREFIX) -> str:
    """This process's beds' prefix (``base`` and its process id), after removing the beds under ``base`` of
    benches that died without removing theirs.

    A prefix of its own, so that two benches on one machine (or a bench and the tests' run of it)
    do not take each other's namespaces down mid-run, as one fixed prefix did. The tree bench
    (:mod:`switchagg.benchmarks.trees`) names its beds the same way under a base of its own.
    """
    from .. import netns

    for ns in netns.namespaces(base):
        pid = ns[len(base):].partition("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            netns.delete_namespace(ns)
    return f"{base}{os.getpid()}"


class Bed:
    """The switch's namespace and ``n`` workers', joined by a bridge: built here, removed by :meth:`close`.

    With ``offloads`` the veths and the bridge keep the kernel's defaults, so that a worker's
    segmented send reaches the switch, and the switch's reaches a worker, as one packet (the gso
    bed: the bridge's offloads count too, since it sends the switch's results); without, every
    datagram crosses them on its own (:func:`switchagg.netns.quiet_link`).
    """

    def __init__(self, n: int, *, offloads: bool, prefix: str) -> None:
        from .. import netns

        self.n, self.offloads, self.prefix = n, offloads, prefix
        teardown(prefix)
        sw = self.ns(None)
        netns.add_namespace(sw)
        netns.sh("ip", "link", "add", "br0", "type", "bridge", ns=sw)
        netns.quiet_link("br0", sw, offloads="default" if offloads else "off")
        netns.sh("ip", "addr", "add", f"{SWITCH_IP}/24", "dev", "br0", ns=sw)
        for i in range(n):
            netns.add_namespace(self.ns(i))
            netns.veth_between(self.ns(i), "eth0", sw, f"s{i}",
                               offloads="default" if offloads else "off")
            netns.sh("ip", "link", "set", f"s{i}", "master", "br0", ns=sw)
            netns.sh("ip", "addr", "add", f"10.81.0.{i + 1}/24", "dev", "eth0", ns=self.ns(i))
        self.config = JobConfig(switch=Endpoint(SWITCH_IP, 16711), job_id=3, key=0x1055, slot_base=0,
                                slot_count=1024, values_per_packet=64,
                                workers=tuple(WorkerSpec(Endpoint(f"10.81.0.{i + 1}", 45000)) for i in range(n)))

    def ns(self, i: int | None) -> str:
        """The switch's namespace (``i`` None) or worker ``i``'s."""
        return f"{self.prefix}-sw" if i is None else f"{self.prefix}-w{i}"

    def impair(self, runs: Runs, rate: float, dup: int) -> None:
        """``rate`` percent of switchagg packets dropped on every namespace's input, in runs of ``runs``
        (:func:`drop_match`); ``dup`` percent of the workers' duplicated.

        At 0% the same rule runs and drops nothing: every packet then costs the firewall the same
        work as under loss (the lossless run took about 6% longer with it than without any rule), so
        that the ratios measure what the loss costs, not the means of making it.
        """
        from .. import netns

        for i in [None, *range(self.n)]:
            ns = self.ns(i)
            netns.sh("nft", "delete", "table", "ip", "salb", ns=ns, check=False)
            match = "udp dport 16711" if i is None else "udp sport 16711"
            rules = ["add table ip salb", "add chain ip salb in { type filter hook input priority 0 ; }",
                     f"add rule ip salb in {match} {drop_match(runs, rate)} counter drop"]
            if dup and i is not None:
                rules += ["add chain ip salb out { type filter hook output priority 0 ; }",
                          f"add rule ip salb out udp dport 16711 numgen random mod 100 < {dup} dup to {SWITCH_IP} "
                          "device eth0"]
            for rule in rules:
                netns.sh("nft", *rule.split(), ns=ns)

    def drops(self) -> tuple[int, int]:
        """The packets the drop rules took in every namespace since :meth:`impair`, and their bytes."""
        from .. import netns

        packets = nbytes = 0
        for i in [None, *range(self.n)]:
            listing = netns.sh("nft", "list", "table", "ip", "salb", ns=self.ns(i), check=False).stdout
            for p, b in re.findall(r"counter packets (\d+) bytes (\d+)", listing):
                packets, nbytes = packets + int(p), nbytes + int(b)
        return packets, nbytes

    def close(self) -> None:
        teardown(self.prefix)


def _run(bed: Bed, cfg: JobConfig, workdir: Path) -> tuple[list[dict[str, np.ndarray]], float]:
    """One job: the switch and the workers in their namespaces; each rank's results, and the slowest time."""
    path = cfg.write(workdir / "job.toml")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    try:
        switch, _ = spawn_switch(path, workdir / "switch.ready", prefix=("ip", "netns", "exec", bed.ns(None)),
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except RuntimeError as exc:
        raise SwitchAggError(f"the switch did not start in namespace {bed.ns(None)}: {exc}") from None
    workers: list[subprocess.Popen] = []
    try:
        for r in range(cfg.n_workers):
            workers.append(subprocess.Popen(["ip", "netns", "exec", bed.ns(r), sys.executable, "-m",
                                             "switchagg.benchmarks.loss", str(path), str(r),
                                             str(workdir / f"r{r}.npz")], env=env, stderr=subprocess.PIPE, text=True))
        for r, w in enumerate(workers):
            try:
                _, err = w.communicate(timeout=RUN_LIMIT)
            except subprocess.TimeoutExpired:
                raise SwitchAggError(f"loss bench worker {r} had not finished after {RUN_LIMIT} s") from None
            if w.returncode < 0:  # a signal, with nothing on stderr: say so rather than print an empty reason
                raise SwitchAggError(f"loss bench worker {r} was killed by {signal.Signals(-w.returncode).name} "
                                     "(the bench sends none: another process or the kernel did)")
            if w.returncode:
                raise SwitchAggError(f"loss bench worker {r} failed: {err[-2000:]}")
    finally:  # the workers a failed one left behind would hold the bed's addresses in the next run
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.communicate()
        switch.terminate()
        switch.wait(10)
    runs = [dict(np.load(workdir / f"r{r}.npz")) for r in range(cfg.n_workers)]
    return runs, max(float(r["seconds"]) for r in runs)


def call_times(ranks: list[dict[str, np.ndarray]], name: str) -> np.ndarray:
    """Each call of sequence ``name``'s time: from the last rank's end of the call before to its end of this."""
    return np.diff(np.max([r[f"{name}_marks"] for r in ranks], axis=0))


@functools.cache
def _int_sums(n: int, name: str) -> tuple[np.ndarray | None, ...]:
    """Each call of sequence ``name``: the digest of its int32 sum over ``n`` ranks by numpy (None: float32)."""
    return tuple(None if floats else digest(np.sum([inputs(w, length)[1].astype(np.int64) for w in range(n)],
                                                   axis=0).astype(np.int32))
                 for length, floats in SEQUENCES[name])


def _exact(runs: list[dict[str, np.ndarray]], lossless: list[dict[str, np.ndarray]], n: int) -> bool:
    for length in PRIMES:
        ints = np.sum([inputs(w, length)[1].astype(np.int64) for w in range(n)], axis=0).astype(np.int32)
        for r, base in zip(runs, lossless, strict=True):
            if not (np.array_equal(r[f"i{length}"], ints) and np.array_equal(r[f"f{length}"], base[f"f{length}"])
                    and np.array_equal(r[f"f{length}"], runs[0][f"f{length}"])):
                return False
    for name in SEQUENCES:
        for i, ints in enumerate(_int_sums(n, name)):
            key = f"{name}{i}"
            for r, base in zip(runs, lossless, strict=True):
                if not (np.array_equal(r[key], base[key]) and np.array_equal(r[key], runs[0][key])
                        and (ints is None or np.array_equal(r[key], ints))):
                    return False
    return True


def missing() -> str | None:
    """Why the loss bench cannot run here, or None."""
    from .. import netns

    return netns.missing("the loss bench", "network namespaces and nftables", NETNS_TOOLS)


def run_loss_bench(*, worker_counts: tuple[int, ...] = (4, 7), rates: tuple[float, ...] = RATES,
                   recoveries: tuple[str, ...] = ("resend", "query"), runs: tuple[Runs, ...] = (1,),
                   rounds: int = 1, plot: str | None = None) -> int:
    """The same job at every loss rate in every bed (``runs``: a run length each, :func:`drop_match`)
    for each worker count and loss recovery, ``rounds`` times over; a line per run, and a table at
    the end of each rate's and run length's median over the rounds.

    A round runs every bed, every recovery at every rate in turn, so that a drift of the machine's
    speed (other processes, its clock) reaches every figure alike: on a busy two-core host one run's
    time over the lossless one varies by 0.2x or more from round to round, the median of five by
    less. Each bed's lossless time is its own first rate's (0%): the gso bed's with its offloads on.
    """
    if rounds < 1:
        raise SwitchAggError(f"--rounds must be 1 or more, not {rounds}")
    for length in runs:
        if length != GSO and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise SwitchAggError(f"--loss-runs {length}: give run lengths in packets (1 or more) or {GSO}")
    for rate in rates:
        if not 0 <= rate <= 99.9:
            raise SwitchAggError(f"--loss-rates {rate:g}: a loss rate is a percentage from 0 to 99.9")
    problem = missing()
    if problem:
        raise SwitchAggError(problem)
    values = sum(PRIMES)
    print(f"loss bench: K=64, {values} float32 and {values} int32 values per worker, loss on every hop's input "
          f"(contribution and result) in runs of {' '.join(map(str, runs))}, {DUP}% duplication at "
          f"{max(rates):g}%, {rounds} round(s)")
    table: dict[tuple[int, str, Runs], list[Row]] = {}
    prefix, bed = own_prefix(), None
    try:
        for n in worker_counts:
            runs_of: dict[tuple[str, Runs, float], list[_Run]] = {}
            failed: dict[tuple[str, Runs, float], int] = {}
            for rnd, length in itertools.product(range(rounds), runs):
                if bed is None or bed.n != n or bed.offloads != (length == GSO):
                    bed = Bed(n, offloads=length == GSO, prefix=prefix)
                for recovery in recoveries:
                    cfg = dataclasses.replace(bed.config, loss_recovery=recovery)
                    lossless: _Run | None = None
                    for i, rate in enumerate(rates):
                        bed.impair(length, rate, DUP if rate == max(rates) and rate else 0)
                        try:
                            with tempfile.TemporaryDirectory() as tmp:
                                ranks, seconds = _run(bed, cfg, Path(tmp))
                        except SwitchAggError as exc:  # a call that stalled, say: the other runs still tell
                            lost = rates[i:] if lossless is None else (rate,)  # no lossless run: no ratios
                            for r in lost:
                                failed[(recovery, length, r)] = failed.get((recovery, length, r), 0) + 1
                            print(f"{n} workers, {recovery}, {rate:g}% loss, runs {length}, round {rnd + 1}: FAILED "
                                  f"({str(exc).strip().splitlines()[-1]})"
                                  + (", so no lossless time for the rates after it" if len(lost) > 1 else ""),
                                  flush=True)
                            if lossless is None:
                                break
                            continue
                        packets, nbytes = bed.drops()
                        calls = {name: call_times(ranks, name) for name in SEQUENCES}
                        lossless = lossless or _Run(seconds, ranks, 0, 0, 0, 0, True, seconds, calls, calls)
                        run = _Run(seconds, ranks, sum(int(r["resent"]) for r in ranks),
                                   sum(int(r["asked"]) for r in ranks),
                                   dropped_datagrams(length, packets, nbytes, cfg.values_per_packet), packets,
                                   _exact(ranks, lossless.ranks, n), lossless.seconds, calls, lossless.calls)
                        runs_of.setdefault((recovery, length, rate), []).append(run)
                        print(_run_line(n, recovery, length, rate, rnd, run), flush=True)
            for recovery, length in itertools.product(recoveries, runs):
                table[(n, recovery, length)] = [_row(recovery, length, rate, runs_of.get((recovery, length, rate), []),
                                                     failed.get((recovery, length, rate), 0))
                                                for rate in dict.fromkeys(rates)]
    finally:
        teardown(prefix)
    print(tables(table, rounds))
    if plot:
        _plot(plot, table)
        print(f"plot: {plot}", file=sys.stderr)
    return 0 if all(r.exact and not r.failed for rows in table.values() for r in rows) else 1


class _Run(NamedTuple):
    """One run of the job: the slowest rank's time, each rank's results, and what it cost."""

    seconds: float
    ranks: list[dict[str, np.ndarray]]
    resent: int
    asked: int
    dropped: int  # datagrams (dropped_datagrams)
    packets: int  # packets the drop rules took (a GSO super-packet is one)
    exact: bool
    lossless: float  # the same round's and bed's lossless time
    calls: dict[str, np.ndarray]  # each call of each sequence's time
    lossless_calls: dict[str, np.ndarray]  # and in the same round's and bed's lossless run


def _run_line(n: int, recovery: str, runs: Runs, rate: float, rnd: int, run: _Run) -> str:
    """A run's figures, and each sequence's on a line of its own with its slowest call (which, its size,
    its lossless and lossy times), so that a high p99 is a reading, not a guess."""
    length = run_length(runs, run.dropped, run.packets)
    measured = f" ({length:.1f} datagrams a drop)" if runs == GSO and length is not None else ""
    in_packets = f" in {run.packets} packets" if runs == GSO else ""
    line = (f"{n} workers, {recovery}, {rate:g}% loss, runs {runs}{measured}, round {rnd + 1}: {run.seconds:.2f} s "
            f"({run.seconds / run.lossless:.2f}x lossless), resent {run.resent}, asked {run.asked}, "
            f"dropped {run.dropped}{in_packets}, {'bit-exact' if run.exact else 'NOT EXACT'}")
    for name, calls in SEQUENCES.items():
        times, base = run.calls[name], run.lossless_calls[name]
        median, p99, worst, total = call_slowdowns(times, base)
        slowest = int(np.argmax(times / base))
        resent, asked = np.sum([r[f"{name}_costs"][slowest] for r in run.ranks], axis=0)
        line += (f"\n  {name} sequence {times.sum():.2f} s ({total:.2f}x), per call median {median:.2f}x "
                 f"p99 {p99:.2f}x worst {worst:.2f}x (call {slowest + 1}, {calls[slowest][0]} values: "
                 f"{base[slowest] * 1e3:.1f} ms lossless, {times[slowest] * 1e3:.1f} ms, resent {resent}, "
                 f"asked {asked})")
    return line


def _row(recovery: str, runs: Runs, rate: float, group: list[_Run], failed: int) -> Row:
    if not group:  # every round's run failed
        nan = float("nan")
        return Row(recovery, runs, run_length(runs, 0, 0), rate, nan, nan, nan, nan, 0, 0, 0, False,
                   dict.fromkeys(SEQUENCES, Calls(nan, nan, nan, nan, nan)), 0, failed)
    ratios = [r.seconds / r.lossless for r in group]
    dropped = sum(r.dropped for r in group)
    return Row(recovery, runs, run_length(runs, dropped, sum(r.packets for r in group)), rate,
               float(np.median([r.seconds for r in group])), float(np.median(ratios)), min(ratios), max(ratios),
               sum(r.resent for r in group), sum(r.asked for r in group), dropped, all(r.exact for r in group),
               {name: _calls(name, group) for name in SEQUENCES}, len(group), failed)


def _calls(name: str, group: list[_Run]) -> Calls:
    times, base = [r.calls[name] for r in group], [r.lossless_calls[name] for r in group]
    median, p99, worst, _ = call_slowdowns(np.concatenate(times), np.concatenate(base))
    return Calls(float(np.median([t.sum() for t in times])),
                 float(np.median([t.sum() / b.sum() for t, b in zip(times, base, strict=True)])), median, p99, worst)


def _key(n: int, recovery: str, runs: Runs) -> str:
    """A row's name in the summary lines: ``7w-resend`` for independent drops, as before run lengths."""
    return f"{n}w-{recovery}" + ("" if runs == 1 else "-gso" if runs == GSO else f"-runs{runs}")


def tables(table: dict[tuple[int, str, Runs], list[Row]], rounds: int) -> str:
    """The bench's tables, the run length next to the rate in each, and its summary lines."""
    lines = ["workers  recovery  runs  run_len  loss%  seconds  x_lossless      range  resent  asked  dropped  "
             "resent/dropped  asked/dropped  exact"]
    for (n, _, _), rows in table.items():
        for r in rows:
            spread = f"{r.low:.2f}-{r.high:.2f}" if rounds > 1 else "-"
            lines.append(f"{n:>7}  {r.recovery:>8}  {r.runs!s:>4}  {r.length():>7}  {r.rate:>5g}  {r.seconds:>7.2f}  "
                         f"{r.slowdown:>10.2f}  {spread:>9}  {r.resent:>6}  {r.asked:>5}  {r.dropped:>7}  "
                         f"{r.per_drop(r.resent):>14}  {r.per_drop(r.asked):>13}  {r.verdict()}")
    about = {"random": f"{RANDOM_CALLS} calls of 1-{RANDOM_MAX} values, seed {RANDOM_SEED}",
             "growing": f"1, 2, 4 ... {RANDOM_MAX} values, {GROWING_PASSES} passes, int32 and float32 in turn"}
    for name in SEQUENCES:
        lines += [f"{name} sequence ({about[name]}): each call's time over the same call's lossless time, all "
                  "rounds' calls; the total's, the median over the rounds",
                  "workers  recovery  runs  run_len  loss%  seconds  total_x  median_x    p99_x  worst_x"]
        for (n, _, _), rows in table.items():
            for r in rows:
                c = r.sequences[name]
                lines.append(f"{n:>7}  {r.recovery:>8}  {r.runs!s:>4}  {r.length():>7}  {r.rate:>5g}  "
                             f"{c.seconds:>7.2f}  {c.total:>7.2f}  {c.median:>8.2f}  {c.p99:>7.2f}  {c.worst:>7.2f}")
    lines.append("slowdown_at_max_loss=" + " ".join(f"{_key(*key)}:{rows[-1].slowdown:.2f}"
                                                     for key, rows in table.items()))
    for name in SEQUENCES:
        lines.append(f"{name}_at_max_loss=" + " ".join(
            f"{_key(*key)}:total {rows[-1].sequences[name].total:.2f} p99 {rows[-1].sequences[name].p99:.2f}"
            for key, rows in table.items()))
    return "\n".join(lines)


def _plot(path: str, table: dict[tuple[int, str, Runs], list[Row]]) -> None:
    """The fixed sequence's slowdown per loss rate (a line per bed), and the slowdown of each
    sequence per run length (a line per loss rate and recovery; the gso bed at its measured length)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SwitchAggError("--plot needs matplotlib: pip install 'switchagg[bench]'") from None
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    by_rate, *by_length = axes.flat
    for (n, recovery, runs), rows in table.items():  # the median over the rounds, bars from the least to the most
        by_rate.errorbar([r.rate for r in rows], [r.slowdown for r in rows], capsize=3, fmt="o-",
                         yerr=[[r.slowdown - r.low for r in rows], [r.high - r.slowdown for r in rows]],
                         label=f"{n} workers, {recovery}, runs {runs}")
    by_rate.set(title="fixed sequence per loss rate", xlabel="loss per hop (%)", ylabel="time over lossless")
    lines: dict[tuple[int, str, float], list[Row]] = {}
    for (n, recovery, _), rows in table.items():
        for r in rows:
            if r.rate and r.run_length is not None:
                lines.setdefault((n, recovery, r.rate), []).append(r)
    panels: list[tuple[str, Callable[[Row], float]]] = [
        ("fixed sequence", lambda r: r.slowdown),
        *((f"{name} sequence (total)", lambda r, name=name: r.sequences[name].total) for name in SEQUENCES)]
    for ax, (title, value) in zip(by_length, panels, strict=True):
        for (n, recovery, rate), rows in lines.items():
            rows = sorted(rows, key=lambda r: r.run_length)
            (line,) = ax.plot([r.run_length for r in rows], [value(r) for r in rows], "o-",
                              label=f"{n} workers, {recovery}, {rate:g}%")
            for r in rows:
                if r.runs == GSO:
                    ax.annotate(GSO, (r.run_length, value(r)), textcoords="offset points", xytext=(4, 4))
                if not r.finished:
                    _plot_failed(ax, r.run_length, line.get_color())
        ax.set_xscale("log", base=2)
        ax.set(title=f"{title} per run length", xlabel="datagrams a drop takes (gso: measured)",
               ylabel="time over lossless (x at the top: failed)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_failed(ax: Any, x: float, color: str) -> None:
    """A rate and run length whose runs all failed have no figure to draw: a cross at the top says so."""
    ax.plot(x, 0.97, "x", color=color, transform=ax.get_xaxis_transform())


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])
