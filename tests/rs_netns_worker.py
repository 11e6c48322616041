"""A reduce-scatter worker for the BMv2 end-to-end test: ``python -m tests.rs_netns_worker CONFIG RANK OUT ROUNDS N``.

Each round it reduce-scatters seeded float32 and int32 vectors of ``n_workers * (N + round)``
values (its shard of each sum comes back whole, the others' chunks as headers alone: docs/protocol.md
section 4b), then allreduces the int32 one, so that the two kinds of call share the job's slots, and
saves what came back to OUT (.npz) with the client's loss count (netns_worker.serve).
"""

from __future__ import annotations

from typing import Any

from switchagg import Client, JobConfig

from .netns_worker import inputs, serve


def reduce_scatter_round(client: Client, cfg: JobConfig, rank: int, r: int, size: int) -> dict[str, Any]:
    f, i = inputs(rank, r, cfg.n_workers * (size + r))
    return {f"f{r}": client.reduce_scatter(f), f"i{r}": client.reduce_scatter(i), f"a{r}": client.allreduce(i)}


if __name__ == "__main__":
    serve(reduce_scatter_round)
