"""A rank of a ``switchagg`` process group in a BMv2 test-bed namespace:
``python -m tests.bmv2_backend_worker RANK WORLD MASTER OUT`` (the ``SWITCHAGG_*`` variables set).

It sums int32 values through the backend, trains the small MLP of tests/ddp_worker.py with DDP
and no hook, and saves what the test compares.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import switchagg.distributed  # noqa: F401 - registers the backend

from .ddp_worker import fixed_batch_losses, make_model

STEPS = 4


def main() -> None:
    rank, world, master, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("switchagg", init_method=f"tcp://{master}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    job = dist.group.WORLD.formed.config
    ints = torch.arange(3000, dtype=torch.int32) * (rank + 1)
    dist.all_reduce(ints)
    model = nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=0.004)
    losses, params = fixed_batch_losses(model, rank, STEPS)
    dist.destroy_process_group()
    np.savez(out, ints=ints.numpy(), losses=np.array(losses), params=params.numpy(), job=job.job_id,
             slots=(job.slot_base, job.slot_count), leaf=-1 if job.parent is None else job.parent.index)


if __name__ == "__main__":
    main()
