"""A small DDP training through the ``switchagg`` backend, next to the same training over gloo.

Used by ``switchagg demo``: an embedded switch that takes jobs through its control port, and the
ranks' process group formed with ``init_process_group("switchagg")`` (no job file, no comm hook).
Every rank trains the same seeded MLP on its own fixed batch; the losses print side by side.
"""

from __future__ import annotations

import socket
import traceback
from datetime import timedelta

from .loopback import free_ports, run_processes
from .switch.server import SoftSwitch


def mlp(width: int, depth: int):
    """The seeded MLP every rank starts from (the demo's, and the training bench's)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list = [nn.Linear(32, width), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def start_rank(rank: int, world: int, port: int, backend: str, options):
    """This process's rank in a group of ``backend`` (``options``: switchagg's), and its fixed batch (x, y)."""
    import torch
    import torch.distributed as dist

    import switchagg.distributed  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120), pg_options=options if backend == "switchagg" else None)
    x = torch.randn(128, 32, generator=torch.Generator().manual_seed(rank))
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def _ddp_worker(rank: int, queue, world: int, port: int, backend: str, options, steps: int) -> None:
    try:
        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel as DDP

        x, y = start_rank(rank, world, port, backend, options)
        model = DDP(mlp(64, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        params = sum(p.numel() for p in model.parameters())
        dist.destroy_process_group()
        queue.put((rank, "result", {"losses": losses, "params": params}))
    except Exception:  # noqa: BLE001 - the parent reports it
        queue.put((rank, "error", traceback.format_exc()))


def run_training_demo(workers: int = 2, steps: int = 8) -> int:
    from .distributed import Options

    (control,) = free_ports(1, kind=socket.SOCK_STREAM)
    with SoftSwitch(("127.0.0.1", 0), control=("127.0.0.1", control)) as sw:
        options = Options(switch=f"127.0.0.1:{sw.address[1]}", control=f"127.0.0.1:{control}")
        runs = {}
        for backend in ("gloo", "switchagg"):
            (port,) = free_ports(1, kind=socket.SOCK_STREAM)
            runs[backend] = run_processes(_ddp_worker, workers, (workers, port, backend, options, steps))[0]
    ours, base = runs["switchagg"], runs["gloo"]
    print(f"DDP training, {workers} ranks, {ours['params']} parameters, {steps} steps (rank 0's loss), "
          f"init_process_group(\"switchagg\") against gloo:")
    print("  step       gloo   switchagg")
    for i, (a, b) in enumerate(zip(base["losses"], ours["losses"], strict=True)):
        print(f"  {i:>4}  {a:9.6f}   {b:9.6f}")
    drift = abs(ours["losses"][-1] - base["losses"][-1]) / abs(base["losses"][-1])
    print(f"  final loss differs by {drift * 100:.3f}% (quantization of the gradients)")
    return 0 if drift < 0.01 else 1
