"""A Hugging Face Trainer run (DDP over gloo on the CPU) with the hooks' SidecarCallback, paused by
the Trainer's own evaluation loop (`eval_strategy="steps"`): each evaluation of the schedule lasts
the pause (bench/field/loop.py EvalPauses)."""

import os
import tempfile
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from bench.field.loop import STEP_SECONDS, EvalPauses, record
from trainer_hooks.hf import SidecarCallback  # importing it makes the process group restart-safe

STEPS = int(os.environ.get("FIELD_STEPS", "60"))
EVAL_BATCHES = 8
pauses = EvalPauses(EVAL_BATCHES)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, x, labels):
        if not self.training:
            pauses.batch()
        return {"loss": torch.nn.functional.mse_loss(self.layer(x), labels)}


class Pauses(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(STEP_SECONDS)  # steps as long as the user's loop's
        if state.global_step == 1:
            record("first_step")
        if control.should_evaluate:
            pauses.begin()

    def on_evaluate(self, args, state, control, **kwargs):
        pauses.end()


torch.manual_seed(0)
data = [{"x": torch.randn(8), "labels": torch.randn(1)} for _ in range(256)]
args = TrainingArguments(
    output_dir=os.environ.get("FIELD_WORKDIR", tempfile.gettempdir()),
    max_steps=STEPS * (pauses.pauses + 1),
    eval_strategy="steps",
    eval_steps=STEPS,
    per_device_train_batch_size=4,
    per_device_eval_batch_size=4,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    dataloader_num_workers=0,
    learning_rate=1e-3,
)
evaluation = data[: EVAL_BATCHES * 4 * int(os.environ.get("WORLD_SIZE", "1"))]
trainer = Trainer(model=Tiny(), args=args, train_dataset=data, eval_dataset=evaluation,
                  callbacks=[Pauses(), SidecarCallback()])  # fmt: skip
trainer.train()
record("done")
