"""``switchagg bench --loss``: what packet loss costs an allreduce, on network namespaces with real kernel loss.

The embedded switch runs in a namespace of its own, each worker in another, joined by a bridge.
nftables drops switchagg packets at random on every namespace's input (so a packet crosses two
lossy hops: contribution into the switch, result into the worker; at 0% the same rule drops none)
and duplicates 1% of what the workers send at the highest loss rate. Each worker allreduces int32
and float32 arrays of prime lengths (about 205k values of each, K = 64); the same job runs at every
loss rate, ``rounds`` times over, and the bench prints per rate the time over the same round's
lossless time (the median over the rounds, and its range), the contributions resent and the QUERY
packets sent (in the timed calls, not the warm-up that waits for every rank to start), each over
the packets nftables dropped (its own counters), and whether every sum came out bit-exact (int32
against numpy, float32 against the lossless run, on every rank), for each ``loss_recovery`` of the
job (``resend``: every worker resends; ``query``: workers ask the switch first). Then each worker
runs a seeded sequence of calls of random sizes (``RANDOM_CALLS`` of 1 to 256k values, int32 or
float32 at random, the same sequence on every rank and in every run): a call's time is the slowest
rank's, and the bench prints the median, p99 and worst of each call's time over the same call's in
the lossless run, and the sequence's total over the lossless total. The fixed sequence starts with
its largest calls in a fresh client; the random one mixes small calls between large ones, whatever
the window learned before (issue 27: small calls then stalled for 0.1-0.6 s at 5% loss). Needs
root, ``ip`` and ``nft``; it makes its namespaces and addresses (10.81.0.0/24, inside them only)
and removes them when done.

``python -m switchagg.benchmarks.loss CONFIG RANK OUT`` is one worker.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..config import Endpoint, JobConfig, WorkerSpec
from ..errors import SwitchAggError
from ..loopback import spawn_switch

PRIMES = (131071, 65521, 8191, 509, 127, 3)  # lengths of the arrays each worker reduces
PREFIX = "salb"
SWITCH_IP = "10.81.0.254"
RATES = (0.0, 0.1, 1.0, 5.0)  # percent, on each hop
DUP = 1  # percent duplicated at the highest rate
RANDOM_CALLS = 40  # calls in the random sequence
RANDOM_MAX = 1 << 18  # values in its largest call
RANDOM_SEED = 27


class Row(NamedTuple):
    """One loss rate's runs, one per round."""

    recovery: str  # the job's loss_recovery
    rate: float  # percent per hop
    seconds: float  # the slowest rank's timed calls, the median over the rounds
    slowdown: float  # the median over the rounds of the time over the same round's lossless time
    low: float  # and the least and the most of those
    high: float
    resent: int  # contributions sent again, all ranks and rounds
    asked: int  # QUERY packets, all ranks and rounds
    dropped: int  # by nftables, all rounds
    exact: bool  # in every round
    random_seconds: float  # the random sequence: its time, the median over the rounds
    random_total: float  # its time over the lossless one, the median over the rounds
    random_median: float  # each call's time over its lossless time, all rounds' calls: the median,
    random_p99: float  # the 99th percentile
    random_worst: float  # and the most

    def per_drop(self, what: int) -> str:
        return f"{what / self.dropped:.2f}" if self.dropped else "-"


def random_calls(count: int = RANDOM_CALLS, seed: int = RANDOM_SEED) -> list[tuple[int, bool]]:
    """The random sequence: (length, whether float32) of each call, 1 to ``RANDOM_MAX`` values."""
    rng = np.random.default_rng(seed)
    return [(int(n), bool(f)) for n, f in zip(rng.integers(1, RANDOM_MAX + 1, count), rng.random(count) < 0.5,
                                              strict=True)]


def call_slowdowns(times: np.ndarray, lossless: np.ndarray) -> tuple[float, float, float, float]:
    """Each call's time over the same call's lossless time: its median, p99 and worst, and the total's."""
    ratios = np.asarray(times) / np.asarray(lossless)
    return (float(np.median(ratios)), float(np.percentile(ratios, 99)), float(ratios.max()),
            float(np.sum(times) / np.sum(lossless)))


