"""A DDP rank in a test-bed namespace: ``python -m tests.ddp_netns_worker CONFIG RANK MASTER OUT``.

Trains the small MLP of tests/ddp_worker.py with plain allreduce and then with the switchagg hook,
gloo over the test bed's own network, and saves both loss curves and the final parameters.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from switchagg import JobConfig
from switchagg.ddp import SwitchAggState, allreduce_hook

from .ddp_worker import fixed_batch_losses, make_model

STEPS = 4


def main() -> None:
    config, rank, master, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    cfg = JobConfig.from_file(config)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=cfg.n_workers,
                            timeout=timedelta(seconds=60))
    saved = {}
    for mode in ("default", "switchagg"):
        model = DDP(make_model(), bucket_cap_mb=0.004)
        if mode == "switchagg":
            state = SwitchAggState.create(cfg, stall_timeout=8.0, probe_timeout=20.0)
            model.register_comm_hook(state, allreduce_hook)
        losses, params = fixed_batch_losses(model, rank, STEPS)
        saved[f"{mode}_losses"] = np.array(losses)
        saved[f"{mode}_params"] = params.numpy()
    state.close()
    dist.destroy_process_group()
    np.savez(out, **saved)


if __name__ == "__main__":
    main()
