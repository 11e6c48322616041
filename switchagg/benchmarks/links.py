"""``switchagg bench --link-rate MBIT``: gloo against switchagg on links with a rate, the figure a switch exists for.

A ring allreduce moves ``2(N-1)/N`` of the tensor over each worker's link each way; through a
switch each worker sends its tensor once and receives the sum once, plus each packet's headers. On
links of one rate the switch's allreduce is then at most ``2(N-1)/N`` over the wire's bytes per
value byte faster than the ring (:func:`bound`): 1.19 at 4 workers and K = 64, 1.64 at 8 workers and
K = 256. On loopback (``switchagg bench``) there is no link, only the CPU, so that figure never shows.

The bed is network namespaces: the embedded switch in one, with a bridge; each worker in another,
joined to the bridge by a veth whose both ends shape their egress with tbf at the rate (the worker's
end: what it sends, to the switch or to its ring neighbour; the bridge port's: what it receives),
so each worker has one "NIC" of that rate each way (:func:`tbf_sizes` says how deep its queue is,
and why). The same torch program runs on every worker (``ip netns exec``), once over gloo and once
over ``switchagg`` (its ``SWITCHAGG_*`` variables pointing at the switch's namespace): it allreduces
a float32 tensor of ``mib`` MiB, a warm-up and ``reps`` timed calls, each after a barrier, and a
call's time is the slowest rank's. Every sum is checked whole: rank r's input is ``(r + 1)`` times
one seeded vector of small integers, whose sums both backends give exactly.

Per worker count, K and rate it prints both times, their ratio (gloo's over switchagg's), the bound
and the ratio over it, and each side's time against its own ideal at the rate (gloo's ring:
``2(N-1)/N`` of the tensor; switchagg: the tensor with its headers): on a small machine the CPU,
not the link, becomes the limit at some rate, and gloo's figure says which rates this machine
serves. The figures are the median over ``rounds`` rounds, each running gloo and every K back to
back (each first in turn), as ``switchagg bench`` does.

``loss`` drops that percentage of switchagg's packets at every namespace's input (nftables, as
``switchagg bench --loss``: a contribution into the switch and a result into the worker each cross
one lossy hop); ``burst`` drops them in runs of that many consecutive packets at the same average
rate. Gloo's TCP is left lossless. Each switchagg run then runs lossless and lossy back to back,
both with the rule in place (lossless at 0%, so both pay the firewall's work per packet), and the
bench prints the lossless time over the lossy one. Under loss the links carry switchagg's packets
one by one (:func:`build`'s ``per_packet``), which costs the kernel more CPU than the batches it
carries otherwise: a figure under loss is to be read against the lossless one beside it.

Needs root, ``ip``, ``tc`` and ``ethtool`` (and ``nft`` for loss); it makes its namespaces and addresses
(10.82.0.0/24, inside them only) and removes them when done, also on an error or Ctrl-C.

``python -m switchagg.benchmarks.links RANK WORLD`` is one worker: it reads tasks, one JSON
object a line, on stdin and answers each with a line on stdout.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import ConfigError, SwitchAggError
from ..loopback import spawn_switch
from ..wire import HEADER_SIZE, IP_UDP_OVERHEAD, default_slot_count, max_values_for_mtu
from .tasks import TaskWorkers, serve

PREFIX = "salk"
SUBNET = "10.82.0"
SWITCH_IP = f"{SUBNET}.254"
SWITCH_PORT = 16711
CONTROL_PORT = 16712
STORE_PORT = 29500  # torch's store, on rank 0's address
MTU = 1500  # the veths'
ETHERNET = 14  # what tbf counts of a frame besides its IP packet: the Ethernet header (veths have no FCS)
MAX_K = max_values_for_mtu(MTU)  # the largest K whose packet is not fragmented: 362
BURST_SECONDS = 0.001  # tbf's bucket: a millisecond of the rate,
BURST_FLOOR = 128 << 10  # and at least this many bytes
QUEUE_SECONDS = 0.005  # tbf's queue: 5 ms of the rate, or twice the largest switchagg window


def wire_overhead(k: int) -> float:
    """The bytes a switchagg packet of K values puts on the link per value byte: Ethernet, IPv4, UDP and the
    switchagg header around 4K value bytes (tbf counts the frame from its Ethernet header on)."""
    return (ETHERNET + IP_UDP_OVERHEAD + HEADER_SIZE + 4 * k) / (4 * k)


def ring_share(n: int) -> float:
    """The share of the tensor that a ring allreduce of ``n`` ranks moves over each rank's link, each way."""
    return 2 * (n - 1) / n