def inputs(rank: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s seeded float32 and int32 arrays of ``length`` values."""
    rng = np.random.default_rng([rank, length])
    return rng.standard_normal(length).astype(np.float32), rng.integers(-2**20, 2**20, length).astype(np.int32)


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
        # when each call of the random sequence ended (the system's monotonic clock, which every rank
        # shares): the last rank's end of one call to the last rank's end of the next is that call's time
        marks = [time.perf_counter()]
        for i, (length, floats) in enumerate(random_calls()):
            f, ints = inputs(rank, length)
            results[f"r{i}"] = client.allreduce(f if floats else ints)[:64]  # its first values, to check
            marks.append(time.perf_counter())
        results["marks"] = np.array(marks)
    np.savez(out, **results)


def _ns(i: int | None) -> str:
    return f"{PREFIX}-sw" if i is None else f"{PREFIX}-w{i}"


def _topology(n: int) -> JobConfig:
    from .. import netns

    _teardown()
    sw = _ns(None)
    netns.add_namespace(sw)
    netns.sh("ip", "link", "add", "br0", "type", "bridge", ns=sw)
    netns.quiet_link("br0", sw)
    netns.sh("ip", "addr", "add", f"{SWITCH_IP}/24", "dev", "br0", ns=sw)
    for i in range(n):
        netns.add_namespace(_ns(i))
        netns.veth_between(_ns(i), "eth0", sw, f"s{i}")
        netns.sh("ip", "link", "set", f"s{i}", "master", "br0", ns=sw)
        netns.sh("ip", "addr", "add", f"10.81.0.{i + 1}/24", "dev", "eth0", ns=_ns(i))
    return JobConfig(switch=Endpoint(SWITCH_IP, 16711), job_id=3, key=0x1055, slot_base=0, slot_count=1024,
                     values_per_packet=64,
                     workers=tuple(WorkerSpec(Endpoint(f"10.81.0.{i + 1}", 45000)) for i in range(n)))


def _teardown() -> None:
    from .. import netns

    for ns in netns.namespaces(PREFIX):
        netns.delete_namespace(ns)


def _impair(n: int, rate: float, dup: int) -> None:
    """``rate`` percent of switchagg packets dropped on every namespace's input; ``dup`` percent duplicated.

    At 0% the same rule runs and drops nothing: every packet then costs the firewall the same work
    as under loss (the lossless run took about 6% longer with it than without any rule), so that
    the ratios measure what the loss costs, not the means of making it.
    """
    from .. import netns

    for i in [None, *range(n)]:
        ns = _ns(i)
        netns.sh("nft", "delete", "table", "ip", "salb", ns=ns, check=False)
        match = "udp dport 16711" if i is None else "udp sport 16711"
        rules = ["add table ip salb", "add chain ip salb in { type filter hook input priority 0 ; }",
                 f"add rule ip salb in {match} numgen random mod 1000 < {round(rate * 10)} counter drop"]
        if dup and i is not None:
            rules += ["add chain ip salb out { type filter hook output priority 0 ; }",
                      f"add rule ip salb out udp dport 16711 numgen random mod 100 < {dup} dup to {SWITCH_IP} "
                      "device eth0"]
        for rule in rules:
            netns.sh("nft", *rule.split(), ns=ns)


def _dropped(n: int) -> int:
    from .. import netns

    total = 0
    for i in [None, *range(n)]:
        listing = netns.sh("nft", "list", "table", "ip", "salb", ns=_ns(i), check=False).stdout
        total += sum(int(x) for x in re.findall(r"counter packets (\d+)", listing))
    return total


def _run(cfg: JobConfig, workdir: Path) -> tuple[list[dict[str, np.ndarray]], float]:
    """One job: the switch and the workers in their namespaces; each rank's results, and the slowest time."""
    path = cfg.write(workdir / "job.toml")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    try:
        switch, _ = spawn_switch(path, workdir / "switch.ready", prefix=("ip", "netns", "exec", _ns(None)), env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except RuntimeError as exc:
        raise SwitchAggError(f"the switch did not start in namespace {_ns(None)}: {exc}") from None
    try:
        workers = [subprocess.Popen(["ip", "netns", "exec", _ns(r), sys.executable, "-m", "switchagg.benchmarks.loss",
                                     str(path), str(r), str(workdir / f"r{r}.npz")], env=env,
                                    stderr=subprocess.PIPE, text=True) for r in range(cfg.n_workers)]
        for r, w in enumerate(workers):
            _, err = w.communicate(timeout=1800)
            if w.returncode:
                raise SwitchAggError(f"loss bench worker {r} failed: {err[-2000:]}")
    finally:
        switch.terminate()
        switch.wait(10)
    runs = [dict(np.load(workdir / f"r{r}.npz")) for r in range(cfg.n_workers)]
    return runs, max(float(r["seconds"]) for r in runs)


def call_times(ranks: list[dict[str, np.ndarray]]) -> np.ndarray:
    """Each call of the random sequence's time: from the last rank's end of the call before to its end of this."""
    return np.diff(np.max([r["marks"] for r in ranks], axis=0))


def _exact(runs: list[dict[str, np.ndarray]], lossless: list[dict[str, np.ndarray]], n: int) -> bool:
    for length in PRIMES:
        ints = np.sum([inputs(w, length)[1].astype(np.int64) for w in range(n)], axis=0).astype(np.int32)
        for r, base in zip(runs, lossless, strict=True):
            if not (np.array_equal(r[f"i{length}"], ints) and np.array_equal(r[f"f{length}"], base[f"f{length}"])
                    and np.array_equal(r[f"f{length}"], runs[0][f"f{length}"])):
                return False
    for i, (length, floats) in enumerate(random_calls()):
        ints = np.sum([inputs(w, length)[1][:64].astype(np.int64) for w in range(n)], axis=0).astype(np.int32)
        for r, base in zip(runs, lossless, strict=True):
            if not (np.array_equal(r[f"r{i}"], base[f"r{i}"]) and np.array_equal(r[f"r{i}"], runs[0][f"r{i}"])
                    and (floats or np.array_equal(r[f"r{i}"], ints))):
                return False
    return True


def missing() -> str | None:
    """Why the loss bench cannot run here, or None."""
    if os.geteuid() != 0:
        return "the loss bench needs root (network namespaces and nftables): run it with sudo"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables"), ("ethtool", "ethtool")):
        if shutil.which(tool) is None:
            return f"the loss bench needs `{tool}`: apt-get install {package}"
    return None


def run_loss_bench(*, worker_counts: tuple[int, ...] = (4, 7), rates: tuple[float, ...] = RATES,
                   recoveries: tuple[str, ...] = ("resend", "query"), rounds: int = 1,
                   plot: str | None = None) -> int:
    """The same job at every loss rate for each worker count and loss recovery, ``rounds`` times over;
    a line per run, and a table at the end of each rate's median over the rounds.

    A round runs every recovery at every rate in turn, so that a drift of the machine's speed
    (other processes, its clock) reaches every figure alike: on a busy two-core host one run's time
    over the lossless one varies by 0.2x or more from round to round, the median of five by less.
    """
    if rounds < 1:
        raise SwitchAggError(f"--rounds must be 1 or more, not {rounds}")
    problem = missing()
    if problem:
        raise SwitchAggError(problem)
    values = sum(PRIMES)
    print(f"loss bench: K=64, {values} float32 and {values} int32 values per worker, loss on every hop's input "
          f"(contribution and result), {DUP}% duplication at {max(rates):g}%, {rounds} round(s)")
    table: dict[tuple[int, str], list[Row]] = {}
    try:
        for n in worker_counts:
            topology = _topology(n)
            runs_of: dict[tuple[str, float], list[_Run]] = {}
            for rnd, recovery in itertools.product(range(rounds), recoveries):
                cfg = dataclasses.replace(topology, loss_recovery=recovery)
                lossless: _Run | None = None
                for rate in rates:
                    _impair(n, rate, DUP if rate == max(rates) and rate else 0)
                    with tempfile.TemporaryDirectory() as tmp:
                        ranks, seconds = _run(cfg, Path(tmp))
                    calls = call_times(ranks)
                    lossless = lossless or _Run(seconds, ranks, 0, 0, 0, True, seconds, calls, calls)
                    run = _Run(seconds, ranks, sum(int(r["resent"]) for r in ranks),
                               sum(int(r["asked"]) for r in ranks), _dropped(n), _exact(ranks, lossless.ranks, n),
                               lossless.seconds, calls, lossless.calls)
                    median, p99, worst, total = call_slowdowns(calls, lossless.calls)
                    slowest = int(np.argmax(calls / lossless.calls))
                    runs_of.setdefault((recovery, rate), []).append(run)
                    print(f"{n} workers, {recovery}, {rate:g}% loss, round {rnd + 1}: {seconds:.2f} s "
                          f"({seconds / run.lossless:.2f}x lossless), resent {run.resent}, asked {run.asked}, "
                          f"dropped {run.dropped}, {'bit-exact' if run.exact else 'NOT EXACT'}; random sequence "
                          f"{calls.sum():.2f} s ({total:.2f}x), per call median {median:.2f}x p99 {p99:.2f}x "
                          f"worst {worst:.2f}x (call {slowest + 1}, {random_calls()[slowest][0]} values: "
                          f"{lossless.calls[slowest] * 1e3:.1f} ms lossless, {calls[slowest] * 1e3:.1f} ms)",
                          flush=True)
            for (recovery, rate), runs in runs_of.items():
                table.setdefault((n, recovery), []).append(_row(recovery, rate, runs))
    finally:
        _teardown()
    print("workers  recovery  loss%  seconds  x_lossless      range  resent  asked  dropped  resent/dropped  "
          "asked/dropped  exact")
    for (n, _), rows in table.items():
        for r in rows:
            spread = f"{r.low:.2f}-{r.high:.2f}" if rounds > 1 else "-"
            print(f"{n:>7}  {r.recovery:>8}  {r.rate:>5g}  {r.seconds:>7.2f}  {r.slowdown:>10.2f}  {spread:>9}  "
                  f"{r.resent:>6}  {r.asked:>5}  {r.dropped:>7}  {r.per_drop(r.resent):>14}  "
                  f"{r.per_drop(r.asked):>13}  {'yes' if r.exact else 'NO'}")
    print(f"random sequence ({RANDOM_CALLS} calls of 1-{RANDOM_MAX} values, seed {RANDOM_SEED}): each call's time "
          "over the same call's lossless time, all rounds' calls; the total's, the median over the rounds")
    print("workers  recovery  loss%  seconds  total_x  median_x  p99_x  worst_x")
    for (n, _), rows in table.items():
        for r in rows:
            print(f"{n:>7}  {r.recovery:>8}  {r.rate:>5g}  {r.random_seconds:>7.2f}  {r.random_total:>7.2f}  "
                  f"{r.random_median:>8.2f}  {r.random_p99:>5.2f}  {r.random_worst:>7.2f}")
    print("slowdown_at_max_loss=" + " ".join(f"{n}w-{recovery}:{rows[-1].slowdown:.2f}"
                                              for (n, recovery), rows in table.items()))
    print("random_at_max_loss=" + " ".join(f"{n}w-{recovery}:total {rows[-1].random_total:.2f} "
                                           f"p99 {rows[-1].random_p99:.2f}" for (n, recovery), rows in table.items()))
    if plot:
        _plot(plot, table)
        print(f"plot: {plot}", file=sys.stderr)
    return 0 if all(r.exact for rows in table.values() for r in rows) else 1


class _Run(NamedTuple):
    """One run of the job: the slowest rank's time, each rank's results, and what it cost."""

    seconds: float
    ranks: list[dict[str, np.ndarray]]
    resent: int
    asked: int
    dropped: int
    exact: bool
    lossless: float  # the same round's lossless time
    calls: np.ndarray  # each call of the random sequence's time
    lossless_calls: np.ndarray  # and in the same round's lossless run


def _row(recovery: str, rate: float, runs: list[_Run]) -> Row:
    ratios = [r.seconds / r.lossless for r in runs]
    median, p99, worst, _ = call_slowdowns(np.concatenate([r.calls for r in runs]),
                                           np.concatenate([r.lossless_calls for r in runs]))
    return Row(recovery, rate, float(np.median([r.seconds for r in runs])), float(np.median(ratios)), min(ratios),
               max(ratios), sum(r.resent for r in runs), sum(r.asked for r in runs), sum(r.dropped for r in runs),
               all(r.exact for r in runs), float(np.median([r.calls.sum() for r in runs])),
               float(np.median([r.calls.sum() / r.lossless_calls.sum() for r in runs])), median, p99, worst)


def _plot(path: str, table: dict[tuple[int, str], list[Row]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SwitchAggError("--plot needs matplotlib: pip install 'switchagg[bench]'") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    for (n, recovery), rows in table.items():  # the median over the rounds, bars from the least to the most
        ax.errorbar([r.rate for r in rows], [r.slowdown for r in rows], capsize=3, fmt="o-",
                    yerr=[[r.slowdown - r.low for r in rows], [r.high - r.slowdown for r in rows]],
                    label=f"{n} workers, {recovery}")
    ax.set(title="allreduce time under loss (K=64)", xlabel="loss per hop (%)", ylabel="time over lossless")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])
