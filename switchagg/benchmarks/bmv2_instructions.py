"""Instructions BMv2 executes per frame: switchagg's P4 program against the plain forwarding one.

    sudo .venv/bin/python -m switchagg.benchmarks.bmv2_instructions [--frames 300] [--wait 60]

Where bmv2_vs_forwarding.py's packet rates swing by 15% from run to run on a small machine, this
count is the same every time, which is what measuring a change to the P4 program needs. Each
program runs in simple_switch_grpc under valgrind's callgrind, deployed over P4Runtime as usual,
and reads the same 322-byte frames as that bench (a 2-worker job's contributions, every pair
aggregated and multicast) from a pcap file (BMv2's --use-files) instead of an interface. The
instructions of BMv2's packet threads (receive, ingress, egress, transmit) in a run with N frames
minus those of a run with N/3 frames, over the difference, are the cost of one frame, start-up
excluded. PHV allocations are left out too: a pcap run creates one per frame, where a switch on
interfaces takes them from a pool. Prints each program's instructions per frame by thread, and
the ratio last.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from ..config import Endpoint, JobConfig, WorkerSpec
from ..targets import bmv2
from ..targets.p4c import Pipeline, build, find_tool
from ..wire import P4_VALUES_PER_PACKET
from .bmv2_vs_forwarding import SLOTS, deepen_queues, deploy_forwarding, forwarding_pipeline, frames_for

ROOT = Path(__file__).resolve().parents[2]  # the checkout: build/ and the workers' PYTHONPATH

SPACING = 0.025  # seconds between frames in the pcap: BMv2 under callgrind finishes each before the next
THREADS = {"PcapFilesReader::": "receive", "SimpleSwitch::ingress_thread": "ingress",
           "SimpleSwitch::egress_thread": "egress", "SimpleSwitch::transmit_thread": "transmit"}
SWITCH = SimpleNamespace(switch_mac="02:5a:00:00:00:fe", switch_ip="10.77.0.254")


def job() -> JobConfig:
    """The bench's 2-worker job: workers behind switch ports 1 and 2, frames entering on port 0."""
    return JobConfig(
        switch=Endpoint(SWITCH.switch_ip, 16711), job_id=9, key=0x5EED, slot_base=0, slot_count=SLOTS,
        values_per_packet=P4_VALUES_PER_PACKET, generation=0x5EED0001,
        workers=tuple(WorkerSpec(Endpoint(f"10.77.0.{h}", 40009), mac=f"02:5a:00:00:00:{h:02x}", switch_port=h)
                      for h in (1, 2)))


