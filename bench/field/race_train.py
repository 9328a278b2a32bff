"""bench_race --field's script: a user's DDP loop with a real job's pauses, none declared. Run
unchanged under torchrun + sidecar (the hooks' Monitor reports each step) and under NVIDIA's
ft_launcher (a heartbeat each step, sent when ft_launcher started the rank); the same loop with
NVRx's sections instead of the heartbeat is race_train_sections.py.

Pauses: every epoch (RACE_EPOCH steps) starts with its DataLoader worker waiting RACE_DATA_SECONDS on
storage for the first item; at the steps of RACE_EVAL_AT an evaluation of RACE_EVAL_SECONDS (forward
passes under no_grad, then one all-reduce of the metric); at the steps of RACE_CKPT_AT a checkpoint:
torch.save to slow storage (a FIFO the bench drains slowly, FIELD_STORAGE), a barrier, then rank 0
writes the resume point to RACE_STATE. A restarted run resumes from there. The hang (CYCLE_* of
bench/cycles/chaos.py) comes inside a step, after the step's all-reduce."""

import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from bench.cycles.chaos import Chaos
from trainer_hooks import Monitor

ENV = os.environ
STEPS, EPOCH = int(ENV.get("RACE_STEPS", "90")), int(ENV.get("RACE_EPOCH", "60"))
EVAL_AT = {int(s) for s in ENV.get("RACE_EVAL_AT", "30").split(",") if s}
CKPT_AT = {int(s) for s in ENV.get("RACE_CKPT_AT", "45").split(",") if s}
DATA_SECONDS, EVAL_SECONDS = float(ENV.get("RACE_DATA_SECONDS", "5")), float(ENV.get("RACE_EVAL_SECONDS", "20"))
STATE = ENV.get("RACE_STATE", "race-state")
WIDTH = 512

heartbeat = None
if ENV.get("FT_RANK_MONITOR_IPC_SOCKET"):
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient  # type: ignore[import-not-found]

    client = RankMonitorClient()
    client.init_workload_monitoring()
    heartbeat = client.send_heartbeat


class Samples(Dataset):
    """Sample i is step i's batch; the first of an epoch waits on storage."""

    def __len__(self) -> int:
        return STEPS + 1

    def __getitem__(self, i: int) -> torch.Tensor:
        if i % EPOCH == 1:
            time.sleep(DATA_SECONDS)
        return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(i))


def epoch_loader(first: int) -> DataLoader:
    """The batches from step `first` to the end of its epoch (a new epoch, a new worker)."""
    last = min(STEPS, (first - 1) // EPOCH * EPOCH + EPOCH)
    return DataLoader(Samples(), batch_size=None, sampler=range(first, last + 1), num_workers=1)


def evaluate(model: torch.nn.Module) -> float:
    model.eval()
    total, n, end, x = 0.0, 0, time.time() + EVAL_SECONDS, torch.randn(64, WIDTH)
    with torch.no_grad():
        while time.time() < end:
            total += float((model(x) - x).pow(2).mean())
            n += 1
    model.train()
    metric = torch.tensor([total / max(n, 1)])
    dist.all_reduce(metric)
    return float(metric)


def save(model: DistributedDataParallel, step: int) -> None:
    torch.save(model.module.state_dict(), os.path.join(ENV["FIELD_STORAGE"], f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), os.path.join(STATE, "model.tmp"))
        os.replace(os.path.join(STATE, "model.tmp"), os.path.join(STATE, "model.pt"))
        with open(os.path.join(STATE, "step.tmp"), "w") as f:
            json.dump({"step": step}, f)
        os.replace(os.path.join(STATE, "step.tmp"), os.path.join(STATE, "step.json"))


def resume(model: torch.nn.Module) -> int:
    try:
        with open(os.path.join(STATE, "step.json")) as f:
            step = json.load(f)["step"]
        model.load_state_dict(torch.load(os.path.join(STATE, "model.pt")))
        return step
    except FileNotFoundError:
        return 0


dist.init_process_group("gloo")
torch.manual_seed(0)
net = torch.nn.Linear(WIDTH, WIDTH)
start = resume(net) + 1
model = DistributedDataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
mon, chaos = Monitor(), Chaos()
step = start
while step <= STEPS:
    batches = iter(epoch_loader(step))
    for _ in range(len(batches)):
        if step % EPOCH == 1:
            chaos.record("pause", pause="data", step=step)
        x = next(batches)
        if step % EPOCH == 1:
            chaos.record("pause_end", pause="data", step=step)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.step(step, loss=float(loss), samples=8)
        if heartbeat is not None:
            heartbeat()
        chaos.step(step)
        if step in EVAL_AT:
            chaos.record("pause", pause="eval", step=step)
            evaluate(model)
            chaos.record("pause_end", pause="eval", step=step)
        if step in CKPT_AT:
            chaos.record("pause", pause="checkpoint", step=step)
            save(model, step)
            chaos.record("pause_end", pause="checkpoint", step=step)
        step += 1
chaos.done()
mon.close()
dist.destroy_process_group()
