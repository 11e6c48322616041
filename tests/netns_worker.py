"""One worker process for the namespace tests: ``python -m tests.netns_worker CONFIG RANK OUT ROUNDS SIZE``.

It allreduces seeded float32 and int32 tensors ROUNDS times and saves what came back to OUT (.npz),
with the client's loss count and transport backend.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from switchagg import Client, JobConfig


def inputs(rank: int, round_: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([rank, round_])
    return (rng.standard_normal(size).astype(np.float32) * 10.0 ** rng.integers(-3, 4),
            rng.integers(-2**20, 2**20, size).astype(np.int32))


def check_sums(got, ranks: int, rounds: int, size: int) -> None:
    """Every rank's allreduce_round results (``got[r]``, r a tree rank) are the sums of every rank's inputs: the
    int32 ones exact, the float32 ones the same on every rank and within the codec's bound of the true sum."""
    for rnd in range(rounds):
        ints = np.sum([inputs(w, rnd, size + rnd)[1].astype(np.int64) for w in range(ranks)], axis=0)
        floats = np.sum([inputs(w, rnd, size + rnd)[0].astype(np.float64) for w in range(ranks)], axis=0)
        for r in range(ranks):
            assert np.array_equal(got[r][f"i{rnd}"], ints.astype(np.int32))
            assert np.array_equal(got[r][f"f{rnd}"], got[0][f"f{rnd}"])
            assert np.allclose(got[r][f"f{rnd}"], floats, rtol=1e-5, atol=1e-6 * np.abs(floats).max())


def serve(round_: Callable[[Client, JobConfig, int, int, int], dict[str, Any]]) -> None:
    """The command line ``CONFIG RANK OUT ROUNDS SIZE``: a client of CONFIG as RANK runs ``round_(client,
    config, rank, r, size)`` for each round r, and OUT (.npz) gets what the rounds returned, the client's
    loss count and its transport backend."""
    config, rank, out, rounds, size = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    cfg = JobConfig.from_file(config)
    results = {}
    with Client(cfg, rank, start_timeout=30, stall_timeout=8) as client:
        for r in range(rounds):
            results.update(round_(client, cfg, rank, r, size))
        results["timeouts"] = np.array(client.window.losses)
        results["backend"] = np.array(client.backend)
    np.savez(out, **results)


def allreduce_round(client: Client, cfg: JobConfig, rank: int, r: int, size: int) -> dict[str, Any]:
    f, i = inputs(cfg.rank_of(rank), r, size + r)  # a tree's worker: its rank in the tree
    return {f"f{r}": client.allreduce(f), f"i{r}": client.allreduce(i)}

if __name__ == "__main__":
    serve(allreduce_round)
