"""``import switchagg.distributed`` registers the torch.distributed backend ``"switchagg"``.

Under ``torchrun``, with the switch's address in the environment::

    SWITCHAGG_SWITCH=127.0.0.1:16711 SWITCHAGG_CONTROL=127.0.0.1:16712 torchrun --nproc-per-node 2 train.py

    import switchagg.distributed
    torch.distributed.init_process_group("switchagg")

needs no job file: the ranks form the job through torch's store, rank 0 deploys it on the switch
(:mod:`.rendezvous`), and ``destroy_process_group()`` removes it. ``all_reduce`` and
``reduce_scatter_tensor`` of the types the switch sums go through it; everything else through gloo
or NCCL (:mod:`.group` says which call goes where). The variables are in :mod:`.options`;
``pg_options=switchagg.distributed.Options(...)`` says the same in code.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .group import SwitchAggProcessGroup
from .options import ENV, Options

__all__ = ["ENV", "Options", "SwitchAggProcessGroup", "create"]


def create(backend_options: Any, pg_options: Options | None) -> SwitchAggProcessGroup:
    """torch's constructor hook: the group for these ranks, on the switch ``pg_options`` or the environment names."""
    if pg_options is not None and not isinstance(pg_options, Options):
        raise TypeError(f"pg_options for the switchagg backend is a switchagg.distributed.Options, "
                        f"not {type(pg_options).__name__}")
    options = pg_options or Options.from_env()
    timeout = backend_options.timeout if isinstance(backend_options.timeout, timedelta) else timedelta(minutes=30)
    return SwitchAggProcessGroup(backend_options.store, backend_options.group_rank, backend_options.group_size,
                                 timeout, options)


dist.Backend.register_backend("switchagg", create, extended_api=True, devices=["cpu", "cuda"])
