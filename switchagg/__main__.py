"""The ``switchagg`` command line (also ``python -m switchagg``).

Each subcommand is a short function that parses its options and calls the module that does the
work; the control-plane subcommands look their ``--target`` up in :mod:`switchagg.targets`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from .config import LOSS_RECOVERY, Endpoint, JobConfig
from .errors import SwitchAggError


def _cmd_switch(args: argparse.Namespace) -> int:
    from .switch.server import NUM_SLOTS, SoftSwitch

    configs = [JobConfig.from_file(p) for p in args.config]
    address = Endpoint.parse(args.address, "--address") if args.address else configs[0].switch
    control = Endpoint.parse(args.control, "--control") if args.control else configs[0].control
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with SoftSwitch(address, control=control, num_slots=args.slots or NUM_SLOTS) as sw:
        for cfg in configs:
            gen = sw.add_job(cfg)
            print(f"job {cfg.job_id}: {cfg.n_workers} workers, slots {cfg.slot_base}.."
                  f"{cfg.slot_base + cfg.slot_count - 1}, K={cfg.values_per_packet}, generation {gen}")
        where = f", control on {sw.control_address[0]}:{sw.control_address[1]}" if control else ""
        print(f"switchagg switch on {sw.address[0]}:{sw.address[1]} ({sw.backend}){where}; Ctrl-C stops it",
              flush=True)
        if args.ready_file:
            _write_ready(Path(args.ready_file), sw.address, sw.control_address, sw.backend)
        try:
            while not stop.wait(0.5):
                if sw.error is not None:
                    raise sw.error
        except KeyboardInterrupt:
            pass
    return 0


def _write_ready(path: Path, address: tuple, control: tuple | None, backend: str) -> None:
    """Say the switch is up, and where, in one JSON object (written whole, then renamed into place)."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps({"address": list(address), "control": list(control) if control else None,
                                "backend": backend, "pid": os.getpid()}))
    part.replace(path)


def _target(args: argparse.Namespace, config: JobConfig | None = None):
    from .targets import TargetOptions, open_target

    return open_target(args.target, TargetOptions(config=config, address=args.address,
                                                  device_id=args.device_id,
                                                  pipeline=getattr(args, "pipeline", None)))


def _cmd_status(args: argparse.Namespace) -> int:
    cfg = JobConfig.from_file(args.config)
    status = _target(args, cfg).status(cfg.job_id)
    if args.json:
        print(json.dumps(status.to_json(), indent=2))
        return 0
    transport = f", transport {status.transport}" if status.transport else ""
    print(f"switch {cfg.switch} ({status.target}{transport})")
    if not status.installed:
        print(f"job {cfg.job_id}: NOT INSTALLED on this switch (deploy it, or start `switchagg switch`)")
    else:
        print(f"job {cfg.job_id}: generation {status.generation}, slots {status.slot_base}.."
              f"{status.slot_base + status.slot_count - 1}, {status.n_workers} workers")
        for name, value in status.counters.items():
            print(f"  {name:<20} {value}")
    print("switch-wide drops:")
    for name, value in status.global_drops.items():
        print(f"  {name:<20} {value}")
    return 0


def _cmd_reset(args: argparse.Namespace) -> int:
    cfg = JobConfig.from_file(args.config)
    gen = _target(args, cfg).reset(cfg.job_id)
    print(f"job {cfg.job_id}: new generation {gen}; start the workers now")
    return 0


def _cmd_build_p4(args: argparse.Namespace) -> int:
    from .targets import target_class

    target = target_class(args.target)
    out = Path(args.out or f"build/{args.target}")
    for name, path in target.build(out).items():
        print(f"{name + ':':<16} {path}")
    if args.resources:
        print(target.resources(out))
    return 0


def _cmd_deploy(args: argparse.Namespace) -> int:
    cfg = JobConfig.from_file(args.config)
    gen = _target(args, cfg).deploy(cfg)
    print(f"job {cfg.job_id} deployed on the {args.target} target: generation {gen}")
    return 0


def _cmd_undeploy(args: argparse.Namespace) -> int:
    cfg = JobConfig.from_file(args.config)
    _target(args, cfg).undeploy(cfg.job_id)
    print(f"job {cfg.job_id} removed from the {args.target} target")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    rc = run_demo(workers=args.workers, size=args.size, rounds=args.rounds, k=args.values_per_packet)
    if rc or args.no_train:
        return rc
    try:
        from .ddp_demo import run_training_demo
    except ImportError as exc:
        print(f"training part skipped: {exc} (install the 'torch' extra)")
        return 0
    return run_training_demo(workers=min(args.workers, 4))


def _cmd_worker(args: argparse.Namespace) -> int:
    from .worker import run_worker

    return run_worker(args.config, args.rank, size=args.size, rounds=args.rounds)


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.loss:
        from .benchmarks.loss import RATES, run_loss_bench

        return run_loss_bench(worker_counts=tuple(args.loss_workers), rates=tuple(args.loss_rates or RATES),
                              recoveries=tuple(args.loss_recovery), rounds=args.rounds, plot=args.plot)
    if args.ddp:
        from .ddp_demo import run_ddp_bench

        return run_ddp_bench(workers=args.workers)
    from .benchmarks.throughput import run_bench

    return run_bench(workers=args.workers, mib=args.mib, reps=args.reps, ks=args.values_per_packet,
                     slots=args.slots, rounds=args.rounds, gloo=not args.no_gloo, plot=args.plot)


