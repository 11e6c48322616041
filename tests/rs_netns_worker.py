"""A reduce-scatter worker for the BMv2 end-to-end test: ``python -m tests.rs_netns_worker CONFIG RANK OUT ROUNDS N``.

Each round it reduce-scatters seeded float32 and int32 vectors of ``n_workers * (N + round)``
values (its shard of each sum comes back whole, the others' chunks as headers alone: docs/protocol.md
section 4b), then allreduces the int32 one, so that the two kinds of call share the job's slots, and
saves what came back to OUT (.npz) with the client's loss count.
"""

from __future__ import annotations

import sys

import numpy as np

from switchagg import Client, JobConfig

from .netns_worker import inputs


def main() -> None:
    config, rank, out, rounds, size = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    cfg = JobConfig.from_file(config)
    results = {}
    with Client(cfg, rank, start_timeout=30, stall_timeout=8) as client:
        for r in range(rounds):
            f, i = inputs(rank, r, cfg.n_workers * (size + r))
            results[f"f{r}"] = client.reduce_scatter(f)
            results[f"i{r}"] = client.reduce_scatter(i)
            results[f"a{r}"] = client.allreduce(i)
        results["timeouts"] = np.array(client.window.losses)
    np.savez(out, **results)


if __name__ == "__main__":
    main()
