"""A one-rank gloo job with the hooks, for the collective record's tests: forms its group (the
hooks turned the Flight Recorder on when imported under torchrun's environment), all-reduces
--steps times with a step each, then holds until --release exists and closes."""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import trainer_hooks  # noqa: F401  (under torchrun's environment: the Flight Recorder on)

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5)
p.add_argument("--release", required=True)
args = p.parse_args()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trainer_hooks import Monitor  # noqa: E402

store = os.path.join(tempfile.mkdtemp(), "store")
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
mon, t = Monitor(), torch.ones(8)
for step in range(1, args.steps + 1):
    dist.all_reduce(t)
    mon.step(step)
deadline = time.monotonic() + 60
while not os.path.exists(args.release) and time.monotonic() < deadline:
    time.sleep(0.05)
mon.close()
dist.destroy_process_group()
