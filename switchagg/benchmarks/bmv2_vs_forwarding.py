"""Packets per second of switchagg's P4 program on BMv2 against a plain forwarding program.

    sudo .venv/bin/python -m switchagg.benchmarks.bmv2_vs_forwarding [--seconds 2] [--rounds 11] [--burst 400]
                                                      [--workers 2] [--bmv2 PATH]

Same BMv2 build, same 322-byte frames, one run: two BMv2 switches, one per program, each offered
bursts of frames in turn (a round alternates them for --seconds). A raw-socket generator in host 0
sends each burst as fast as it can. For switchagg the frames are contributions of a job of
--workers workers, forged from their addresses with chunk ids rising, so every chunk is really
aggregated and multicast and nothing is dropped early; each frame in still makes one frame out,
and two workers, the default, make the most sums (the costliest part) per frame. For the baseline
one table lookup forwards them from port 0 to port 1. The rate is BMv2's sustained one: how fast a
burst's outputs come out once the generator has sent it all (see ``measure``). Egress queues are
deepened so that BMv2 drops nothing; the bench warns unless every frame came out, and unless the
generator offered more than either program forwards. Then two ``switchagg worker`` processes
allreduce through BMv2. The ratio of the two rates over all rounds is printed last."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bmv2_env.testbed import TestBed, missing_prerequisites

from .. import netns
from ..frames import udp_headers
from ..targets import bmv2
from ..targets.p4c import Pipeline, find_tool
from ..wire import HEADER_SIZE, P4_VALUES_PER_PACKET, UDP_PORT, PacketType, make_header

ROOT = Path(__file__).resolve().parents[2]  # the checkout: build/ and the workers' PYTHONPATH

K, SLOTS = P4_VALUES_PER_PACKET, 32


def frames_for(bed: TestBed, cfg, generation: int):
    """An endless stream of contributions: chunk c from each worker in turn."""
    values = bytes(4 * K)
    heads = [udp_headers(bed.switch_mac, w.mac, (w.address.host, w.address.port), (bed.switch_ip, UDP_PORT),
                         HEADER_SIZE + len(values)) for w in cfg.workers]
    chunk = 0
    while True:
        for rank in range(len(heads)):
            h = make_header(PacketType.CONTRIB, job=cfg.job_id, worker=rank, slot=chunk % SLOTS,
                            copy=(chunk // SLOTS) % 2, chunk=chunk, generation=generation, key=cfg.key,
                            exponent=0, count=K)
            yield heads[rank] + h.pack() + values
        chunk += 1


SO_TIMESTAMPNS = 35  # Linux: each frame's kernel receive time (CLOCK_REALTIME) as a struct timespec


def arrivals(socks: list[socket.socket]) -> list[float]:
    """The kernel's receive times of the frames waiting on the receivers' packet sockets (the hosts'
    own sends left out)."""
    stamps = []
    for s in socks:
        while True:
            try:
                _, ancillary, _, addr = s.recvmsg(64, 64)
            except BlockingIOError:
                break
            if addr[2] == netns.PACKET_OUTGOING:
                continue
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", data[:16])
                    stamps.append(sec + nsec * 1e-9)
    return stamps


@dataclasses.dataclass
class Burst:
    """One burst: how fast the generator offered it, when it had sent it all, and when each output arrived."""

    offered: float
    sent_at: float
    stamps: list[float]


class Target:
    """One BMv2 under test: the generator's raw socket in host 0, the receivers' packet sockets and
    the stream of frames to offer.

    Frames go in bursts that BMv2's input queue can hold, as fast as the generator can (the offered
    rate). The receivers read every 5 ms rather than waking for each frame, so that on a machine
    with few cores the measurement takes as little CPU as it can from the switch it measures, and
    the kernel's receive time of each output says when it came out. Bursts are whole chunks (a
    multiple of the job's workers): an overloaded input queue drops at random and would break
    chunks, leaving nothing to aggregate.
    """

    def __init__(self, bed: TestBed, stream, receivers: list[int]) -> None:
        self.stream = stream
        self.tx = netns.packet_socket(bed.host(0))
        self.tx.setblocking(True)
        self.rx = [netns.packet_socket(bed.host(h)) for h in receivers]
        for s in self.rx:
            s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)

    def burst(self, size: int) -> Burst:
        """One burst of ``size`` frames, and its outputs until they stop coming."""
        frames = [next(self.stream) for _ in range(size)]
        t0 = time.time()  # CLOCK_REALTIME, the clock of the receive timestamps
        for f in frames:
            self.tx.send(f)
        sent_at = time.time()
        stamps: list[float] = []
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 0.05:  # until the outputs stop coming
            time.sleep(0.005)
            more = arrivals(self.rx)
            if more:
                stamps += more
                quiet_since = time.monotonic()
        return Burst(size / (sent_at - t0), sent_at, sorted(stamps))

    def close(self) -> None:
        for s in (self.tx, *self.rx):
            s.close()


@dataclasses.dataclass
class Tally:
    """What one target's bursts added up to."""

    offered: list[float] = dataclasses.field(default_factory=list)
    sent: int = 0
    done: int = 0
    steady_frames: int = 0
    steady_seconds: float = 0.0

    def add(self, size: int, burst: Burst) -> None:
        """Count a burst. Its outputs after the generator had sent it all are BMv2 draining its input
        queue, alone on the cores: the first of them a start, each later one a frame done."""
        self.offered.append(burst.offered)
        self.sent += size
        self.done += len(burst.stamps)
        steady = [t for t in burst.stamps if t > burst.sent_at]
        if len(steady) > 1:
            self.steady_frames += len(steady) - 1
            self.steady_seconds += steady[-1] - steady[0]

    def merge(self, other: Tally) -> None:
        self.offered += other.offered
        self.sent += other.sent
        self.done += other.done
        self.steady_frames += other.steady_frames
        self.steady_seconds += other.steady_seconds

    def rate(self) -> float:
        """BMv2's sustained rate: frames done over the time it spent draining its queue, all bursts
        together (a slow spell of the machine weighs by its length, as it does on either program)."""
        return self.steady_frames / self.steady_seconds if self.steady_seconds > 0 else math.nan