def bound(n: int, k: int) -> float:
    """The most switchagg can be faster than a ring on links of one rate: the ring's bytes over the switch's."""
    return ring_share(n) / wire_overhead(k)


def ideal_seconds(nbytes: int, mbit: float, share: float) -> float:
    """The time a link of ``mbit`` takes to carry ``share`` times ``nbytes`` each way: an allreduce's ideal,
    gloo's with :func:`ring_share`, switchagg's with :func:`wire_overhead`."""
    return share * nbytes * 8 / (mbit * 1e6)


def window_bytes(k: int) -> int:
    """The most a switchagg worker of K values keeps in flight: its job's slots (the default for K) in frames."""
    return default_slot_count(k) * (ETHERNET + IP_UDP_OVERHEAD + HEADER_SIZE + 4 * k)


def tbf_sizes(mbit: float, ks: Sequence[int]) -> tuple[int, int]:
    """tbf's bucket (``burst``) and queue (``limit``) in bytes at ``mbit``, for switchagg jobs of ``ks``.

    tbf drops a packet that arrives when ``limit`` bytes already wait, so a queue too short turns the
    shaping into loss, and the bench would measure loss recovery, not the rate. A switchagg worker keeps
    up to its window in flight (at most its slots' packets: :func:`window_bytes`), and where the link is
    the bottleneck all of it stands in the queue of its link (the window grows until it sees 32 ms of
    queueing, or reaches its slots), or of its bridge port, where the switch's results to it wait. So the
    queue holds twice the largest window (some 650 KB at K = 64, 10 ms at 500 Mbit/s), or 5 ms of the
    rate where that is more, and tbf never drops at steady state. TCP (gloo) paces itself (BBR here) and
    its socket's share of the queue is capped (TCP small queues); a drop slows it as on any link. Each
    run counts tbf's drops (the table's ``tbf_drops``), so a queue too short shows.

    The bucket is a millisecond of the rate, at least 128 KiB. tbf sends what the bucket holds at once and
    then sleeps on a timer; a buffer larger than the bucket it cuts into packets itself. A bucket of 64
    KiB (less than a 64 KiB GSO buffer with its segments' headers) made gloo's 32 MiB allreduce 1.4 times
    slower at 500 Mbit/s on this bed, 4 workers, and the kernel's softirq time some sixty times larger,
    tbf waking for nearly every packet; from 128 KiB on gloo ran at 0.95 of its ring's ideal (its TCP
    headers are the rest). A full bucket lets a link run above the rate for that many bytes, once per
    idle spell: a few tenths of a percent of a 32 MiB call.
    """
    rate = mbit * 1e6 / 8
    burst = max(BURST_FLOOR, round(rate * BURST_SECONDS))
    return burst, burst + max(round(rate * QUEUE_SECONDS), 2 * max(window_bytes(k) for k in ks))


def _ns(i: int | None) -> str:
    return f"{PREFIX}-sw" if i is None else f"{PREFIX}-w{i}"


