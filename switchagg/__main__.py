"""The ``switchagg`` command line (also ``python -m switchagg``).

Each subcommand is a short function that parses its options and calls the module that does the
work; the control-plane subcommands look their ``--target`` up in :mod:`switchagg.targets`, and all
of them default to the same one, ``soft`` (the embedded switch, which needs nothing installed). A
flag the chosen mode would ignore is refused rather than dropped, and an error (a bad config, a busy
port, a switch that does not answer) is one line on stderr and exit status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .config import LOSS_RECOVERY, Endpoint, JobConfig
from .errors import ConfigError, SwitchAggError

if TYPE_CHECKING:
    from .jobs import JobStatus

DEFAULT_TARGET = "soft"  # what every control-plane subcommand talks to unless --target says otherwise


def _cmd_switch(args: argparse.Namespace) -> int:
    from .switch.native import MAX_SHARDS

    configs = [JobConfig.from_file(p) for p in args.config or ()]
    if not configs and not (args.address and args.control):
        raise ConfigError("with no --config, give --address (where it receives) and --control (where process "
                          "groups deploy their jobs), e.g. --address 127.0.0.1:16711 --control 127.0.0.1:16712")
    address = Endpoint.parse(args.address, "--address") if args.address else configs[0].switch
    control = Endpoint.parse(args.control, "--control") if args.control else configs[0].control
    if args.control_token_file and control is None:
        raise ConfigError("--control-token-file: this switch has no control port (the config names no "
                          "switch.control, and no --control is given): drop the flag, or give a control address")
    if args.control_any_address and control is None:
        raise ConfigError("--control-any-address: this switch has no control port (the config names no "
                          "switch.control, and no --control is given): drop the flag, or give a control address")
    if args.slots is not None and not 1 <= args.slots <= 0x10000:
        raise ConfigError(f"--slots {args.slots}: a switch has 1..65536 slots")
    if not 1 <= args.cores <= MAX_SHARDS:
        raise ConfigError(f"--cores {args.cores}: the switch runs on 1..{MAX_SHARDS} cores")
    if args.steer is not None and args.cores == 1:
        raise ConfigError("--steer: a switch on one core steers nothing; give --cores N as well, or drop it")
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        return _serve_switch(args, configs, address, control, stop)
    finally:  # main() may run inside another program (a test): leave its SIGTERM as it was
        signal.signal(signal.SIGTERM, previous)


def _serve_switch(args: argparse.Namespace, configs: list[JobConfig], address: Endpoint, control: Endpoint | None,
                  stop: threading.Event) -> int:
    from .switch.control import control_token
    from .switch.server import NUM_SLOTS, SoftSwitch

    with SoftSwitch(address, control=control, num_slots=args.slots or NUM_SLOTS,
                    control_public=args.control_any_address, cores=args.cores, steer=args.steer or "job",
                    control_token=control_token(args.control_token_file)) as sw:
        for cfg in configs:
            gen = sw.add_job(cfg)
            print(f"job {cfg.job_id}: {cfg.n_workers} workers, slots {cfg.slot_base}.."
                  f"{cfg.slot_base + cfg.slot_count - 1}, K={cfg.values_per_packet}, generation {gen}")
        where = f", control on {sw.control_address[0]}:{sw.control_address[1]}" if control else ""
        cores = f", {sw.cores} cores steered by {sw.steer}" if sw.cores > 1 else ""
        print(f"switchagg switch on {sw.address[0]}:{sw.address[1]} ({sw.backend}{cores}){where}; Ctrl-C stops it",
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
    """The target ``--target`` names, reached as the flags say; a target refuses the flags it has no use for."""
    from .targets import TargetOptions, open_target

    return open_target(args.target, TargetOptions(config=config, address=args.address,
                                                  device_id=args.device_id,
                                                  pipeline=getattr(args, "pipeline", None)))


def _levels(args: argparse.Namespace) -> list[JobConfig]:
    """The job file's job, or every switch's job of a tree file (the spine's first)."""
    from .tree import TreeConfig, load

    cfg = load(args.config)
    _no_address_for_a_tree(args, cfg)
    return cfg.switch_jobs() if isinstance(cfg, TreeConfig) else [cfg]


def _cmd_status(args: argparse.Namespace) -> int:
    levels = _levels(args)
    statuses = [_target(args, cfg).status(cfg.job_id) for cfg in levels]
    if args.json:
        out = [status.to_json() for status in statuses]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
        return 0
    for cfg, status in zip(levels, statuses, strict=True):
        if len(levels) > 1:
            print(f"{'spine' if cfg.parent is None else f'leaf {cfg.parent.index}'} of the tree:")
        _print_status(cfg, status)
    return 0


def _print_status(cfg: JobConfig, status: JobStatus) -> None:
    transport = f", transport {status.transport}" if status.transport else ""
    print(f"switch {cfg.switch} ({status.target}{transport})")
    if not status.installed:
        print(f"job {cfg.job_id}: NOT INSTALLED on this switch (deploy it, or start `switchagg switch`)")
    else:
        print(f"job {cfg.job_id}: generation {status.generation}, slots {status.slot_base}.."
              f"{status.slot_base + status.slot_count - 1}, {status.n_workers} workers")
        print(f"  {'lease':<20} {_lease(status.lease)}")
        if status.owner:
            print(f"  {'owner':<20} {status.owner}")
        for name, value in status.counters.items():
            print(f"  {name:<20} {value}")
    print("switch-wide drops:")
    for name, value in status.global_drops.items():
        print(f"  {name:<20} {value}")
    if status.host_counters:
        print("the embedded switch's host side (control port, sockets, leases):")
        for name, value in status.host_counters.items():
            print(f"  {name:<20} {value}")
    if status.switch_jobs:
        print("every job on this switch (a lapsed lease removes its job):")
        for job_id, job in sorted(status.switch_jobs.items()):
            owner = f", owner {job['owner']}" if job["owner"] else ""
            print(f"  job {job_id}: slots {job['slot_base']}..{job['slot_base'] + job['slot_count'] - 1}, "
                  f"{job['n_workers']} workers, lease {_lease(job['lease'])}{owner}")


def _lease(left: float | None) -> str:
    """A job's lease as status shows it: the time left, or that it has none."""
    return "none (stays until removed)" if left is None else f"{left:.1f} s left"


def _cmd_reset(args: argparse.Namespace) -> int:
    levels = _levels(args)
    if len(levels) > 1:
        raise ConfigError("reset of a tree: its levels must share one generation, which a reset of each would "
                          "not keep; undeploy the tree and deploy it again (a new run needs neither: its workers "
                          "agree on a session of their own)")
    cfg = levels[0]
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
    from .tree import TreeConfig, load

    cfg = load(args.config)
    _no_address_for_a_tree(args, cfg)
    lease = f"; it is removed {args.lease:g} s after its last renewal (`switchagg renew`)" if args.lease else ""
    if isinstance(cfg, TreeConfig):  # the spine first, then every leaf under the generation it drew
        if args.target != "soft" and (gaps := cfg.p4_gaps()):
            raise ConfigError(f"a tree on {args.target} switches needs the links' Ethernet addresses and ports, which "
                              f"its P4 program writes into packets: add {', '.join(gaps)} to {args.config} (the "
                              "README's tree file section)")
        levels = cfg.switch_jobs()
        for job in levels:  # every level checked before any is deployed
            _target(args, job).check(job)
        deployed: list[JobConfig] = []
        try:
            gen = _target(args, levels[0]).deploy(levels[0], lease=args.lease)
            deployed.append(levels[0])
            for job in cfg.switch_jobs(gen)[1:]:
                _target(args, job).deploy(job, lease=args.lease)
                deployed.append(job)
        except BaseException:
            for job in deployed[::-1]:  # no level of a half-deployed tree stays behind
                with contextlib.suppress(SwitchAggError, OSError):
                    _target(args, job).undeploy(job.job_id)
            raise
        print(f"tree of job {cfg.job_id} deployed on the {args.target} target: the spine at {cfg.spine} and "
              f"{len(cfg.leaves)} leaves, {cfg.ranks} workers, generation {gen}{lease}")
        return 0
    gen = _target(args, cfg).deploy(cfg, lease=args.lease)
    print(f"job {cfg.job_id} deployed on the {args.target} target: generation {gen}{lease}")
    return 0


def _cmd_renew(args: argparse.Namespace) -> int:
    for cfg in _levels(args):
        _target(args, cfg).renew(cfg.job_id)
        print(f"job {cfg.job_id} at {cfg.switch}: lease renewed for its whole length")
    return 0


def _no_address_for_a_tree(args: argparse.Namespace, cfg: object) -> None:
    from .tree import TreeConfig

    if isinstance(cfg, TreeConfig) and args.address:
        raise ConfigError("--address: a tree file names every switch's control port ([spine] and [[leaves]] "
                          "control): drop the flag")


def _cmd_undeploy(args: argparse.Namespace) -> int:
    levels = _levels(args)
    if len(levels) == 1:
        _target(args, levels[0]).undeploy(levels[0].job_id)
        print(f"job {levels[0].job_id} removed from the {args.target} target at {levels[0].switch}")
        return 0
    missing, failed = [], []
    for job in levels[::-1]:  # a tree's leaves first, then its spine; a level that fails does not stop the rest
        try:
            _target(args, job).undeploy(job.job_id)
        except ConfigError as exc:  # the job is not there
            missing.append(str(exc))
            continue
        except (SwitchAggError, OSError) as exc:  # the switch is not reached
            failed.append(str(exc))
            continue
        print(f"job {job.job_id} removed from the {args.target} target at {job.switch}")
    if len(missing) == len(levels):
        raise ConfigError(f"no level of the tree was deployed: {'; '.join(missing)}")
    for what in missing:
        print(f"skipped: {what}")
    if failed:
        raise SwitchAggError(f"{len(failed)} level(s) of the tree could not be reached, the rest removed: "
                             f"{'; '.join(failed)}")
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


# The bench's flags that only one of its modes reads (their defaults are applied by _cmd_bench, so
# that a flag given to a mode that ignores it can be told from one left out, and refused).
_THROUGHPUT_FLAGS = ("mib", "reps", "values_per_packet", "slots", "no_gloo", "switch_cores", "switch_steer")
_LOSS_FLAGS = ("loss_workers", "loss_rates", "loss_recovery", "loss_runs")
_LINK_FLAGS = ("link_loss", "link_burst")
_TREE_FLAGS = ("tree_loss", "tree_link_rate")


def _refuse(args: argparse.Namespace, names: Sequence[str], mode: str) -> None:
    given = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) not in (None, False)]
    if given:
        raise ConfigError(f"{', '.join(given)}: `switchagg bench{mode}` does not use "
                          f"{'it' if len(given) == 1 else 'them'}; drop {'it' if len(given) == 1 else 'them'}")


