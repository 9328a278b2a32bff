"""A user's own gloo loop with the hooks, in the shapes the field's hangs come in (FAULT_SHAPE):

- `sync`: a blocking all-reduce per step (as train_plain.py);
- `async`: the all-reduce launched with `async_op=True` and waited in the user's own function, as a
  CUDA job waits (its waiting rank is not in torch.distributed's frames);
- `tp`: data x tensor parallel on 4 ranks, 2 x 2: an all-reduce in the rank's tensor-parallel
  group, then one in its data-parallel group, every step.

The hang itself comes from bench/cycles/chaos.py (CYCLE_HANG_MODE stop | spin | sleep), plus
`desync`: at the hang step the hanging rank calls a barrier where its peers all-reduce (a program
bug: different collectives at one sequence); `crash`: the hanging rank raises an exception at the
hang step while its peers wait in their all-reduce; `evaluate`: not a fault but a healthy job's
pause, every rank evaluates for CYCLE_WORK_SECONDS (default 12) at the hang step, CPU-bound inside
torch ops under `torch.no_grad()`, outside any collective, nothing declared, then trains on;
`dataloader`: every rank reads its batches from a DataLoader with one worker, and at the hang step
the hanging rank's worker is SIGSTOPped (the rank waits on its queue, its peers in their all-reduce)."""

import os
import signal
import time

import torch
import torch.distributed as dist

import trainer_hooks.distributed
from bench.cycles.chaos import Chaos
from trainer_hooks import Monitor

SHAPE = os.environ.get("FAULT_SHAPE", "sync")


def evaluate(seconds: float) -> None:
    """A long evaluation as a user writes it: no phase declared, no `model.eval()`, the time in torch ops."""
    weight = torch.randn(256, 256) / 16
    end = time.monotonic() + seconds
    with torch.no_grad():
        x = torch.randn(64, 256)
        while time.monotonic() < end:
            x = torch.nn.functional.linear(x, weight).tanh_()


def wait_for(work) -> None:
    """The user's own sync point, outside torch.distributed's frames."""
    work.wait()


trainer_hooks.distributed.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
tp_group = dp_group = None
if SHAPE == "tp":
    assert world == 4, "tp needs 4 ranks (2 x 2)"
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_group, dp_group = tp_groups[rank // 2], dp_groups[rank % 2]
mon, chaos, t = Monitor(), Chaos(), torch.ones(256)
batches = None
if chaos.mode == "dataloader":
    data = torch.utils.data.TensorDataset(torch.ones(20000, 4))
    batches = iter(torch.utils.data.DataLoader(data, batch_size=4, num_workers=1, prefetch_factor=2))
stall_worker = chaos.mode == "dataloader" and chaos.rank == chaos.hang_rank and chaos.attempt < chaos.hangs
desync = chaos.mode == "desync" and chaos.rank == chaos.hang_rank and chaos.attempt < chaos.hangs
crash = chaos.mode == "crash" and chaos.rank == chaos.hang_rank and chaos.attempt < chaos.hangs
pause = chaos.mode == "evaluate" and chaos.attempt < chaos.hangs
if chaos.mode in ("desync", "crash", "evaluate", "dataloader"):
    chaos.hangs = 0  # chaos.step never hangs: the fault (or the pause) below is it
for step in range(1, chaos.hang_step + 41):
    if desync and step == chaos.hang_step + 1:
        chaos.record("hang", step=step)
        dist.barrier()  # its peers are in this step's all-reduce: never returns
    if crash and step == chaos.hang_step + 1:
        chaos.record("hang", step=step, pid=os.getpid())
        raise RuntimeError("a bad batch (bench/cycles/train_faults.py crash)")
    if stall_worker and step == chaos.hang_step + 1:
        worker = batches._workers[0].pid  # type: ignore[union-attr]  # the loader's own worker process
        chaos.record("hang", step=step, pid=worker)
        os.kill(worker, signal.SIGSTOP)
    if batches is not None:
        next(batches)  # blocks once the stopped worker's prefetched batches are used up
    if pause and step == chaos.hang_step + 1:
        chaos.record("hang", step=step)
        evaluate(float(os.environ.get("CYCLE_WORK_SECONDS", "12")))
        chaos.record("worked", step=step)
    if SHAPE == "async":
        wait_for(dist.all_reduce(t, async_op=True))
    elif SHAPE == "tp":
        dist.all_reduce(t, group=tp_group)
        dist.all_reduce(t, group=dp_group)
    else:
        dist.all_reduce(t)
    mon.step(step, loss=1.0 / step, samples=8)
    chaos.step(step)
chaos.done()
mon.close()
dist.destroy_process_group()
