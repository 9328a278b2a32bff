"""A user's own training loop: gloo all-reduce per step, the hooks' Monitor, and the process
group from `trainer_hooks.distributed` (the one change it needs to come back after a restart)."""

import torch
import torch.distributed as dist

import trainer_hooks.distributed
from bench.cycles.chaos import Chaos
from trainer_hooks import Monitor

trainer_hooks.distributed.init_process_group("gloo")
mon, chaos, t = Monitor(), Chaos(), torch.ones(1)
for step in range(1, chaos.hang_step + 41):
    dist.all_reduce(t)
    mon.step(step, loss=1.0 / step, samples=8)
    chaos.step(step)
chaos.done()
mon.close()
dist.destroy_process_group()
