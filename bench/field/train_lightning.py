"""A Lightning run (DDP over gloo on the CPU) with the hooks' SidecarCallback, paused by Lightning's
own validation loop (`val_check_interval`): each validation of the schedule lasts the pause
(bench/field/loop.py EvalPauses)."""

import os
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from bench.field.loop import STEP_SECONDS, EvalPauses, record
from trainer_hooks.lightning import SidecarCallback

STEPS = int(os.environ.get("FIELD_STEPS", "60"))
EVAL_BATCHES = 8
pauses = EvalPauses(EVAL_BATCHES)


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        pauses.batch()
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Pauses(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        time.sleep(STEP_SECONDS)  # steps as long as the user's loop's
        if trainer.global_step == 1:
            record("first_step")

    def on_validation_start(self, trainer, module):
        pauses.begin()

    def on_validation_end(self, trainer, module):
        pauses.end()


torch.manual_seed(0)
data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
n = EVAL_BATCHES * 4 * int(os.environ.get("WORLD_SIZE", "1"))  # EVAL_BATCHES on every rank
held_out = TensorDataset(torch.randn(n, 8), torch.randn(n, 1))
trainer = pl.Trainer(
    max_steps=STEPS * (pauses.pauses + 1),
    val_check_interval=STEPS,
    check_val_every_n_epoch=None,
    num_sanity_val_steps=0,
    limit_val_batches=EVAL_BATCHES,
    accelerator="cpu",
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    strategy="ddp",
    num_nodes=1,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    callbacks=[Pauses(), SidecarCallback()],
)
trainer.fit(Tiny(), DataLoader(data, batch_size=4), DataLoader(held_out, batch_size=4))
record("done")
