"""A Lightning run whose ``self.log(..., sync_dist=True)`` metrics ``tests/test_lightning.py`` compares
across backends: ``python tests/lightning_sync_dist.py BACKEND OUT.json``.

Lightning launches the second rank itself (running this script again), so the test runs it as a
program. Lightning makes every logged value a float; what it syncs at an epoch's end is each
metric's total (a float all-reduce: the mean's AVG through the switch, a sum, a max) and, for a
mean, the batch count that divides it: an int64 ``ReduceOp.AVG`` for any backend not named gloo
(for gloo, a sum and its own division). Rank 0 writes each epoch's ``callback_metrics`` to ``OUT.json``.
"""

from __future__ import annotations

import json
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import switchagg.distributed  # noqa: F401 - registers the "switchagg" backend

EPOCHS, BATCHES = 3, 4  # batches per rank and epoch


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        correct = (logits.argmax(1) == y).sum()
        self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True)  # a mean: its count's int64 AVG
        self.log("correct", correct.float(), on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum")
        self.log("top_logit", logits.max(), on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Record(L.Callback):
    """Rank 0 keeps each epoch's synced metrics (as the next epoch starts, and at the end) and writes them."""

    def __init__(self, path: str) -> None:
        self.path, self.rows = path, []

    def on_train_epoch_start(self, trainer: L.Trainer, _: L.LightningModule) -> None:
        if trainer.callback_metrics:
            self.rows.append({name: v.item() for name, v in trainer.callback_metrics.items()})

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.on_train_epoch_start(trainer, module)
        if trainer.global_rank == 0:
            with open(self.path, "w") as f:
                json.dump(self.rows, f)


def main(backend: str, out: str) -> None:
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * BATCHES * 32, 16, generator=g)
    y = (x @ torch.randn(16, 5, generator=g)).argmax(1)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record(out)],
                        strategy=DDPStrategy(process_group_backend=backend))
    trainer.fit(Model(), DataLoader(TensorDataset(x, y), batch_size=32))
    if backend == "gloo":
        # torch asks a program to destroy its groups (gloo's threads can abort one that exits with its
        # group alive: pytorch/pytorch#190489). The switchagg run exits as Lightning leaves it, group
        # alive: the backend's exit handler removes its job, which the test checks.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
