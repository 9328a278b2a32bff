"""The user's side of bench_field_pauses: a DDP training loop (gloo, CPU) that pauses as healthy
jobs pause and hangs as broken ones hang. It never imports trainer_hooks: the Monitor script
passes its own `on_step`, the zero-code script runs under `-m trainer_hooks.attach`.

Environment (bench/field/job.py sets it):
  FIELD_LOG            JSON lines, appended by every rank and by the bench
  FIELD_STATE          a file: the index of the next pause, kept across restarts
  FIELD_PAUSES         the schedule: pause kinds in order, comma-separated
  FIELD_PAUSE_SECONDS  how long each pause lasts
  FIELD_STEPS          training steps before each pause (and after the last)
  FIELD_HANGS          hang kinds: attempt i hangs with the i-th (the job then does not pause)
  FIELD_STORAGE        a directory of FIFOs `rank<N>.pt` that the bench drains slowly

Pauses, none declared to the sidecar (what the hooks infer, or not, is what is measured):
  eval         `model.eval()` and forward passes under `torch.no_grad()` on every rank, no step
  checkpoint   `torch.save` of the model on every rank to slow storage (a FIFO the bench drains at
               size / pause bytes a second: the write blocks in the kernel), then a barrier
  data_wait    a new epoch whose DataLoader worker waits on storage for its first item
  warmup       a long first step (computing before it, as a compile does); one due in the middle
               of a run ends the run, and the bench launches the job again (a resubmission)
  barrier      rank 0 alone prepares the next data shard (Python) while the others wait in a barrier
  cpu_starved  the bench puts the last rank in a cpu cgroup with a 0.1% quota (live, crawling)
  dstate       the bench freezes the last rank (freezer cgroup: uninterruptible sleep, D), then thaws it
Hangs, of the last rank: sigstop (it stops itself), deadlock (two threads take two locks in
opposite orders), busy (a Python loop), collective (it waits in an all-reduce and the bench
SIGSTOPs it there; its peer joins that all-reduce and waits for it).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

ENV = os.environ
STEP_SECONDS = 0.05  # a step sleeps this long: two ranks and the sidecar share two cores
WIDTH = 1024  # the model: one 1024 x 1024 layer, a 4 MiB checkpoint
ENVIRONMENT_PAUSES = ("cpu_starved", "dstate")  # the bench makes them: it records their start and end


def record(kind: str, **fields) -> None:
    path = ENV.get("FIELD_LOG")
    if not path:
        return
    line = json.dumps({
        "kind": kind, "time": time.time(), "rank": int(ENV.get("RANK", "0")),
        "attempt": int(ENV.get("TORCHELASTIC_RESTART_COUNT", "0")), **fields,
    })  # fmt: skip
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def compile_like(seconds: float) -> None:
    """Compute for `seconds`, as a first step's compilation and warm-up does."""
    end, a = time.time() + seconds, torch.randn(256, 256)
    while time.time() < end:
        a = torch.tanh(a @ a)


WORDS = [f"w{i}" for i in range(5000)]


def tokenize(text: str) -> list[int]:
    return [hash(word) % 50_000 for word in text.split()]


def prepare_shard(seconds: float) -> int:
    """Work rank 0 does alone for `seconds`: it tokenizes and packs the next data shard."""
    end, rng, packed = time.time() + seconds, random.Random(0), 0
    while time.time() < end:
        text = " ".join(rng.choices(WORDS, k=512))
        packed += int(torch.tensor(tokenize(text)).sum()) & 1
    return packed


def next_pause() -> int:
    """The index of the next pause of the schedule (kept across restarts and launches)."""
    try:
        with open(ENV["FIELD_STATE"]) as f:
            return int(f.read().strip() or 0)
    except (KeyError, OSError, ValueError):
        return 0


def set_next_pause(index: int) -> None:
    if "FIELD_STATE" in ENV:
        with open(ENV["FIELD_STATE"], "w") as f:
            f.write(str(index))


class EvalPauses:
    """A framework's own evaluations as the schedule's `eval` pauses: while pauses remain, each
    evaluation computes for the pause's length (spread over its batches); a restarted run skips the
    pauses done, and evaluations past the schedule are quick. Call begin, batch (per batch), end."""

    def __init__(self, batches: int) -> None:
        self.pauses = len([p for p in ENV.get("FIELD_PAUSES", "").split(",") if p == "eval"])
        self.seconds, self.batches = float(ENV.get("FIELD_PAUSE_SECONDS", "8")), batches
        self.rank0 = ENV.get("RANK", "0") == "0"
        self.done, self.active = next_pause(), False  # read before any rank of this run writes it

    def begin(self) -> None:
        if self.active or self.done >= self.pauses:
            return
        self.active = True
        if self.rank0:
            set_next_pause(self.done + 1)
            record("pause", pause="eval", index=self.done, seconds=self.seconds)

    def batch(self) -> None:
        if self.active:
            compile_like(self.seconds / self.batches)

    def end(self) -> None:
        if self.active:
            if self.rank0:
                record("pause_end", pause="eval", index=self.done)
            self.done, self.active = self.done + 1, False