def _target_args(p: argparse.ArgumentParser, default: str = "soft") -> None:
    p.add_argument("--config", required=True, help="the job's TOML file")
    _target_choice(p, default)
    p.add_argument("--address", help="the target's control address (soft: the config's switch.control; "
                                     "bmv2: P4Runtime, 127.0.0.1:9559)")
    p.add_argument("--device-id", type=int, default=0, help="the P4 switch's device id (BMv2's default is 0)")


def _target_choice(p: argparse.ArgumentParser, default: str) -> None:
    from .targets import TARGETS

    p.add_argument("--target", choices=tuple(TARGETS), default=default,
                   help="; ".join(f"{name}: {t.summary}" for name, t in TARGETS.items()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="switchagg", description="In-network gradient aggregation: a switch sums your gradients.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("switch", help="run the embedded software switch for one or more jobs")
    p.add_argument("--config", action="append", required=True, help="a job's TOML file (repeatable)")
    p.add_argument("--address", help="UDP address to listen on (default: the first config's switch.address)")
    p.add_argument("--control", help="control port (default: the first config's switch.control)")
    p.add_argument("--slots", type=int, help="aggregation slots of this switch (default 4096)")
    p.add_argument("--ready-file", metavar="FILE",
                   help="once listening, write the bound addresses here as JSON (what scripts wait for)")
    p.set_defaults(fn=_cmd_switch)

    p = sub.add_parser("status", help="show a job's counters: what was aggregated, what was dropped and why")
    _target_args(p)
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.set_defaults(fn=_cmd_status)

    p = sub.add_parser("reset", help="start a new run of a job (a new generation; old state reads as empty)")
    _target_args(p)
    p.set_defaults(fn=_cmd_reset)

    p = sub.add_parser("build-p4", help="compile the P4 program for a target (bmv2: BMv2 JSON and P4Info; "
                                        "tofino, tofino2: bf-p4c's binary, context.json and bfrt.json)")
    _target_choice(p, "bmv2")
    p.add_argument("--out", help="output directory (default: build/<target>)")
    p.add_argument("--resources", action="store_true",
                   help="then print the compiler's resource report: stages, SRAM/TCAM, stateful ALUs, PHV")
    p.set_defaults(fn=_cmd_build_p4)

    p = sub.add_parser("deploy", help="install a job on a switch (P4: admission, multicast group, egress rewrites)")
    _target_args(p, default="bmv2")
    p.add_argument("--pipeline", help="compile the P4 program into this directory and push it first (P4 targets)")
    p.set_defaults(fn=_cmd_deploy)

    p = sub.add_parser("undeploy", help="remove a job from a switch")
    _target_args(p, default="bmv2")
    p.set_defaults(fn=_cmd_undeploy)

    p = sub.add_parser("demo", help="the main job: allreduce among worker processes, then a small DDP training")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--size", type=int, default=1_000_000, help="float32 elements per tensor")
    p.add_argument("--rounds", type=int, default=5, help="allreduce calls")
    p.add_argument("--values-per-packet", type=int, default=8192, help="K (loopback takes large packets)")
    p.add_argument("--no-train", action="store_true", help="skip the DDP training part")
    p.set_defaults(fn=_cmd_demo)

    p = sub.add_parser("worker", help="one worker of a job: allreduce seeded tensors, check every sum")
    p.add_argument("--config", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, default=100_000, help="float32 elements per tensor")
    p.add_argument("--rounds", type=int, default=3)
    p.set_defaults(fn=_cmd_worker)

    p = sub.add_parser("bench", help="allreduce throughput and host CPU against gloo, codec and transport speed")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--mib", type=float, default=64, help="tensor size in MiB of float32")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions after a warm-up (median reported)")
    p.add_argument("--values-per-packet", type=int, nargs="+", default=[64, 16000],
                   help="K, one or more: 64 is the P4 switch's packet, 16000 a 64 KB datagram (loopback only)")
    p.add_argument("--slots", type=int, help="the job's slots (default: 1024 for K = 64, 16 for 64 KB datagrams)")
    p.add_argument("--rounds", type=int, default=3,
                   help="switchagg then gloo, this many times (--loss: every rate and recovery); "
                        "the ratios are the median of the rounds'")
    p.add_argument("--no-gloo", action="store_true", help="skip the gloo baseline (no ratios then)")
    p.add_argument("--plot", metavar="FILE.png", help="draw each round's ratios and packet rates (matplotlib)")
    p.add_argument("--loss", action="store_true",
                   help="instead: time under 0, 0.1, 1 and 5%% real packet loss (root: namespaces and nftables)")
    p.add_argument("--loss-workers", type=int, nargs="+", default=[4, 7], help="worker counts of --loss")
    p.add_argument("--loss-rates", type=float, nargs="+", help="loss rates of --loss, percent per hop")
    p.add_argument("--loss-recovery", nargs="+", choices=sorted(LOSS_RECOVERY), default=["resend", "query"],
                   help="the job's loss_recovery settings --loss compares")
    p.add_argument("--ddp", action="store_true",
                   help="instead: DDP iteration time of a ~2M-parameter MLP, hook against gloo allreduce")
    p.set_defaults(fn=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except SwitchAggError as exc:
        print(f"switchagg {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