def _cmd_bench(args: argparse.Namespace) -> int:
    rounds = args.rounds if args.rounds is not None else 3
    if args.tree:
        from .benchmarks.trees import RATES as TREE_RATES
        from .benchmarks.trees import REPS, run_tree_bench

        _refuse(args, ("workers", "nodes", "rounds", "plot", *(f for f in _THROUGHPUT_FLAGS if f != "reps"),
                       *_LOSS_FLAGS, *_LINK_FLAGS), " --tree")
        return run_tree_bench(shape=args.tree, rates=tuple(args.tree_loss or TREE_RATES),
                              reps=args.reps if args.reps is not None else REPS, link_rate=args.tree_link_rate)
    if args.link_rate:
        from .benchmarks.links import run_link_bench

        _refuse(args, ("nodes", "slots", "no_gloo", "switch_cores", "switch_steer", *_LOSS_FLAGS, *_TREE_FLAGS),
                " --link-rate")
        return run_link_bench(rates=args.link_rate, worker_counts=args.workers or (4, 8),
                              ks=args.values_per_packet or (64, 256), mib=args.mib if args.mib is not None else 32,
                              reps=args.reps if args.reps is not None else 3, rounds=rounds, loss=args.link_loss,
                              burst=args.link_burst, plot=args.plot)
    if args.loss:
        from .benchmarks.loss import RATES, run_loss_bench

        _refuse(args, ("workers", "nodes", *_THROUGHPUT_FLAGS, *_LINK_FLAGS, *_TREE_FLAGS), " --loss")
        return run_loss_bench(worker_counts=tuple(args.loss_workers or (4, 7)), rates=tuple(args.loss_rates or RATES),
                              recoveries=tuple(args.loss_recovery or ("resend", "query")), rounds=rounds,
                              runs=tuple(int(r) if r.isdigit() else r for r in args.loss_runs or ["1"]), plot=args.plot)
    workers = _one_count(args.workers)
    if args.ddp or args.fsdp:
        from .benchmarks.training import run_training_bench

        mode = "ddp" if args.ddp else "fsdp"
        _refuse(args, (*(f for f in _THROUGHPUT_FLAGS if f != "values_per_packet"), *_LOSS_FLAGS, *_LINK_FLAGS,
                       *_TREE_FLAGS, "rounds", "plot"),
                f" --{mode}")
        ks = args.values_per_packet or [64]
        if len(ks) != 1:
            raise ConfigError(f"--values-per-packet: `switchagg bench --{mode}` takes one K, not {len(ks)}")
        return run_training_bench(mode, workers=workers, values_per_packet=ks[0], nodes=args.nodes or 1)
    from .benchmarks.throughput import run_bench

    _refuse(args, (*_LOSS_FLAGS, *_LINK_FLAGS, *_TREE_FLAGS, "nodes"), " (throughput)")
    from .switch.native import MAX_SHARDS

    switch_cores = args.switch_cores if args.switch_cores is not None else 1
    if not 1 <= switch_cores <= MAX_SHARDS:
        raise ConfigError(f"--switch-cores {switch_cores}: the switch runs on 1..{MAX_SHARDS} cores")
    if args.switch_steer is not None and switch_cores == 1:
        raise ConfigError("--switch-steer: a switch on one core steers nothing; give --switch-cores N as well")
    return run_bench(workers=workers, mib=args.mib if args.mib is not None else 64,
                     reps=args.reps if args.reps is not None else 5, ks=args.values_per_packet or (64, 16000),
                     slots=args.slots, rounds=rounds, gloo=not args.no_gloo, plot=args.plot, switch_cores=switch_cores,
                     switch_steer=args.switch_steer or "job")


