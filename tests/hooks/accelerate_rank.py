"""A torchrun worker that trains with Hugging Face Accelerate and the hooks' SidecarTracker,
then writes the Monitor calls of this process to OUT_DIR/rank<r>.json.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/hooks/accelerate_rank.py OUT_DIR
"""

import json
import os
import sys

import torch
from accelerate import Accelerator

import trainer_hooks.accelerate
from tests.hooks.framework_rank import CALLS, RecordingMonitor

trainer_hooks.accelerate.Monitor = RecordingMonitor
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, log_with=[trainer_hooks.accelerate.SidecarTracker()])
accelerator.init_trackers("tiny")
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=4)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
for batch_idx, (x, y) in enumerate(data):  # 8 batches per process, 2 per optimizer step: 4 steps
    with accelerator.accumulate(model):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    if accelerator.sync_gradients:
        accelerator.log({"loss": loss.item(), "learning_rate": 0.05, "samples": 8}, step=batch_idx)
accelerator.end_training()
rank = accelerator.process_index
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(CALLS, f)