def measure(targets: list[Target], seconds: float, size: int) -> list[Tally]:
    """Each target's bursts of ``size`` frames for ``seconds``.

    The targets take bursts in turn, one after the other, so that a slow spell of the machine falls
    on all of them alike. What counts is the rate at which a burst's outputs come out once the
    generator has sent it all (``Tally.add``): BMv2's sustained rate, without what a burst pays once
    (BMv2's threads waking up to the first frame) and without the generator on the same cores. A
    burst of a few hundred frames goes into the generator's socket buffer without blocking, which
    a much longer one would not (the generator would then wake up with every frame BMv2 takes)."""
    tallies = [Tally() for _ in targets]
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for t, tally in zip(targets, tallies, strict=True):
            tally.add(size, t.burst(size))
    return tallies


def deepen_queues(thrift_port: int, depth: int = 1024) -> None:
    """Egress queues of ``depth`` frames (BMv2 drops beyond 64 per port): a burst is measured, not dropped."""
    subprocess.run([find_tool("simple_switch_CLI"), "--thrift-port", str(thrift_port)],
                   input=f"set_queue_depth {depth}\n", capture_output=True, text=True, check=True)


def deploy_forwarding(grpc_addr: str, mac: str, pipeline: Pipeline | None = None) -> None:
    """The baseline's one lookup: frames to ``mac`` leave by port 1 (``pipeline`` pushed first if given)."""
    with bmv2.P4RuntimeSession(grpc_addr, 0, pipeline) as sh:
        entry = sh.TableEntry("FwdIngress.l2")(action="FwdIngress.to_port")
        entry.match["hdr.ethernet.dst"] = mac
        entry.action["port"] = "1"
        entry.insert()


