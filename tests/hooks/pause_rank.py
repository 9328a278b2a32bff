"""A rank that trains a tiny model with a plain `Monitor` (a step every 50 ms) and pauses once the
way healthy jobs do, declaring nothing (tests/hooks/test_pauses.py):

    python -m tests.hooks.pause_rank --job JOB --log LOG --pause eval|data|save|hang [--seconds S]

- eval: `model.eval()`, S seconds of `torch.no_grad()` forward passes over a DataLoader, no step,
  then `model.train()`;
- data: the next batch takes S seconds (the Dataset's `__getitem__` sleeps; num_workers=0);
- save: `torch.save` of the model to a file object whose first write takes S seconds;
- hang: S seconds of `time.sleep` in the training loop, the model in train mode.

20 steps before the pause and 20 after. LOG gets one line per moment: `<what> <time.time()>`
(`step N`, `pause_start`, `pause_end`, `done`).
"""

from __future__ import annotations

import argparse
import io
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from trainer_hooks import Monitor

STEP_SECONDS = 0.05


class SlowItems(Dataset):
    """Item `slow` takes `seconds`; the others are at once."""

    def __init__(self, n: int, slow: int, seconds: float):
        self.data, self.slow, self.seconds = torch.randn(n, 4), slow, seconds

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.slow:
            time.sleep(self.seconds)
        return self.data[i]


class SlowFile(io.BytesIO):
    """A file whose first write takes `seconds` (a slow filesystem)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def write(self, b) -> int:
        if self.seconds:
            time.sleep(self.seconds)
            self.seconds = 0.0
        return super().write(b)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--pause", choices=["eval", "data", "save", "hang"], required=True)
    p.add_argument("--seconds", type=float, default=8.0)
    args = p.parse_args(argv)
    log = open(args.log, "a", buffering=1)

    def note(what: str) -> None:
        log.write(f"{what} {time.time():.4f}\n")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(job_id=args.job, rank=0, local_rank=0, world_size=1, local_world_size=1)
    batches = iter(DataLoader(SlowItems(100, 20 if args.pause == "data" else -1, args.seconds), batch_size=1))
    step = 0

    def train(n: int) -> None:
        nonlocal step
        for _ in range(n):
            x = next(batches)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(STEP_SECONDS)
            step += 1
            mon.step(step, loss=loss.detach())
            note(f"step{step}")

    train(20)
    note("pause_start")
    if args.pause == "eval":
        model.eval()
        deadline = time.monotonic() + args.seconds
        with torch.no_grad():
            while time.monotonic() < deadline:
                for (x,) in DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4):
                    model(x)
                    time.sleep(0.1)
        model.train()
    elif args.pause == "save":
        torch.save(model.state_dict(), SlowFile(args.seconds))
    elif args.pause == "hang":
        time.sleep(args.seconds)
    note("pause_end")  # data: the pause is inside the next step's batch
    train(20)
    mon.close()
    note("done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
