"""``python -m bmv2_env up|down``: a BMv2 test bed on this machine, left running between the two.

``up`` builds a namespace per worker (``<prefix>h<i>``, 10.77.0.<i+1>), a veth from each to a port of
``simple_switch_grpc`` (gRPC on 127.0.0.1), pushes the switchagg pipeline, deploys a job for all the
hosts and writes its config; ``down`` removes all of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from .testbed import RUN_DIR, TestBed, missing_prerequisites


def _state(prefix: str) -> Path:
    return RUN_DIR / f"{prefix}.json"


def up(args: argparse.Namespace) -> int:
    problem = missing_prerequisites()
    if problem:
        print(f"bmv2_env: cannot build the test bed: it {problem}", file=sys.stderr)
        return 2
    from switchagg.targets import bmv2

    bed = TestBed(args.workers, prefix=args.prefix, subnet=args.subnet, grpc_port=args.grpc_port,
                  thrift_port=args.thrift_port, log=Path(args.log) if args.log else None)
    bed.up()
    cfg = bed.job(list(range(args.workers)), slot_count=args.slots)
    generation = bmv2.Bmv2Target(bed.grpc_addr).deploy(cfg)
    cfg.write(args.config)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    _state(args.prefix).write_text(json.dumps({"pid": bed._proc.pid, "hosts": args.workers}))
    bed._proc = None  # leave it running for `down`
    print(f"BMv2 on ports 0..{args.workers - 1}, P4Runtime at {bed.grpc_addr}, thrift {args.thrift_port}")
    print(f"BMv2's output goes to {bed.output}")
    print(f"job {cfg.job_id} deployed (generation {generation}); config written to {args.config}")
    print(f"run worker r with: ip netns exec {args.prefix}h<r> .venv/bin/switchagg worker "
          f"--config {args.config} --rank <r>")
    print(f"tear down with: python -m bmv2_env down --prefix {args.prefix}")
    return 0


def down(args: argparse.Namespace) -> int:
    path = _state(args.prefix)
    hosts = args.workers
    if path.exists():
        state = json.loads(path.read_text())
        hosts = state["hosts"]
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.kill(state["pid"], signal.SIGTERM)
        path.unlink()
    TestBed(hosts, prefix=args.prefix).down()
    print(f"test bed {args.prefix!r} removed")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bmv2_env", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up", help="build the test bed and deploy a job")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--config", default="bmv2-job.toml", help="where to write the job's config")
    p.add_argument("--grpc-port", type=int, default=9559)
    p.add_argument("--thrift-port", type=int, default=9090)
    p.add_argument("--log", help="BMv2 log file (slow: logs every packet)")
    p.set_defaults(fn=up)
    p = sub.add_parser("down", help="remove the test bed")
    p.add_argument("--workers", type=int, default=8, help="how many hosts to look for without a state file")
    p.set_defaults(fn=down)
    for p in sub.choices.values():
        p.add_argument("--prefix", default="sa", help="names: <prefix>h<i> namespaces, <prefix>p<i> ports")
        p.add_argument("--subnet", type=int, default=77, help="hosts live on 10.<subnet>.0.0/24")
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