def write_pcaps(folder: Path, frames: list[bytes]) -> None:
    """Port 0's input: ``frames``, SPACING apart; ports 1 and 2 read nothing."""
    header = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1)  # pcap, Ethernet
    with open(folder / "p0_in.pcap", "wb") as f:
        f.write(header)
        for i, frame in enumerate(frames):
            usec = int(i * SPACING * 1e6)
            f.write(struct.pack("<IIII", 1 + usec // 1_000_000, usec % 1_000_000, len(frame), len(frame)) + frame)
    for port in (1, 2):
        (folder / f"p{port}_in.pcap").write_bytes(header)


def frames_out(folder: Path) -> int:
    """Frames BMv2 wrote so far (pcap: a 24-byte file header, a 16-byte header per 322-byte frame)."""
    return sum(max(0, (p.stat().st_size - 24) // (16 + 322)) for p in folder.glob("p*_out.pcap"))


def run(program: str, n: int, folder: Path, wait: float, grpc_port: int, thrift_port: int,
        forwarding: Pipeline) -> dict[str, int]:
    """Instructions by packet thread of one callgrind run of ``program`` ("switchagg" or ``forwarding``)."""
    cfg = job()
    stream = frames_for(SWITCH, cfg, cfg.generation)
    write_pcaps(folder, [next(stream) for _ in range(n)])
    cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={folder}/cg.out",
           find_tool("simple_switch_grpc"), "--no-p4", "--use-files", str(int(wait)), "--thrift-port", str(thrift_port),
           *[a for p in range(3) for a in ("-i", f"{p}@{folder}/p{p}")], "--",
           "--grpc-server-addr", f"127.0.0.1:{grpc_port}"]
    switch = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = time.monotonic()
    try:
        addr = f"127.0.0.1:{grpc_port}"
        while True:  # valgrind takes a while to bring the gRPC server up
            try:
                socket.create_connection(("127.0.0.1", grpc_port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() - started > wait / 2:
                    raise RuntimeError(f"BMv2's gRPC server did not come up in {wait / 2:.0f} s: "
                                       "raise --wait") from None
                time.sleep(1)
        if program == "switchagg":
            bmv2.Bmv2Target(addr, pipeline=str(ROOT / "build" / "bmv2")).deploy(cfg)
        else:
            deploy_forwarding(addr, SWITCH.switch_mac, forwarding)
        deepen_queues(thrift_port, depth=n)
        if time.monotonic() - started > wait:
            raise RuntimeError(f"configuring BMv2 under valgrind took over {wait:.0f} s: raise --wait")
        deadline = started + wait + n * SPACING * 4 + 120
        while frames_out(folder) < n:  # switchagg: a sum to each of the 2 workers per pair of frames
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {frames_out(folder)} of {n} frames came out of BMv2")
            time.sleep(1)
        subprocess.run(["callgrind_control", "--dump", str(switch.pid)], capture_output=True, check=True)
        time.sleep(2)
    finally:
        switch.kill()
        switch.wait()
    return thread_costs(folder)


def thread_costs(folder: Path) -> dict[str, int]:
    """Instructions of each packet thread in the dump, PHV allocations taken out."""
    costs: dict[str, int] = {}
    for dump in folder.glob("cg.out.*-*"):
        report = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(dump)],
                                capture_output=True, text=True, check=True).stdout
        kind = next((k for fn, k in THREADS.items() if fn in report), None)
        if kind is None:
            continue
        total = int(re.search(r"^\s*([\d,]+) \s*\(100.0%\)\s+PROGRAM TOTALS", report, re.M).group(1).replace(",", ""))
        phv = re.search(r"^\s*([\d,]+) .*PHVFactory::create", report, re.M)
        costs[kind] = costs.get(kind, 0) + total - (int(phv.group(1).replace(",", "")) if phv else 0)
    return costs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=300, help="frames of the longer run (the shorter has a third)")
    parser.add_argument("--wait", type=float, default=60.0,
                        help="seconds BMv2 waits before reading the frames, for P4Runtime to configure it")
    args = parser.parse_args()
    missing = [t for t in ("valgrind", "callgrind_control", "callgrind_annotate") if shutil.which(t) is None]
    missing += [t for t in ("simple_switch_grpc", "simple_switch_CLI", "p4c-bm2-ss") if find_tool(t) is None]
    if missing or os.geteuid() != 0:
        print(f"cannot run: needs root and {', '.join(missing) or 'nothing else'} (valgrind: apt install valgrind)",
              file=sys.stderr)
        return 2
    build(ROOT / "build" / "bmv2")  # before the runs, which deploy it side by side
    fwd = forwarding_pipeline()
    counts = {"switchagg": (args.frames // 3, args.frames), "forwarding": (args.frames // 3, args.frames)}
    per_frame: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as pool:
        for i, (program, sizes) in enumerate(counts.items()):  # a program's two runs side by side
            folders = [Path(tmp) / f"{program}-{n}" for n in sizes]
            for folder in folders:
                folder.mkdir()
            short, long = (f.result() for f in [
                pool.submit(run, program, sizes[j], folders[j], args.wait, 50051 + 2 * i + j, 9390 + 2 * i + j, fwd)
                for j in range(2)])
            by_thread = {k: (long.get(k, 0) - short.get(k, 0)) / (sizes[1] - sizes[0]) for k in long}
            per_frame[program] = sum(by_thread.values())
            print(f"{program}: {per_frame[program]:,.0f} instructions per frame ("
                  + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(by_thread.items())) + ")", flush=True)
    print(f"instruction_ratio_vs_forwarding={per_frame['forwarding'] / per_frame['switchagg']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