class Storage(Dataset):
    """Random samples; the first of an epoch waits `stall` seconds for its storage."""

    def __init__(self) -> None:
        self.stall = 0.0

    def __len__(self) -> int:
        return 1 << 20  # an epoch never ends by itself: a new one starts at a data_wait pause

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 0 and self.stall:
            time.sleep(self.stall)
        return torch.randn(WIDTH, generator=torch.Generator().manual_seed(i))


class Job:
    def __init__(self, on_step: Callable[[int, float], None] | None = None) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.last = self.rank == self.world - 1
        self.attempt = int(ENV.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.on_step = on_step or (lambda step, loss: None)
        self.seconds = float(ENV.get("FIELD_PAUSE_SECONDS", "8"))
        self.steps = int(ENV.get("FIELD_STEPS", "30"))
        torch.manual_seed(0)
        self.model = DistributedDataParallel(torch.nn.Linear(WIDTH, WIDTH))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.data = Storage()
        self.loader = DataLoader(self.data, batch_size=4, num_workers=1)
        self.batches = iter(self.loader)
        self.pending: torch.Tensor | None = None
        self.step_no = 0

    # ------------------------------------------------------------ training

    def step(self) -> None:
        x = self.pending if self.pending is not None else next(self.batches)
        self.pending = None
        loss = (self.model(x) - x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.step_no += 1
        if self.step_no == 1:
            record("first_step")
        self.on_step(self.step_no, loss.item())
        time.sleep(STEP_SECONDS)

    def train(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def run(self) -> None:
        hangs = [h for h in ENV.get("FIELD_HANGS", "").split(",") if h]
        if hangs:
            self.train(self.steps)
            if self.attempt < len(hangs):
                self.hang(hangs[self.attempt])
        else:
            schedule = [p for p in ENV.get("FIELD_PAUSES", "").split(",") if p]
            index = next_pause()
            while index < len(schedule):
                if schedule[index] == "warmup" and self.step_no:
                    if self.rank == 0:  # the job ends; the bench launches it again, first step long
                        record("relaunch_for_warmup", index=index)
                    break
                if schedule[index] != "warmup":
                    self.train(self.steps)
                self.pause(index, schedule[index])
                index += 1
            self.train(self.steps)
        record("done")

    # ------------------------------------------------------------ pauses

    def pause(self, index: int, kind: str) -> None:
        mine = self.rank == 0 and kind not in ENVIRONMENT_PAUSES
        if self.rank == 0:  # a pause cut short by a kill is not done again
            set_next_pause(index + 1)
        if mine:
            record("pause", pause=kind, index=index, seconds=self.seconds)
        getattr(self, f"_{kind}")(index)
        if mine:
            record("pause_end", pause=kind, index=index)

    def _eval(self, index: int) -> None:
        self.model.eval()
        end, x = time.time() + self.seconds, torch.randn(64, WIDTH)
        with torch.no_grad():
            while time.time() < end:
                self.model(x)
        self.model.train()
        dist.all_reduce(torch.ones(1))  # the evaluation's metric

    def _checkpoint(self, index: int) -> None:
        folder = ENV.get("FIELD_STORAGE") or ENV.get("TMPDIR", "/tmp")
        torch.save(self.model.module.state_dict(), os.path.join(folder, f"rank{self.rank}.pt"))
        dist.barrier()

    def _data_wait(self, index: int) -> None:
        self.data.stall = self.seconds
        self.batches = iter(self.loader)  # a new epoch: its worker starts now, with the stall
        self.data.stall = 0.0
        self.pending = next(self.batches)

    def _warmup(self, index: int) -> None:
        compile_like(self.seconds)
        self.step()

    def _barrier(self, index: int) -> None:
        if self.rank == 0:
            prepare_shard(self.seconds)
        dist.barrier()

    def _environment(self, index: int, kind: str) -> None:
        """The bench throttles or freezes the last rank for the pause; every rank trains on (in
        step: one all-reduce decides when the pause is over, on the clock of the slowest)."""
        if self.last:
            record("pause_request", pause=kind, index=index, seconds=self.seconds, pid=os.getpid())
        end = time.time() + self.seconds + 1.0
        while True:
            go = torch.tensor([1 if time.time() < end else 0])
            dist.all_reduce(go, op=dist.ReduceOp.MIN)
            if not go.item():
                return
            self.step()

    def _cpu_starved(self, index: int) -> None:
        self._environment(index, "cpu_starved")

    def _dstate(self, index: int) -> None:
        self._environment(index, "dstate")

    # ------------------------------------------------------------ hangs

    def hang(self, kind: str) -> None:
        if kind == "collective":
            if self.last:
                record("hang_request", hang=kind, pid=os.getpid())  # the bench stops it inside
            else:
                time.sleep(1.0)  # the last rank is inside the all-reduce (and stopped) first
            dist.all_reduce(torch.ones(1))
        if not self.last:
            while True:  # its next all-reduce waits for the hung rank
                self.step()
        record("hang", hang=kind)
        if kind == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "deadlock":
            a, b = threading.Lock(), threading.Lock()

            def other() -> None:
                with b:
                    time.sleep(0.2)
                    a.acquire()

            a.acquire()
            threading.Thread(target=other, daemon=True).start()
            time.sleep(0.1)
            b.acquire()
        elif kind == "busy":
            x = 0
            while True:
                x += 1
        while True:
            time.sleep(3600)
