"""A user's own DDP loop with the hooks' Monitor: `mon.step()` after each optimizer step and no phase
declared, paused and hung as bench/field/loop.py says."""

import torch.distributed as dist

import trainer_hooks.distributed
from bench.field.loop import Job
from trainer_hooks import Monitor

trainer_hooks.distributed.init_process_group("gloo")
mon = Monitor()
Job(on_step=lambda step, loss: mon.step(step, loss=loss, samples=4)).run()
mon.close()
dist.destroy_process_group()