def _one_count(workers: Sequence[int] | None) -> int:
    """The one worker count of a mode that runs one (only --link-rate takes several); 4 if none is given."""
    if workers is None:
        return 4
    if len(workers) != 1:
        raise ConfigError(f"--workers {' '.join(map(str, workers))}: only `switchagg bench --link-rate` takes several "
                          "counts; give one")
    return workers[0]


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the job's TOML file (deploy and undeploy: or a tree file, "
                                                   "every switch of a tree: docs/protocol.md section 10)")
    _target_choice(p, DEFAULT_TARGET)
    p.add_argument("--address", help="the target's control address (soft: the config's switch.control; "
                                     "bmv2: P4Runtime, 127.0.0.1:9559; tofino, tofino2: BfRt, 127.0.0.1:50052)")
    p.add_argument("--device-id", type=int,
                   help="the P4 switch's device id (bmv2, tofino, tofino2; default 0); soft has none")


def _target_choice(p: argparse.ArgumentParser, default: str) -> None:
    from .targets import TARGETS

    p.add_argument("--target", choices=tuple(TARGETS), default=default,
                   help=f"which switch (default: {default}): "
                        + "; ".join(f"{name}: {t.summary}" for name, t in TARGETS.items()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="switchagg", description="In-network gradient aggregation: a switch sums your gradients.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("switch", help="run the embedded software switch, for jobs from files or deployed later")
    p.add_argument("--config", action="append",
                   help="a job's TOML file (repeatable); none: jobs come through the control port, e.g. "
                        "from init_process_group(\"switchagg\")")
    p.add_argument("--address", help="UDP address to listen on (default: the first config's switch.address)")
    p.add_argument("--control", help="the control port's TCP address (default: the first config's switch.control; "
                                     "none there: no control port)")
    p.add_argument("--control-any-address", action="store_true",
                   help="let the control port listen on an address other than loopback: anyone who reaches it "
                        "reads the counters, and whoever knows a job's key can reset or remove it; needs a "
                        "control token (--control-token-file or SWITCHAGG_CONTROL_TOKEN)")
    p.add_argument("--control-token-file", metavar="FILE",
                   help="a file holding the control token that add_job must carry (clients send "
                        "SWITCHAGG_CONTROL_TOKEN's value); default: SWITCHAGG_CONTROL_TOKEN, or no token "
                        "(loopback only)")
    p.add_argument("--slots", type=int, help="aggregation slots of this switch, 1..65536 (default 4096)")
    p.add_argument("--cores", type=int, default=1,
                   help="threads that serve the switch, each from its own socket on the same port (SO_REUSEPORT, "
                        "Linux), the kernel steering each datagram to one by --steer; default 1")
    p.add_argument("--steer", choices=("job", "slot"),
                   help="with --cores: which header field picks a datagram's core. job (default): each job on one "
                        "core, its results in order; slot: a job's slots on every core, whose results overtake "
                        "each other (today's workers resend on that: for workers that tolerate reordering)")
    p.add_argument("--ready-file", metavar="FILE",
                   help="once listening, write the bound addresses here as JSON (what scripts wait for)")
    p.set_defaults(fn=_cmd_switch)

    p = sub.add_parser("status", help="show a job's counters: what was aggregated, what was dropped and why")
    _target_args(p)
    p.add_argument("--json", action="store_true", help="print the status as one JSON object instead")
    p.set_defaults(fn=_cmd_status)

    p = sub.add_parser("reset", help="start a new run of a job (a new generation; old state reads as empty)")
    _target_args(p)
    p.set_defaults(fn=_cmd_reset)

    p = sub.add_parser("build-p4", help="compile the P4 program for a target (bmv2: BMv2 JSON and P4Info; "
                                        "tofino, tofino2: bf-p4c's binary, context.json and bfrt.json)")
    # Not DEFAULT_TARGET: the embedded switch has no data plane to compile; bmv2 is the P4 target anyone can run
    _target_choice(p, "bmv2")
    p.add_argument("--out", help="output directory (default: build/<target>)")
    p.add_argument("--resources", action="store_true",
                   help="then print the compiler's resource report: stages, SRAM/TCAM, stateful ALUs, PHV")
    p.set_defaults(fn=_cmd_build_p4)

    p = sub.add_parser("deploy", help="install a job on a switch (P4: admission, multicast group, egress rewrites)")
    _target_args(p)
    p.add_argument("--pipeline", metavar="DIR",
                   help="compile the P4 program into this directory and push it first (bmv2 only: bf_switchd "
                        "loads its program at start)")
    p.add_argument("--lease", type=float, metavar="SECONDS",
                   help="remove the job this long after its deploy or last `switchagg renew` (soft only: the P4 "
                        "targets' control planes run no timer); default: no lease, the job stays until undeployed")
    p.set_defaults(fn=_cmd_deploy)

    p = sub.add_parser("renew", help="renew a job's lease (one deployed with --lease, or by a process group)")
    _target_args(p)
    p.set_defaults(fn=_cmd_renew)

    p = sub.add_parser("undeploy", help="remove a job from a switch")
    _target_args(p)
    p.set_defaults(fn=_cmd_undeploy)

    p = sub.add_parser("demo", help="the main job: allreduce among worker processes, then a small DDP training")
    p.add_argument("--workers", type=int, default=4, help="worker processes (default 4; the training uses up to 4)")
    p.add_argument("--size", type=int, default=1_000_000, help="float32 elements per tensor")
    p.add_argument("--rounds", type=int, default=5, help="allreduce calls")
    p.add_argument("--values-per-packet", type=int, default=8192, help="K (loopback takes large packets)")
    p.add_argument("--no-train", action="store_true", help="skip the DDP training part")
    p.set_defaults(fn=_cmd_demo)

    p = sub.add_parser("worker", help="one worker of a job: allreduce seeded tensors, check every sum")
    p.add_argument("--config", required=True, help="the job's TOML file, or a tree file")
    p.add_argument("--rank", type=int, required=True, help="this worker's rank: its place in the [[workers]] list "
                                                         "(a tree file's: its rank in the tree, leaf by leaf)")
    p.add_argument("--size", type=int, default=100_000, help="float32 elements per tensor")
    p.add_argument("--rounds", type=int, default=3, help="allreduce calls, each sum checked (default 3)")
    p.set_defaults(fn=_cmd_worker)

    p = sub.add_parser("bench", help="allreduce throughput and host CPU against gloo, codec and transport speed")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--loss", action="store_true",
                      help="instead: time under 0, 0.1, 1 and 5%% real packet loss (root: namespaces and nftables)")
    mode.add_argument("--ddp", action="store_true",
                      help="instead: DDP step time of a ~2M-parameter MLP through the switchagg backend against "
                           "gloo, and the bytes each rank sends and receives")
    mode.add_argument("--fsdp", action="store_true",
                      help="instead: the same with FSDP2 (its reduce-scatter through the switch)")
    mode.add_argument("--link-rate", type=float, nargs="+", metavar="MBIT",
                      help="instead: gloo against switchagg on namespace links shaped to each rate (Mbit/s, tbf on "
                           "both ends of every worker's link), the ratio next to its bound, 2(N-1)/N over the wire's "
                           "bytes per value byte (root: namespaces and tc)")
    mode.add_argument("--tree", metavar="LEAVESxWORKERS",
                      help="instead: a tree of switches (a spine over LEAVES leaves of WORKERS workers each) against "
                           "the same ranks on one switch and against gloo, under 0, 1 and 5%% real loss on every hop "
                           "(root: namespaces and nftables; at most 32 ranks, what the flat job holds)")
    p.add_argument("--workers", type=int, nargs="+",
                   help="worker processes (default 4; --link-rate takes several counts, default 4 8; --loss takes "
                        "--loss-workers)")
    p.add_argument("--nodes", type=int,
                   help="with --ddp or --fsdp: put the workers on this many nodes (a switch job per rail), and "
                        "compare with the same ranks as one flat job and with gloo")
    p.add_argument("--mib", type=float, help="tensor size in MiB of float32 (default 64; --link-rate 32)")
    p.add_argument("--reps", type=int,
                   help="timed repetitions after a warm-up, median reported (default 5; --link-rate 3; --tree: "
                        "3 float32 and int32 calls each, their mean reported)")
    p.add_argument("--values-per-packet", type=int, nargs="+",
                   help="K, one or more (default 64 16000; --link-rate 64 256, at most 362: the links' MTU): 64 is "
                        "the P4 switch's packet, 16000 a 64 KB datagram (loopback only)")
    p.add_argument("--slots", type=int, help="the job's slots (default: 1024 for K = 64, 16 for 64 KB datagrams)")
    p.add_argument("--rounds", type=int,
                   help="switchagg then gloo, this many times (--loss: every rate and recovery; --link-rate: at "
                        "every rate); "
                        "the ratios are the median of the rounds' (default 3; not with --ddp or --fsdp)")
    p.add_argument("--no-gloo", action="store_true", help="skip the gloo baseline (no ratios then)")
    p.add_argument("--switch-cores", type=int,
                   help="run the embedded switch on this many cores (switchagg switch --cores; default 1) and "
                        "report its packets/s per core")
    p.add_argument("--switch-steer", choices=("job", "slot"),
                   help="the switch's --steer with --switch-cores (default job)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw each round's ratios and packet rates (--link-rate: the ratio against its bound per "
                        "rate; matplotlib; not with --ddp or --fsdp)")
    p.add_argument("--loss-workers", type=int, nargs="+", help="worker counts of --loss (default 4 7)")
    p.add_argument("--loss-rates", type=float, nargs="+",
                   help="loss rates of --loss, percent per hop (default 0 0.1 1 5)")
    p.add_argument("--loss-recovery", nargs="+", choices=sorted(LOSS_RECOVERY),
                   help="the job's loss_recovery settings --loss compares (default resend query)")
    p.add_argument("--link-loss", type=float, metavar="PCT",
                   help="with --link-rate: also run switchagg with this percentage of its packets dropped at every "
                        "namespace's input (nftables; gloo's TCP stays lossless), and print its lossless time over "
                        "its lossy time")
    p.add_argument("--link-burst", type=int, metavar="N",
                   help="with --link-loss: drop in runs of N consecutive packets at the same average rate")
    p.add_argument("--loss-runs", nargs="+", metavar="RUN",
                   help="run lengths --loss compares (default 1): 1 drops each packet on its own, N runs of N "
                        "packets in a row at the same rate, gso whole GSO super-packets (links with the kernel's "
                        "default offloads)")
    p.add_argument("--tree-loss", type=float, nargs="+", metavar="PCT",
                   help="loss rates of --tree, percent per hop (default 0 1 5)")
    p.add_argument("--tree-link-rate", type=float, metavar="MBIT",
                   help="--tree on links shaped to this rate, Mbit/s (tbf on both ends of every link, the leaves' "
                        "uplinks too: the tree sends a leaf's partial up where the flat job sends every worker's)")
    p.set_defaults(fn=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand. What goes wrong in a way the user can fix (a bad config, a refused flag, a
    busy port, an address that cannot be reached) is one line on stderr and exit status 1: a traceback
    would bury the one sentence that says what to do. Anything else is a bug, and keeps its traceback."""
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except SwitchAggError as exc:
        message = str(exc)
    except OSError as exc:
        message = exc.strerror or str(exc)
        if exc.filename is not None:
            message = f"{exc.filename}: {message}"
    print(f"switchagg {args.command}: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