def _address(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def build(n: int, *, per_packet: bool = False) -> None:
    """The namespaces: the switch's, with a bridge at :data:`SWITCH_IP`, and one per worker joined to it.

    Every link keeps its offloads, as a NIC does (:func:`switchagg.netns.quiet_link`): a socket's batch of
    segments, TCP's or switchagg's UDP GSO, crosses tbf, the veth and the bridge as one buffer (tbf still
    counts each segment's frame), so the kernel works per buffer, not per packet. Without them, on this
    two-core machine, 4 workers of K = 64 at 500 Mbit/s took 1.6 s a 32 MiB call, all of both cores;
    with them 0.69 s (0.98 of the link's ideal), the cores a third busy.

    ``per_packet`` (the bed under loss) leaves UDP's segmentation and every receive offload off, so each
    switchagg packet crosses the links and meets nftables alone: a rule that drops 1% of what it sees
    then drops 1% of the packets, at random, rather than 1% of the batches of up to 64 packets that a
    GSO send or GRO puts in one buffer. TCP keeps its segmentation offload: gloo runs as without loss.
    """
    from .. import netns

    teardown()
    sw = _ns(None)
    netns.add_namespace(sw)
    netns.sh("ip", "link", "add", "br0", "type", "bridge", ns=sw)
    netns.quiet_link("br0", sw, offloads="on")
    netns.sh("ip", "addr", "add", f"{SWITCH_IP}/24", "dev", "br0", ns=sw)
    for i in range(n):
        netns.add_namespace(_ns(i))
        netns.veth_between(_ns(i), "eth0", sw, f"s{i}", offloads="on")
        netns.sh("ip", "link", "set", f"s{i}", "master", "br0", ns=sw)
        netns.sh("ip", "addr", "add", f"{_address(i)}/24", "dev", "eth0", ns=_ns(i))
    if per_packet:
        for ns, dev in [*_links(n), (sw, "br0")]:
            netns.sh("ethtool", "-K", dev, "tx-udp-segmentation", "off", "gro", "off", ns=ns)


def _links(n: int) -> Iterator[tuple[str, str]]:
    """Each shaped end, as (namespace, device): every worker's and every bridge port's."""
    for i in range(n):
        yield _ns(i), "eth0"
        yield _ns(None), f"s{i}"


def shape(n: int, mbit: float, ks: Sequence[int]) -> None:
    """tbf at ``mbit`` on both ends of every worker's link (:func:`tbf_sizes`)."""
    shape_links(_links(n), mbit, ks, "the link bench")


def shape_links(links: Iterable[tuple[str, str]], mbit: float, ks: Sequence[int], bench: str) -> None:
    """tbf at ``mbit`` on each (namespace, device) of ``links``, sized for switchagg jobs of ``ks``."""
    from .. import netns

    burst, limit = tbf_sizes(mbit, ks)
    for ns, dev in links:
        try:
            netns.sh("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit:g}mbit", "burst", str(burst),
                     "limit", str(limit), ns=ns)
        except RuntimeError as exc:
            raise SwitchAggError(f"tc could not shape the link {dev} in namespace {ns} ({exc}): {bench} needs "
                                 "the kernel's tbf qdisc (CONFIG_NET_SCH_TBF; `modprobe sch_tbf`)") from None


def qdisc_stats(ns: str, dev: str) -> dict[str, int]:
    """A shaped end's tbf: its rate in bytes/s, the bytes and packets it sent, those it dropped, and how often
    a packet waited for tokens (``overlimits``)."""
    from .. import netns

    for q in json.loads(netns.sh("tc", "-j", "-s", "qdisc", "show", "dev", dev, ns=ns).stdout):
        if q["kind"] == "tbf":
            return {"rate": q["options"]["rate"], "bytes": q["bytes"], "packets": q["packets"], "drops": q["drops"],
                    "overlimits": q["overlimits"]}
    raise SwitchAggError(f"{dev} in namespace {ns} has no tbf qdisc: was the bed shaped?")


def _tbf_drops(n: int) -> int:
    return sum(qdisc_stats(ns, dev)["drops"] for ns, dev in _links(n))


def impair(n: int, percent: float, run: int | None) -> None:
    """Drop ``percent`` of switchagg's packets at every namespace's input (in runs of ``run``, if given)."""
    from .. import netns
    from .loss import drop_match

    drop = drop_match(run or 1, percent)
    for i in [None, *range(n)]:
        ns = _ns(i)
        netns.sh("nft", "delete", "table", "ip", PREFIX, ns=ns, check=False)
        match = f"udp dport {SWITCH_PORT}" if i is None else f"udp sport {SWITCH_PORT}"
        for rule in (f"add table ip {PREFIX}", f"add chain ip {PREFIX} in {{ type filter hook input priority 0 ; }}",
                     f"add rule ip {PREFIX} in {match} {drop} counter drop"):
            netns.sh("nft", *rule.split(), ns=ns)


def dropped(n: int) -> int:
    """The switchagg packets nftables dropped so far, in every namespace."""
    from .. import netns

    total = 0
    for i in [None, *range(n)]:
        listing = netns.sh("nft", "list", "table", "ip", PREFIX, ns=_ns(i), check=False).stdout
        total += sum(int(x) for x in re.findall(r"counter packets (\d+)", listing))
    return total


def teardown() -> None:
    """Remove every namespace of the bed (with them their veths, qdiscs and nftables tables)."""
    from .. import netns

    for ns in netns.namespaces(PREFIX):
        netns.delete_namespace(ns)


def missing(loss: bool = False) -> str | None:
    """Why the link bench cannot run here (``loss``: with nftables' loss), or None. ``ethtool`` sets the links'
    offloads, which move the limit from the kernel's work per packet to the links' rate."""
    from .. import netns

    return netns.missing("the link bench", "network namespaces and tc", (
        ("ip", "iproute2"), ("tc", "iproute2"), ("ethtool", "ethtool"), *((("nft", "nftables"),) if loss else ())))


# ---- a worker --------------------------------------------------------------------------------------------


def inputs(numel: int):
    """The seeded vector every rank scales by its rank + 1: small integers, whose sums float32 holds exactly
    and the switch's codec too (a chunk's scale keeps every integer below 2**20 times the workers)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(40)
    return torch.from_numpy(rng.integers(-1000, 1001, numel).astype(np.float32))


def _task(store: Any, rank: int, world: int, task: dict[str, Any]) -> dict[str, Any]:
    """One process group of ``task["backend"]``: a warm-up and ``reps`` timed allreduces, each sum checked."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ..distributed.options import ENV

    if task["backend"] == "switchagg":
        os.environ[ENV["values_per_packet"]] = str(task["k"])
    dist.init_process_group(task["backend"], store=dist.PrefixStore(task["tag"] + "/", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        base = inputs(task["numel"])
        x, expected = base * (rank + 1), base * (world * (world + 1) // 2)
        buf = x.clone()
        times, exact = [], True
        for i in range(task["reps"] + 1):
            buf.copy_(x)
            dist.barrier()  # every rank starts the call together: time the call, not the skew
            start = time.perf_counter()
            dist.all_reduce(buf)
            if i:
                times.append(time.perf_counter() - start)
            exact = exact and torch.equal(buf, expected)
        # every call's, as nftables' drops are (the group joined before its first call: all of them are the link's)
        resent = dist.group.WORLD.client.retransmissions if task["backend"] == "switchagg" else 0
    finally:
        dist.destroy_process_group()
    return {"times": times, "exact": exact, "resent": resent}


def _worker(rank: int, world: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import switchagg.distributed  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    store = dist.TCPStore(_address(0), STORE_PORT, world, rank == 0, timedelta(seconds=120))
    serve(lambda task: _task(store, rank, world, task))


# ---- the bench ---------------------------------------------------------------------------------------------


class _Workers:
    """The bed's switch and one worker process per rank, each in its namespace, fed tasks on stdin
    (:class:`~switchagg.benchmarks.tasks.TaskWorkers`)."""

    def __init__(self, n: int, workdir: Path) -> None:
        self.n = n
        token = secrets.token_hex(16)
        # gloo on the bed's link, not on the address the host's name has; a stall timeout of 30 s (5 by
        # default), as the loss bench's: a busy machine can starve a rank for seconds, which is measured here
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), OPENBLAS_NUM_THREADS="1",
                   SWITCHAGG_SWITCH=f"{SWITCH_IP}:{SWITCH_PORT}", SWITCHAGG_CONTROL=f"{SWITCH_IP}:{CONTROL_PORT}",
                   SWITCHAGG_CONTROL_TOKEN=token, SWITCHAGG_STALL_TIMEOUT="30", GLOO_SOCKET_IFNAME="eth0")
        try:
            self.switch, _ = spawn_switch(None, workdir / "switch.ready", prefix=("ip", "netns", "exec", _ns(None)),
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          switch_args=("--address", f"{SWITCH_IP}:{SWITCH_PORT}", "--control",
                                                       f"{SWITCH_IP}:{CONTROL_PORT}", "--control-any-address"))
        except RuntimeError as exc:
            raise SwitchAggError(f"the switch did not start in namespace {_ns(None)}: {exc}") from None
        try:  # each rank's node is its own namespace (they share the host's name)
            self.tasks = TaskWorkers(
                [["ip", "netns", "exec", _ns(r), sys.executable, "-m", "switchagg.benchmarks.links", str(r), str(n)]
                 for r in range(n)],
                [dict(env, SWITCHAGG_NODE=_ns(r)) for r in range(n)], [workdir / f"w{r}.log" for r in range(n)],
                "link bench")
        except BaseException:
            self._stop_switch(kill=True)
            raise

    def run(self, task: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        """Every rank's answer to ``task``; raises if one failed, died or did not answer within ``timeout``."""
        return self.tasks.run([task] * self.n, timeout)

    def close(self) -> None:
        self.tasks.close()
        self._stop_switch(kill=False)

    def kill(self) -> None:
        """Stop every process now (after an error: a rank may wait in a collective for the others)."""
        self.tasks.kill()
        self._stop_switch(kill=True)

    def _stop_switch(self, kill: bool) -> None:
        if kill:
            self.switch.kill()
            self.switch.wait()
            return
        self.switch.terminate()
        try:
            self.switch.wait(10)
        except subprocess.TimeoutExpired:
            self.switch.kill()
            self.switch.wait()


class Run(NamedTuple):
    """One side's run at one rate: the median call's time (the slowest rank's) and what it cost."""

    seconds: float
    exact: bool
    resent: int  # contributions resent, all ranks (switchagg)
    tbf_drops: int  # packets tbf dropped on every link during the run
    dropped: int  # packets nftables dropped during the run (with loss)


class Row(NamedTuple):
    """One (workers, K, rate): each side's median over the rounds and the medians of the rounds' ratios."""

    n: int
    k: int
    mbit: float
    gloo: float
    switchagg: float
    ratio: float  # gloo's time over switchagg's, the median of the rounds'
    bound: float
    gloo_ideal: float  # gloo's ideal time over its time
    switchagg_ideal: float  # the same for switchagg
    tbf_drops: tuple[int, int]  # gloo's, switchagg's, all rounds
    exact: bool
    lossy: float | None  # switchagg's time under loss, the median over the rounds
    lossless_over_lossy: float | None  # the median of the rounds'
    resent: int
    dropped: int


def _side(workers: _Workers, task: dict[str, Any], n: int, timeout: float, loss: bool) -> Run:
    drops, lost = _tbf_drops(n), dropped(n) if loss else 0
    answers = workers.run(task, timeout)
    calls = [max(a["times"][i] for a in answers) for i in range(task["reps"])]
    return Run(statistics.median(calls), all(a["exact"] for a in answers), sum(a["resent"] for a in answers),
               _tbf_drops(n) - drops, (dropped(n) - lost) if loss else 0)


def _row(n: int, k: int, mbit: float, nbytes: int, gloo: list[Run], ours: list[Run], lossy: list[Run]) -> Row:
    g, s = statistics.median(r.seconds for r in gloo), statistics.median(r.seconds for r in ours)
    return Row(n, k, mbit, g, s, statistics.median(a.seconds / b.seconds for a, b in zip(gloo, ours, strict=True)),
               bound(n, k), ideal_seconds(nbytes, mbit, ring_share(n)) / g,
               ideal_seconds(nbytes, mbit, wire_overhead(k)) / s,
               (sum(r.tbf_drops for r in gloo), sum(r.tbf_drops for r in ours)),
               all(r.exact for r in (*gloo, *ours, *lossy)),
               statistics.median(r.seconds for r in lossy) if lossy else None,
               statistics.median(a.seconds / b.seconds for a, b in zip(ours, lossy, strict=True)) if lossy else None,
               sum(r.resent for r in lossy), sum(r.dropped for r in lossy))


@contextmanager
def stopped_by_sigterm() -> Iterator[None]:
    """SIGTERM ends the bench as Ctrl-C does, through its ``finally`` (which removes the namespaces)."""
    def stop(*_: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def check(*, rates: Sequence[float], worker_counts: Sequence[int], ks: Sequence[int], mib: float, reps: int,
          rounds: int, loss: float | None, burst: int | None) -> None:
    """Refuse what the bench cannot run, before it builds anything."""
    if not rates or min(rates) <= 0:
        raise ConfigError(f"--link-rate {' '.join(f'{r:g}' for r in rates)}: give rates in Mbit/s, more than 0")
    if not worker_counts or not all(2 <= n <= 250 for n in worker_counts):
        raise ConfigError(f"--workers {' '.join(map(str, worker_counts))}: the link bench runs 2..250 workers")
    if not ks or not all(1 <= k <= MAX_K for k in ks):
        raise ConfigError(f"--values-per-packet {' '.join(map(str, ks))}: the bed's links carry 1..{MAX_K} values "
                          f"a packet (a {MTU}-byte MTU, no fragments)")
    if mib <= 0 or reps < 1 or rounds < 1:
        raise ConfigError(f"--mib {mib:g}, --reps {reps}, --rounds {rounds}: give a size above 0 and 1 or more "
                          "reps and rounds")
    if loss is not None and not 0 < loss < 100:
        raise ConfigError(f"--link-loss {loss:g}: give a percentage above 0 and below 100")
    if burst is not None and (loss is None or burst < 1 or round(burst * 100 / loss) <= burst):
        raise ConfigError(f"--link-burst {burst}: give a run of 1 or more packets, with a --link-loss rate that "
                          "leaves packets between the runs")


def run_link_bench(*, rates: Sequence[float], worker_counts: Sequence[int] = (4, 8), ks: Sequence[int] = (64, 256),
                   mib: float = 32, reps: int = 3, rounds: int = 3, loss: float | None = None,
                   burst: int | None = None, plot: str | None = None) -> int:
    """gloo and switchagg at every K, on links of every rate, for each worker count; a line per run and the
    table at the end. Returns 1 if a sum came out wrong, else 0."""
    check(rates=rates, worker_counts=worker_counts, ks=ks, mib=mib, reps=reps, rounds=rounds, loss=loss, burst=burst)
    rates, worker_counts, ks = (tuple(dict.fromkeys(x)) for x in (rates, worker_counts, ks))  # each once
    problem = missing(loss is not None)
    if problem:
        raise SwitchAggError(problem)
    numel = int(mib * 2**20 / 4)
    burst_, limit = tbf_sizes(min(rates), ks)
    impaired = "" if loss is None else (
        f"; {loss:g}% of switchagg's packets dropped at every namespace's input"
        + (f" in runs of {burst}" if burst else " at random") + " (gloo's TCP lossless), the links carrying "
        "them one by one (no UDP GSO or GRO, so that nftables sees each): more CPU per packet than without loss")
    print(f"link bench: {mib:g} MiB float32, tbf on both ends of every worker's link (at {min(rates):g} Mbit/s: "
          f"burst {burst_} B, limit {limit} B), {rounds} round(s) of gloo and switchagg at K="
          f"{', '.join(map(str, ks))} back to back, each a warm-up + {reps} calls (median){impaired}", flush=True)
    rows: list[Row] = []
    with stopped_by_sigterm():
        try:
            for n in worker_counts:
                rows += _bench_workers(n, rates, ks, numel, reps, rounds, loss, burst)
        finally:
            teardown()
    _table(rows, loss is not None)
    if plot:
        _plot(plot, rows)
        print(f"plot: {plot}", file=sys.stderr)
    return 0 if all(r.exact for r in rows) else 1


def _bench_workers(n: int, rates: Sequence[float], ks: Sequence[int], numel: int, reps: int, rounds: int,
                   loss: float | None, burst: int | None) -> list[Row]:
    try:
        build(n, per_packet=loss is not None)
        shape(n, min(rates), ks)
        if loss is not None:
            impair(n, 0.0, None)
    except RuntimeError as exc:
        raise SwitchAggError(f"the link bench could not build its namespaces: {exc}") from None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workers = _Workers(n, Path(tmp))
        try:
            for mbit in rates:
                shape(n, mbit, ks)
                # a generous wait: ten times gloo's ideal calls, and a minute to start a group
                timeout = 60 + 10 * (reps + 1) * ideal_seconds(numel * 4, mbit, ring_share(n))
                runs: dict[str, list[Run]] = {}
                for rnd in range(rounds):
                    sides = ["gloo", *ks] if rnd % 2 == 0 else [*ks, "gloo"]
                    for side in sides:
                        task = {"backend": "gloo" if side == "gloo" else "switchagg", "k": side, "numel": numel,
                                "reps": reps}
                        variants = [("", 0.0)] if side == "gloo" or loss is None else [("", 0.0), ("lossy", loss)]
                        for name, percent in variants:
                            if loss is not None:
                                impair(n, percent, burst)
                            tag = f"{mbit:g}mbit-r{rnd}-{side}{name}"
                            run = _side(workers, {**task, "tag": tag}, n, timeout, bool(percent))
                            runs.setdefault(f"{side}{name}", []).append(run)
                            print(f"{n} workers, {mbit:g} Mbit/s, round {rnd + 1}: "
                                  f"{'gloo' if side == 'gloo' else f'switchagg K={side}'}"
                                  f"{f' at {percent:g}% loss' if percent else ''} {run.seconds * 1e3:.1f} ms, "
                                  f"tbf drops {run.tbf_drops}"
                                  + (f", dropped {run.dropped}, resent {run.resent}" if percent else "")
                                  + ("" if run.exact else ", SUMS WRONG"), flush=True)
                rows += [_row(n, k, mbit, numel * 4, runs["gloo"], runs[str(k)], runs.get(f"{k}lossy", []))
                         for k in ks]
            workers.close()
        except BaseException:
            workers.kill()
            raise
    return rows


def _table(rows: list[Row], lossy: bool) -> None:
    print("ratio: gloo's time over switchagg's; bound: 2(N-1)/N over switchagg's wire bytes per value byte; "
          "*_ideal: each side's ideal time at the rate over its time (gloo: its ring's bytes, switchagg: its "
          "frames'); tbf_drops: gloo/switchagg" + ("; dropped (by nftables) and resent: the lossy runs' calls, "
                                                   "their warm-ups too" if lossy else ""))
    print("workers    K  Mbit/s  gloo_ms  switchagg_ms  ratio  bound  ratio/bound  gloo_ideal  switchagg_ideal  "
          "tbf_drops  exact" + ("  lossy_ms  lossless/lossy  dropped  resent" if lossy else ""))
    for r in rows:
        line = (f"{r.n:>7}  {r.k:>3}  {r.mbit:>6g}  {r.gloo * 1e3:>7.1f}  {r.switchagg * 1e3:>12.1f}  "
                f"{r.ratio:>5.2f}  {r.bound:>5.2f}  {r.ratio / r.bound:>11.2f}  {r.gloo_ideal:>10.2f}  "
                f"{r.switchagg_ideal:>15.2f}  {f'{r.tbf_drops[0]}/{r.tbf_drops[1]}':>9}  "
                f"{'yes' if r.exact else 'NO':>5}")
        if lossy:
            line += (f"  {r.lossy * 1e3:>8.1f}  {r.lossless_over_lossy:>14.2f}  {r.dropped:>7}  "  # type: ignore
                     f"{r.resent:>6}")
        print(line)
    print("ratio_vs_bound=" + " ".join(f"{r.n}w-k{r.k}-{r.mbit:g}mbit:{r.ratio / r.bound:.3f}" for r in rows))
    print("gloo_vs_ideal=" + " ".join(f"{r.n}w-{r.mbit:g}mbit:{r.gloo_ideal:.3f}"
                                      for r in rows if r.k == rows[0].k))
    if lossy:
        print("lossless_over_lossy=" + " ".join(f"{r.n}w-k{r.k}-{r.mbit:g}mbit:{r.lossless_over_lossy:.3f}"
                                                for r in rows))


def _plot(path: str, rows: list[Row]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SwitchAggError("--plot needs matplotlib: pip install 'switchagg[bench]'") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    lines: dict[tuple[int, int], list[Row]] = {}
    for r in rows:
        lines.setdefault((r.n, r.k), []).append(r)
    for (n, k), these in lines.items():
        measured, = ax.plot([r.mbit for r in these], [r.ratio for r in these], "o-", label=f"{n} workers, K={k}")
        ax.axhline(bound(n, k), linestyle="--", color=measured.get_color())  # the same at every rate
    ax.set(title="switchagg's speed over gloo's (dashed: the bound)", xlabel="link rate (Mbit/s)",
           ylabel="gloo's time over switchagg's")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]))
