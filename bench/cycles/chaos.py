"""What the cycle scripts share: a hang on purpose and a record of when training runs.

Environment: CYCLE_LOG (a file; one JSON line per record, appended), CYCLE_HANGS (attempts that
hang: attempts 0..CYCLE_HANGS-1 do), CYCLE_HANG_STEP (the first step after which rank CYCLE_HANG_RANK
hangs, once it trained CYCLE_HANG_AFTER_SECONDS; or, with CYCLE_HANG_LOCAL_RANK set, that local rank
of each node whose agent has the variable), CYCLE_HANG_MODE (`stop`: the rank SIGSTOPs itself;
`sleep`: it sleeps forever; `deadlock`: its main thread and another take two locks in opposite
orders; `spin`: a Python busy loop; `kill`: it SIGKILLs itself; `work`: not a hang
but a pause, the rank computes in Python alone for CYCLE_WORK_SECONDS (default 10) while its peers
wait in their next collective, then trains on).

Each step takes CYCLE_STEP_SECONDS (default 0.05) more asleep, then CYCLE_STEP_CPU_SECONDS (default
0) computing on the CPU (a CPU quota slows that part; CYCLE_CPU_FIRST=1 puts the rank ahead of the
machine's other work, as tests.support.CPU_FIRST does, so that only a quota slows it). A straggler
instead of a hang: CYCLE_SLOW_LOCAL_RANK (that local rank of each node whose agent has the variable)
sleeps CYCLE_SLOW_SECONDS (default 0.1) more in every step from CYCLE_SLOW_STEP (default 1) on, before
its next collective: its peers wait for it there at every step, nothing hangs.

Records: {"kind": "first_step", "attempt": a, "rank": r, "time": t, "generation": g} at the first
step of every attempt (g: the attempt generation whose store namespace the rank's process group
formed in, trainer_hooks.distributed's restart remedy; None when the group formed without it),
{"kind": "hang", ...} just before the hang, {"kind": "slow", ...} at a straggler's first slow step,
{"kind": "done", ...} at the end.
The attempt is TORCHELASTIC_RESTART_COUNT (one node, so every rank agrees)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time


def cpu_first() -> None:
    """This process (a rank in a session of its own, as torchrun starts it) and its session's
    scheduling group at nice -10: ahead of the other work of a loaded machine (root only; else as is)."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("-10")
        os.nice(-10)
    except OSError:
        pass


class Chaos:
    def __init__(self) -> None:
        env = os.environ
        self.rank = int(env.get("RANK", "0"))
        self.attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.hangs = int(env.get("CYCLE_HANGS", "0"))
        self.hang_step = int(env.get("CYCLE_HANG_STEP", "8"))
        self.hang_rank = int(env.get("CYCLE_HANG_RANK", "1"))
        local = env.get("CYCLE_HANG_LOCAL_RANK")
        if local is not None:  # several nodes: the node's own agent says which of its ranks hangs
            self.hang_rank = self.rank if int(env.get("LOCAL_RANK", "0")) == int(local) else -1
        self.mode = env.get("CYCLE_HANG_MODE", "stop")
        self.path = env.get("CYCLE_LOG")
        self.step_seconds = float(env.get("CYCLE_STEP_SECONDS", "0.05"))
        self.step_cpu = float(env.get("CYCLE_STEP_CPU_SECONDS", "0"))
        if env.get("CYCLE_CPU_FIRST", "") not in ("", "0"):
            cpu_first()
        # a rank stopped before its hooks registered is unknown to the sidecar (left to torchrun,
        # which waits 30 s for a stopped process): hang only after this long of training
        self.hang_after = float(env.get("CYCLE_HANG_AFTER_SECONDS", "1.5"))
        self.first: float | None = None
        slow = env.get("CYCLE_SLOW_LOCAL_RANK")
        self.slow = slow is not None and int(env.get("LOCAL_RANK", "0")) == int(slow)
        self.slow_seconds = float(env.get("CYCLE_SLOW_SECONDS", "0.1"))
        self.slow_step = int(env.get("CYCLE_SLOW_STEP", "1"))

    def record(self, kind: str, **fields) -> None:
        if self.path:
            line = json.dumps({"kind": kind, "attempt": self.attempt, "rank": self.rank, "time": time.time(), **fields})
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)

    def step(self, step: int) -> None:
        """Call after each finished training step (it takes CYCLE_STEP_SECONDS more asleep, and
        CYCLE_STEP_CPU_SECONDS of the CPU's time, as a CPU-bound step would: a CPU quota slows it)."""
        time.sleep(self.step_seconds)
        if self.step_cpu:
            end = time.process_time() + self.step_cpu
            while time.process_time() < end:
                pass
        if self.slow and step >= self.slow_step:
            if step == self.slow_step:
                self.record("slow", step=step, seconds=self.slow_seconds)
            time.sleep(self.slow_seconds)
        if self.first is None:
            self.first = time.monotonic()
            self.record("first_step", step=step, generation=_generation())
        if (
            step >= self.hang_step
            and time.monotonic() - self.first >= self.hang_after
            and self.rank == self.hang_rank
            and self.attempt < self.hangs
        ):
            self.record("hang", step=step, pid=os.getpid())
            if self.mode == "work":
                self.hangs = 0  # once
                _work(float(os.environ.get("CYCLE_WORK_SECONDS", "10")))
                self.record("worked", step=step)
                return
            if self.mode == "kill":  # a crash instead of a hang: torchrun alone restarts the group
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if self.mode == "deadlock":
                _deadlock()
            while self.mode == "spin":  # holds the GIL's share of a core, steps never advance
                pass
            while True:
                time.sleep(3600)

    def done(self) -> None:
        self.record("done")


def _deadlock() -> None:
    """Two locks taken in opposite orders by two threads: the main thread blocks for good in
    `acquire` (no CPU, its stack still), the other thread too."""
    first, second = threading.Lock(), threading.Lock()
    first.acquire()
    taken = threading.Event()

    def other() -> None:
        second.acquire()
        taken.set()
        first.acquire()

    threading.Thread(target=other, name="deadlocked", daemon=True).start()
    taken.wait()
    second.acquire()


def _generation() -> int | None:
    """Read, never install: importing trainer_hooks would put the remedy into a script that lacks it."""
    remedy = sys.modules.get("trainer_hooks.distributed")
    return remedy.generation() if remedy is not None else None


def _work(seconds: float) -> int:
    """Work a rank does alone (preparing the next shard, an evaluation on rank 0): Python, in
    several functions of about equal time, its CPU time growing (its innermost frame moves among
    them, as a real pipeline's does; one line of C-heavy calls held 7 stack looks in a row on a
    loaded machine, which the busy check reads as a spin)."""
    end, total = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        words = _shard()
        total += _order(words) + _encode(words)
    return total


def _shard() -> list[str]:
    return [str(i * 7919 % 10007) for i in range(2000)]


def _order(words: list[str]) -> int:
    return len(sorted(words)) + sum(len(w) for w in words)


def _encode(words: list[str]) -> int:
    return len(json.dumps(words)) + len(",".join(reversed(words)))
