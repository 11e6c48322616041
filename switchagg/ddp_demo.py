"""A small DDP training, with the switchagg hook and with plain allreduce, side by side.

Used by ``switchagg demo`` (losses next to each other; ``switchagg bench --ddp`` times the
backend instead, :mod:`switchagg.benchmarks.training`). Every rank trains the same seeded MLP on its own fixed
batch; gloo carries DDP's own broadcasts and the baseline's allreduce.
"""

from __future__ import annotations

import socket
import tomllib
import traceback
from datetime import timedelta

from .config import JobConfig
from .loopback import free_ports, loopback_job, run_processes
from .switch.server import SoftSwitch


def _mlp(width: int, depth: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list = [nn.Linear(32, width), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _ddp_worker(rank: int, queue, world: int, port: int, cfg_toml: str, steps: int, width: int, depth: int) -> None:
    try:
        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel as DDP

        from .ddp import SwitchAggState, allreduce_hook

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(128, 32, generator=g)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        out = {}
        for mode in ("allreduce", "switchagg"):
            model = DDP(_mlp(width, depth))
            state = None
            if mode == "switchagg":
                state = SwitchAggState.create(JobConfig.from_dict(tomllib.loads(cfg_toml)))
                model.register_comm_hook(state, allreduce_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            losses = []
            for _ in range(steps):
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            out[mode] = {"losses": losses, "params": sum(p.numel() for p in model.parameters())}
            if state is not None:
                state.close()
        dist.destroy_process_group()
        queue.put((rank, "result", out))
    except Exception:  # noqa: BLE001 - the parent reports it
        queue.put((rank, "error", traceback.format_exc()))


def run_ddp(workers: int, *, steps: int, width: int, depth: int, k: int = 8192) -> list[dict]:
    """Train with the hook and with plain allreduce among ``workers`` processes; each rank's losses."""
    cfg = loopback_job(workers, values_per_packet=k)
    (port,) = free_ports(1, kind=socket.SOCK_STREAM)
    with SoftSwitch(cfg.switch, control=cfg.control) as sw:
        sw.add_job(cfg)
        return run_processes(_ddp_worker, workers, (workers, port, cfg.to_toml(), steps, width, depth))


def run_training_demo(workers: int = 2, steps: int = 8) -> int:
    results = run_ddp(workers, steps=steps, width=64, depth=2)
    ours, base = results[0]["switchagg"], results[0]["allreduce"]
    print(f"DDP training, {workers} ranks, {ours['params']} parameters, {steps} steps (rank 0's loss):")
    print("  step  allreduce   switchagg")
    for i, (a, b) in enumerate(zip(base["losses"], ours["losses"], strict=True)):
        print(f"  {i:>4}  {a:9.6f}   {b:9.6f}")
    drift = abs(ours["losses"][-1] - base["losses"][-1]) / abs(base["losses"][-1])
    print(f"  final loss differs by {drift * 100:.3f}% (quantization of the gradients)")
    return 0 if drift < 0.01 else 1

