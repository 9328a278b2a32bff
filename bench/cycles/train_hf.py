"""A Hugging Face Trainer run (DDP over gloo on the CPU) with the hooks' SidecarCallback."""

import os
import tempfile

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from bench.cycles.chaos import Chaos
from trainer_hooks.hf import SidecarCallback  # importing it makes the process group restart-safe


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.layer(x), labels)}


class Hang(TrainerCallback):
    def __init__(self, chaos):
        self.chaos = chaos

    def on_step_end(self, args, state, control, **kwargs):
        self.chaos.step(state.global_step)


chaos = Chaos()
torch.manual_seed(0)
data = [{"x": torch.randn(8), "labels": torch.randn(1)} for _ in range(256)]
args = TrainingArguments(
    output_dir=os.environ.get("CYCLE_WORKDIR", tempfile.gettempdir()),
    max_steps=chaos.hang_step + 40,
    per_device_train_batch_size=4,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    dataloader_num_workers=0,
    learning_rate=1e-3,
)
trainer = Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[SidecarCallback(), Hang(chaos)])
trainer.train()
chaos.done()