def allreduce_rate(binary: str, size: int = 1 << 18, rounds: int = 4) -> list[str]:
    """Two ``switchagg worker`` processes allreducing through BMv2 (adaptive window): their reports."""
    with TestBed(2, prefix="sab", subnet=76, switch_binary=binary) as bed, \
            tempfile.TemporaryDirectory() as tmp:
        cfg = bed.job([0, 1], job_id=9, slot_count=SLOTS)
        path = cfg.write(Path(tmp) / "job.toml")
        bmv2.Bmv2Target(bed.grpc_addr).deploy(cfg)
        deepen_queues(bed.thrift_port)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        procs = [bed.exec(r, [sys.executable, "-m", "switchagg", "worker", "--config", str(path), "--rank", str(r),
                              "--size", str(size), "--rounds", str(rounds)], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a worker failed:\n" + "\n".join(o[-2000:] for o in outs))
    return outs[0].strip().splitlines()


def forwarding_pipeline() -> Pipeline:
    """``forward.p4`` (beside this module) compiled next to switchagg's pipeline."""
    out = ROOT / "build" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    pipe = Pipeline(out / "forward.json", out / "forward.p4info.txtpb")
    subprocess.run([find_tool("p4c-bm2-ss"), "--p4runtime-files", str(pipe.p4info), "-o", str(pipe.json),
                    str(Path(__file__).with_name("forward.p4"))], check=True)
    return pipe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="length of a round")
    parser.add_argument("--rounds", type=int, default=11,
                        help="rounds of bursts; the ratio of the rates over all rounds is printed last "
                             "(a single round's swings widely on a small shared machine)")
    parser.add_argument("--bmv2", help="the simple_switch_grpc binary to measure (default: the one on PATH)")
    parser.add_argument("--burst", type=int, default=400, help="frames per burst")
    parser.add_argument("--workers", type=int, default=2, choices=range(2, 9), metavar="2..8",
                        help="workers in the aggregating job")
    args = parser.parse_args()
    problem = missing_prerequisites()
    if problem:
        print(f"cannot run: it {problem}", file=sys.stderr)
        return 2
    binary = args.bmv2 or find_tool("simple_switch_grpc")
    version = subprocess.run([binary, "--version"], capture_output=True, text=True)
    print(f"BMv2 {binary} {version.stdout.strip() or version.stderr.strip()}; generator: one raw socket in host 0")
    fwd_pipe = forwarding_pipeline()
    # Both switches stay up and are measured in turn, so a slow spell of this machine hits both.
    hosts = list(range(1, args.workers + 1))
    with TestBed(len(hosts) + 1, prefix="sab", subnet=76, host_ips=False, switch_binary=binary) as agg_bed, \
            TestBed(3, prefix="saf", subnet=75, host_ips=False, pipeline=fwd_pipe, switch_binary=binary) as fwd_bed:
        cfg = agg_bed.job(hosts, job_id=9, slot_count=SLOTS)
        agg_stream = frames_for(agg_bed, cfg, bmv2.Bmv2Target(agg_bed.grpc_addr).deploy(cfg))
        deepen_queues(agg_bed.thrift_port)
        deploy_forwarding(fwd_bed.grpc_addr, fwd_bed.switch_mac)
        deepen_queues(fwd_bed.thrift_port)
        fwd_stream = frames_for(fwd_bed, fwd_bed.job([1, 2], job_id=9, slot_count=SLOTS), 1)
        targets = [Target(agg_bed, agg_stream, hosts), Target(fwd_bed, fwd_stream, [1])]
        agg, fwd = Tally(), Tally()
        try:
            for r in range(args.rounds):
                a, f = measure(targets, args.seconds, args.burst - args.burst % args.workers)
                agg.merge(a)
                fwd.merge(f)
                print(f"round {r}: switchagg {a.rate():,.0f} pkt/s, forwarding {f.rate():,.0f} pkt/s, "
                      f"ratio {a.rate() / f.rate():.3f}")
        finally:
            for t in targets:
                t.close()
        counted = bmv2.Bmv2Target(agg_bed.grpc_addr).status(cfg.job_id).counters
    offered_sa, offered_fwd = statistics.median(agg.offered), statistics.median(fwd.offered)
    out_sa, out_fwd = agg.done, fwd.done
    print(f"switchagg, {args.workers} workers: offered {offered_sa:,.0f} pkt/s (median), BMv2 aggregated and sent "
          f"{agg.rate():,.0f} pkt/s (all bursts); {agg.sent:,} contributions sent, {out_sa:,} sums "
          f"received; the switch counted {counted['contributions']:,} contributions, "
          f"{counted['results_multicast']:,} sums, {counted['stale'] + counted['duplicate_pending']} dropped early")
    print(f"forwarding: offered {offered_fwd:,.0f} pkt/s (median), BMv2 forwarded {fwd.rate():,.0f} pkt/s "
          f"(all bursts); {fwd.sent:,} frames sent, {out_fwd:,} received")
    if counted["contributions"] != agg.sent or out_sa != agg.sent or out_fwd != fwd.sent:
        print("WARNING: frames were lost on the way (not every frame reached the pipeline and came out)")
    for line in allreduce_rate(binary):
        print(f"allreduce through BMv2, worker 0 of 2, K={K}, {SLOTS} slots: {line}")
    if min(offered_sa, offered_fwd) <= max(agg.rate(), fwd.rate()):
        print("WARNING: the generator did not offer more than BMv2 forwarded; the ratio is not trustworthy")
    print(f"ratio_vs_forwarding={agg.rate() / fwd.rate():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
