"""A rank that trains a tiny, randomly initialised model with a real framework trainer and
the hooks' callback, then writes the Monitor calls the callback made to a JSON file.

    python -m tests.hooks.framework_rank hf OUT.json WORKDIR
    python -m tests.hooks.framework_rank lightning OUT.json WORKDIR

With FRAMEWORK_RANK_OOM_AT_STEP=N the training step N raises torch.OutOfMemoryError, as a CUDA
allocation that does not fit would (tests/exits: the adapters need nothing to report it).

The callback's Monitor is the real one (it pushes to the sidecar named by SIDECAR_SOCKET);
a subclass only records the calls on the way through.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from trainer_hooks import Monitor

CALLS: list[list] = []
OOM_AT_STEP = int(os.environ.get("FRAMEWORK_RANK_OOM_AT_STEP", "-1"))


def out_of_memory_at(step: int) -> None:
    if step == OOM_AT_STEP:
        import torch

        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test)")


class RecordingMonitor(Monitor):
    def step(self, step, **metrics):
        CALLS.append(["step", int(step), sorted(metrics)])
        super().step(step, **metrics)

    def phase_start(self, name, timeout=None):
        CALLS.append(["phase_start", name])
        super().phase_start(name, timeout)

    def phase_end(self, name):
        CALLS.append(["phase_end", name])
        super().phase_end(name)

    def event(self, name, **fields):
        CALLS.append(["event", name, fields.get("step")])
        super().event(name, **fields)

    def close(self, *args, **kwargs):
        CALLS.append(["close"])
        super().close(*args, **kwargs)


def train_hf(workdir: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import trainer_hooks.hf

    trainer_hooks.hf.Monitor = RecordingMonitor
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 16))]
    args = TrainingArguments(
        output_dir=str(workdir / "out"),
        max_steps=6,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=4,
        report_to=[],
        use_cpu=True,
        include_num_input_tokens_seen=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        learning_rate=1e-3,
    )
    from transformers import TrainerCallback

    class OutOfMemory(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            out_of_memory_at(state.global_step + 1)

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=data[:8],
        callbacks=[trainer_hooks.hf.SidecarCallback(), OutOfMemory()],
    )
    trainer.train()


def train_lightning(workdir: Path) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.utilities import grad_norm
    from torch.utils.data import DataLoader, TensorDataset

    import trainer_hooks.lightning

    trainer_hooks.lightning.Monitor = RecordingMonitor

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            out_of_memory_at(self.global_step + 1)
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def on_before_optimizer_step(self, optimizer):
            # Lightning's own utility: logs grad_2.0_norm/<param> and grad_2.0_norm_total
            self.log_dict(grad_norm(self, norm_type=2))

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = pl.Trainer(
        max_steps=6,
        val_check_interval=3,
        accumulate_grad_batches=2,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(workdir),
        callbacks=[
            trainer_hooks.lightning.SidecarCallback(),
            pl.callbacks.ModelCheckpoint(dirpath=str(workdir / "ckpt"), every_n_train_steps=4, save_top_k=-1),
        ],
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=8))


def main(argv: list[str]) -> int:
    framework, out, workdir = argv[0], Path(argv[1]), Path(argv[2])
    {"hf": train_hf, "lightning": train_lightning}[framework](workdir)
    out.write_text(json.dumps(CALLS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
