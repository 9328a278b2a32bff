"""The `Monitor` example of docs/guide.md as a user writes it: the hooks' Monitor and a plain
`torch.distributed.init_process_group`, nothing else of trainer_hooks. Importing trainer_hooks
makes the group restart-safe under torchrun (trainer_hooks.distributed)."""

import torch
import torch.distributed as dist

from bench.cycles.chaos import Chaos
from trainer_hooks import Monitor

dist.init_process_group("gloo")
mon, chaos, t = Monitor(), Chaos(), torch.ones(1)
for step in range(1, chaos.hang_step + 41):
    dist.all_reduce(t)
    mon.step(step, loss=1.0 / step, samples=8)
    chaos.step(step)
chaos.done()
mon.close()
dist.destroy_process_group()
