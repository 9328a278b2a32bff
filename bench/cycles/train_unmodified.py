"""A training script that knows nothing of the sidecar (no trainer_hooks import): DDP over gloo,
SGD, a plain `dist.init_process_group`. Watched only through `-m trainer_hooks.attach`.
Prints the final parameters' checksum on rank 0."""

import hashlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from bench.cycles.chaos import Chaos

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
chaos = Chaos()
for step in range(1, chaos.hang_step + 41):
    x = torch.randn(4, 8)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    chaos.step(step)
chaos.done()
if dist.get_rank() == 0:
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(f"params_sha256={digest}", flush=True)
dist.destroy_process_group()
