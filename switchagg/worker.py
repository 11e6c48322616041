"""``switchagg worker``: one worker of a job that checks every sum it gets.

Every rank can rebuild every other rank's seeded input, so each checks the whole sum
itself, against numpy, within the codec's documented error bound. The demo runs the
same check in its worker processes. A worker of a tree (docs/protocol.md section 10) is
given the tree file and its rank in the tree, and sums with every rank of the tree.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from . import codec
from .client import Client
from .tree import TreeConfig, load


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


class CheckedRound(NamedTuple):
    """One allreduce of seeded inputs: how long it took, its largest error, and whether that is in bound."""

    round: int
    seconds: float
    max_error: float
    within_bound: bool


def checked_rounds(client: Client, size: int, rounds: int) -> Iterator[CheckedRound]:
    """Allreduce ``rounds`` seeded inputs of ``size`` float32 with ``client``, checking each sum (every rank's
    input, of the tree's ranks where the job is a leaf of a tree)."""
    cfg = client.config
    for r in range(rounds):
        xs = [demo_inputs(w, r, size) for w in range(cfg.ranks)]
        t = time.perf_counter()
        got = client.allreduce(xs[cfg.rank_of(client.rank)])
        took = time.perf_counter() - t
        yield CheckedRound(r, took, *check_sum(got, xs, cfg.values_per_packet))


def run_worker(config: str, rank: int, *, size: int, rounds: int) -> int:
    """``switchagg worker``: one worker of a job, checking each sum (every rank rebuilds every input); with a tree
    file, rank ``rank`` of the tree under its leaf."""
    job = load(config)
    cfg, index = job.worker(rank) if isinstance(job, TreeConfig) else (job, rank)
    with Client(cfg, index) as client:
        for r in checked_rounds(client, size, rounds):
            print(f"round {r.round}: {size} float32 in {r.seconds * 1e3:.1f} ms "
                  f"({size * 4 / r.seconds / 2**20:.2f} MiB/s), max error {r.max_error:.3g} "
                  f"{'within' if r.within_bound else 'OUTSIDE'} the bound; window "
                  f"{client.window.cwnd:.1f}, timeouts {client.window.losses}", flush=True)
            if not r.within_bound:
                return 1
        stats = client.transport_stats
        print(f"dropped on arrival: {client.foreign_datagrams} foreign datagrams, {stats.truncated} cut short, "
              f"{stats.dropped} past a receive's room", flush=True)
    return 0
