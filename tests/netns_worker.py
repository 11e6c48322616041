"""One worker process for the namespace tests: ``python -m tests.netns_worker CONFIG RANK OUT ROUNDS SIZE``.

It allreduces seeded float32 and int32 tensors ROUNDS times and saves what came back to OUT (.npz),
with the client's loss count and transport backend.
"""

from __future__ import annotations

import sys

import numpy as np

from switchagg import Client, JobConfig


def inputs(rank: int, round_: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([rank, round_])
    return (rng.standard_normal(size).astype(np.float32) * 10.0 ** rng.integers(-3, 4),
            rng.integers(-2**20, 2**20, size).astype(np.int32))


def main() -> None:
    config, rank, out, rounds, size = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    cfg = JobConfig.from_file(config)
    results = {}
    with Client(cfg, rank, start_timeout=30, stall_timeout=8) as client:
        for r in range(rounds):
            f, i = inputs(rank, r, size + r)
            results[f"f{r}"] = client.allreduce(f)
            results[f"i{r}"] = client.allreduce(i)
        results["timeouts"] = np.array(client.window.losses)
        results["backend"] = np.array(client.backend)
    np.savez(out, **results)


if __name__ == "__main__":
    main()
