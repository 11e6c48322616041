"""Train a small model with DDP or FSDP2 through the switch, launched by torchrun.

Start a switch that takes jobs (no job file), then the ranks::

    switchagg switch --address 127.0.0.1:16711 --control 127.0.0.1:16712 &
    SWITCHAGG_SWITCH=127.0.0.1:16711 SWITCHAGG_CONTROL=127.0.0.1:16712 \\
        torchrun --nproc-per-node 2 examples/train.py            # DDP
    ... torchrun --nproc-per-node 2 examples/train.py --fsdp     # FSDP2: reduce-scatter through the switch
    ... torchrun --nnodes 2 --node-rank N ... examples/train.py  # each node reduces locally first, a job per rail

``--backend gloo`` runs the same training without the switch, to compare the losses.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import switchagg.distributed  # noqa: F401 - registers the "switchagg" backend


def net() -> torch.nn.Module:
    """The model, unwrapped: every rank starts from the same weights."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def model_for(fsdp: bool) -> torch.nn.Module:
    model = net()
    if not fsdp:
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 instead of DDP")
    parser.add_argument("--backend", default="switchagg", help="switchagg (default) or gloo, to compare")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    layout = getattr(dist.group.WORLD, "layout", None)  # switchagg's: which ranks share a node, which job each is in
    if rank == 0 and layout is not None and layout.hierarchical:
        print(f"switch jobs: {len(layout.jobs)} rails of {len(layout.nodes)} nodes", flush=True)
    model = model_for(args.fsdp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=data)
        loss = torch.nn.functional.cross_entropy(model(x), (x @ teacher).argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            total = loss.detach().clone()
            dist.all_reduce(total, op=dist.ReduceOp.AVG)  # through the switch too
            if rank == 0:
                print(f"step {step:4d}  loss {total.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
