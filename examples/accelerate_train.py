"""HF accelerate with its process group on the switch.

accelerate's ``comm_hook`` takes only its built-in hooks; the backend needs none. On a GPU,
``InitProcessGroupKwargs(backend="switchagg")`` picks it; on the CPU accelerate always asks for gloo,
so the script creates the group first and accelerate uses the one it finds::

    switchagg switch --address 127.0.0.1:16711 --control 127.0.0.1:16712 &
    SWITCHAGG_SWITCH=127.0.0.1:16711 SWITCHAGG_CONTROL=127.0.0.1:16712 \\
        torchrun --nproc-per-node 2 examples/accelerate_train.py   # or accelerate launch, on GPUs
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch.utils.data import DataLoader, TensorDataset

import switchagg.distributed  # noqa: F401 - registers the "switchagg" backend


def main() -> None:
    gpu = torch.cuda.is_available()
    if not gpu:
        torch.distributed.init_process_group("switchagg")  # accelerate takes the group it finds
    accelerator = Accelerator(cpu=not gpu, kwargs_handlers=[InitProcessGroupKwargs(backend="switchagg")] if gpu else [])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    y = (x @ torch.randn(32, 10, generator=g)).argmax(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(TensorDataset(x, y), batch_size=64))
    for epoch in range(2):
        for xb, yb in loader:
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
        mean = accelerator.reduce(loss.detach(), reduction="mean")  # through the switch
        group = torch.distributed.get_backend()
        accelerator.print(f"epoch {epoch}: loss {mean.item():.4f} (process group backend: {group})")
    accelerator.end_training()


if __name__ == "__main__":
    main()
