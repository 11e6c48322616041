"""``switchagg demo``: the main job, end to end on this machine.

An embedded switch, ``workers`` processes that allreduce seeded random tensors
and check every result against numpy within the codec's error bound, then (with
torch installed) a few DDP training steps with the switchagg comm hook next to
the same steps with plain allreduce.
"""

from __future__ import annotations

import time
import traceback

import numpy as np

from . import codec
from .client import Client
from .config import JobConfig
from .local import loopback_job, run_processes
from .switch.counters import JOB_DROPS
from .switch.server import SoftSwitch


def demo_inputs(rank: int, round_: int, size: int) -> np.ndarray:
    """Every rank can rebuild every other rank's input, so each checks the full sum itself."""
    rng = np.random.default_rng([round_, rank])
    return (rng.standard_normal(size) * rng.uniform(0.01, 100)).astype(np.float32)


def check_sum(got: np.ndarray, xs: list[np.ndarray], k: int) -> tuple[float, bool]:
    """Largest error against the float64 sum, and whether it is within the documented bound."""
    exact = np.sum(np.stack(xs).astype(np.float64), axis=0)
    exps = np.max([codec.propose_exponents(x, k) for x in xs], axis=0)
    bound = np.repeat([codec.error_bound(int(e), len(xs)) for e in exps], k)[: exact.size]
    err = np.abs(got.astype(np.float64) - exact)
    return float(err.max()), bool(np.all(err <= bound + np.abs(exact) * 2.0**-23))


def _worker(rank: int, queue, config_toml: str, size: int, rounds: int) -> None:
    import tomllib

    try:
        cfg = JobConfig.from_dict(tomllib.loads(config_toml))
        worst, ok, seconds = 0.0, True, 0.0
        with Client(cfg, rank) as client:
            for r in range(rounds):
                xs = [demo_inputs(w, r, size) for w in range(cfg.n_workers)]
                t = time.perf_counter()
                got = client.allreduce(xs[rank])
                seconds += time.perf_counter() - t
                err, good = check_sum(got, xs, cfg.values_per_packet)
                worst, ok = max(worst, err), ok and good
                if rank == 0:
                    queue.put((rank, "progress", (r + 1, rounds, "allreduce")))
            queue.put((rank, "result", {"max_error": worst, "within_bound": ok, "seconds": seconds,
                                        "backend": client.backend}))
    except Exception:  # noqa: BLE001 - the parent reports it
        queue.put((rank, "error", traceback.format_exc()))


def run_demo(*, workers: int = 4, size: int = 1_000_000, rounds: int = 5, train: bool = True,
             k: int = 8192) -> int:
    cfg = loopback_job(workers, values_per_packet=k)
    with SoftSwitch(cfg.switch, control=cfg.control) as sw:
        sw.add_job(cfg)
        print(f"embedded switch on {cfg.switch} ({sw.backend}); job {cfg.job_id}: {workers} workers, "
              f"K={k} values per packet, {cfg.slot_count} slots")
        results = run_processes(_worker, workers, (cfg.to_toml(), size, rounds))
        ok = all(r["within_bound"] for r in results)
        slowest = max(r["seconds"] for r in results)
        mib = size * 4 * rounds / 2**20
        print(f"allreduce: {rounds} x {size} float32 among {workers} processes, "
              f"{mib / slowest:.1f} MiB/s per worker ({results[0]['backend']})")
        print(f"  max error vs numpy float64 sum: {max(r['max_error'] for r in results):.3g} "
              f"({'within' if ok else 'OUTSIDE'} the codec bound n*0.5/s)")
        c = sw.counters()
        job = c["jobs"][cfg.job_id]
        drops = sum(job[c.name.lower()] for c in JOB_DROPS)
        print(f"  switch: {job['results_multicast']} sums multicast, {job['results_unicast']} resent, "
              f"{drops} packets dropped (mostly repeats from workers that started early)")
        if not ok:
            return 1
    if train:
        try:
            from .ddp_demo import run_training_demo
        except ImportError as exc:
            print(f"training part skipped: {exc} (install the 'torch' extra)")
            return 0
        return run_training_demo(workers=min(workers, 4))
    return 0


def run_worker(config: str, rank: int, *, size: int, rounds: int) -> int:
    """``switchagg worker``: one worker of a job, checking each sum (every rank rebuilds every input)."""
    cfg = JobConfig.from_file(config)
    with Client(cfg, rank) as client:
        for r in range(rounds):
            xs = [demo_inputs(w, r, size) for w in range(cfg.n_workers)]
            t = time.perf_counter()
            got = client.allreduce(xs[rank])
            took = time.perf_counter() - t
            err, ok = check_sum(got, xs, cfg.values_per_packet)
            print(f"round {r}: {size} float32 in {took * 1e3:.1f} ms ({size * 4 / took / 2**20:.2f} MiB/s), "
                  f"max error {err:.3g} {'within' if ok else 'OUTSIDE'} the bound; window "
                  f"{client.window.cwnd:.1f}, timeouts {client.window.losses}", flush=True)
            if not ok:
                return 1
    return 0
