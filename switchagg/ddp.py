"""A torch DDP communication hook that averages gradient buckets through the switch.

Usage, on every rank (the process group is DDP's own, gloo or NCCL)::

    state = switchagg.ddp.SwitchAggState.create(JobConfig.from_file("job.toml"))
    model.register_comm_hook(state, switchagg.ddp.allreduce_hook)

The bucket travels on the client's thread; the hook returns at once with a
``torch.futures.Future`` that completes from there, with the mean, or with the
error that stopped it (a dead peer or switch fails backward, it never hangs it).
There is no fallback decided by one rank: a rank that fell back alone would
leave the others waiting for packets that never come.
"""


from dataclasses import dataclass

import torch
import torch.distributed as dist

from .client import Client
from .config import JobConfig
from .errors import ConfigError, SwitchAggError
from .torch_futures import failed_future, torch_future


@dataclass
class SwitchAggState:
    """What the hook needs: this rank's client and the world size it divides by."""

    client: Client
    world_size: int

    @classmethod
    def create(cls, config: JobConfig, process_group: dist.ProcessGroup | None = None, *,
               probe_timeout: float = 60.0, **client_options: float) -> "SwitchAggState":
        """Build the state on every rank together; fails on every rank if any rank cannot reach the switch.

        The rank in the process group is the worker's position in ``config.workers``.
        """
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        if world != config.n_workers:
            raise ConfigError(f"the process group has {world} ranks but job {config.job_id} lists "
                              f"{config.n_workers} workers: make them match")
        client, problem = None, ""
        try:
            client = Client(config, rank, **client_options)
            client.join(probe_timeout)  # the switch admits it, and every rank joins this run's session
        except (SwitchAggError, OSError) as exc:
            problem = f"rank {rank}: {exc}"
        problems: list[str] = [""] * world
        dist.all_gather_object(problems, problem, group=process_group)
        failed = [p for p in problems if p]
        if failed:
            if client is not None:
                client.close()
            raise SwitchAggError("switchagg cannot start this job, so no rank uses it: " + "; ".join(failed))
        return cls(client, world)

    def close(self) -> None:
        self.client.close()


def allreduce_hook(state: SwitchAggState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over all ranks through the switch (float32, float16 or bfloat16 buckets)."""
    tensor = bucket.buffer()
    try:
        done = state.client.allreduce_async(tensor, op="mean", out=tensor)  # in place
    except BaseException as exc:  # noqa: BLE001 - e.g. a closed client: backward raises it
        return failed_future(exc, tensor.device)
    return torch_future(done, tensor.device)
