"""``switchagg demo``: the main job, end to end on this machine.

An embedded switch and ``workers`` processes that allreduce seeded random tensors
and check every result against numpy within the codec's error bound. The command
then runs (with torch installed) a few DDP training steps through the switchagg backend
next to the same steps over gloo (:mod:`switchagg.ddp_demo`).
"""

from __future__ import annotations

import traceback

from .client import Client
from .config import JobConfig
from .jobs import JOB_DROPS
from .loopback import loopback_job, run_processes
from .switch.server import SoftSwitch
from .worker import checked_rounds


def _worker(rank: int, queue, config_toml: str, size: int, rounds: int) -> None:
    import tomllib

    try:
        cfg = JobConfig.from_dict(tomllib.loads(config_toml))
        worst, ok, seconds = 0.0, True, 0.0
        with Client(cfg, rank) as client:
            for r in checked_rounds(client, size, rounds):
                seconds += r.seconds
                worst, ok = max(worst, r.max_error), ok and r.within_bound
                if rank == 0:
                    queue.put((rank, "progress", (r.round + 1, rounds, "allreduce")))
            queue.put((rank, "result", {"max_error": worst, "within_bound": ok, "seconds": seconds,
                                        "backend": client.backend}))
    except Exception:  # noqa: BLE001 - the parent reports it
        queue.put((rank, "error", traceback.format_exc()))


def run_demo(*, workers: int = 4, size: int = 1_000_000, rounds: int = 5, k: int = 8192) -> int:
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
        return 0 if ok else 1
