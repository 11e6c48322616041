"""FSDP2's reduce-scatter through the switch, for a program whose default group stays NCCL or gloo.

::

    switch = dist.new_group(backend="switchagg")       # beside the default group
    model = fully_shard(model)
    model.set_custom_reduce_scatter(SwitchReduceScatter(switch))

FSDP2 then shards and gathers parameters over its own group as before, and sums each gradient
shard through the switch, every rank receiving only its own shard's sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ..errors import ConfigError
from .group import SwitchAggProcessGroup


class SwitchReduceScatter(ReduceScatter):
    """A ``ReduceScatter`` for :meth:`FSDPModule.set_custom_reduce_scatter` over a switchagg group.

    The group must hold the same ranks, in the same order, as the group FSDP shards over.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        if not isinstance(group, SwitchAggProcessGroup):
            raise ConfigError("SwitchReduceScatter needs a switchagg process group: "
                              "dist.new_group(backend='switchagg')")
        self.group = group

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device,
                 ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        if group.size() != self.group.size() or group.rank() != self.group.rank():
            raise ConfigError(f"FSDP shards over {group.size()} ranks (this is rank {group.rank()}), but the switch "
                              f"group has {self.group.size()} (rank {self.group.rank()}): build it over the same ranks")
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = op
        work = self.group.reduce_scatter_single(output_tensor, input_tensor, opts)
        if async_op:
            return work
        work.wait()
        return None
