"""A Lightning run (DDP over gloo on the CPU) with the hooks' SidecarCallback."""

import os

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from bench.cycles.chaos import Chaos
from trainer_hooks.lightning import SidecarCallback


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Hang(pl.Callback):
    def __init__(self, chaos):
        self.chaos = chaos

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.chaos.step(trainer.global_step)


chaos = Chaos()
torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
trainer = pl.Trainer(
    max_steps=chaos.hang_step + 40,
    accelerator="cpu",
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    strategy="ddp",
    num_nodes=1,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    callbacks=[SidecarCallback(), Hang(chaos)],
)
trainer.fit(Tiny(), DataLoader(data, batch_size=4))
chaos.done()
