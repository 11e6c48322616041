"""Lightning on CPU with its DDP strategy, whose gradients go through the switch.

Lightning's DDPStrategy registers comm hooks only on CUDA, so a hook would never run here; the
backend needs none::

    switchagg switch --address 127.0.0.1:16711 --control 127.0.0.1:16712 &
    SWITCHAGG_SWITCH=127.0.0.1:16711 SWITCHAGG_CONTROL=127.0.0.1:16712 python examples/lightning_ddp.py
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import switchagg.distributed  # noqa: F401 - registers the "switchagg" backend


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True, sync_dist=True)  # sync_dist: an all_reduce through the switch
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    y = (x @ torch.randn(32, 10, generator=g)).argmax(1)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=2, logger=False, enable_checkpointing=False,
                        strategy=DDPStrategy(process_group_backend="switchagg"))
    trainer.fit(Classifier(), DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True))


if __name__ == "__main__":
    main()
