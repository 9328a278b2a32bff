"""The same DDP loop knowing nothing of the sidecar (no trainer_hooks import), watched only through
`python -m trainer_hooks.attach`: its steps are the optimizer's, its checkpoints torch.save's."""

import torch.distributed as dist

from bench.field.loop import Job

dist.init_process_group("gloo")
Job().run()
dist.destroy_process_group()
