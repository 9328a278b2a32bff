"""Where a (re)start's time goes: the trainer's start-up milestones, timestamped.

A restarted rank's way from its launch to its first training step, in the order it happens:

  process_started        the kernel started the process (read from /proc: before Python runs)
  imports_done           the interpreter, torch and the trainer are imported (field cpu_s: the
                         process's CPU seconds so far; a worker forked warm has spent almost none)
  process_group_formed   the rendezvous is done: every rank of the attempt is connected
  model_built            model, optimizer and dataset exist (torch.optim imports torch._dynamo here)
  checkpoint_loaded      the state to resume from is in place (fields: step, source memory|disk)
  first_step             the first optimizer step of this attempt finished

Rank 0 logs each as one line, `startup: <name> t=<unix seconds> ...` (the benchmarks read them),
and every rank sends them to the sidecar as events with the same names (the rank's own
`time` of the event is when it happened), except `process_started` and `imports_done`, which
happen before the hooks can send anything and ride as fields of `process_group_formed`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

log = logging.getLogger("sidecar_trainer")

MILESTONES = (
    "process_started",
    "imports_done",
    "process_group_formed",
    "model_built",
    "checkpoint_loaded",
    "first_step",
)


def process_start_time(proc: str = "/proc") -> float | None:
    """Unix time at which the kernel started this process (about 10 ms resolution), or None
    where /proc does not say. Measured as an age, from /proc/self/stat's start time against
    /proc/uptime, because /proc/stat's boot time is whole seconds."""
    try:
        with open(f"{proc}/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"{proc}/uptime") as f:
            uptime = float(f.read().split()[0])
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - max(0.0, uptime - started_after_boot)


class Startup:
    """The milestones of this process, logged by rank 0 and sent as events by every rank."""

    def __init__(self, is_main: bool) -> None:
        self.is_main = is_main
        self.times: dict[str, float] = {}
        started = process_start_time()
        if started is not None:
            self.mark("process_started", at=started)

    def mark(self, name: str, monitor: Any = None, at: float | None = None, **fields: Any) -> float:
        """Record milestone `name` (now, or `at`), log it on rank 0 and send it through `monitor`."""
        when = time.time() if at is None else at
        self.times.setdefault(name, when)
        if self.is_main:
            extra = "".join(f" {k}={v}" for k, v in fields.items())
            log.info("startup: %s t=%.3f%s", name, when, extra)
        if monitor is not None:
            monitor.event(name, **fields)
        return when

    def summary(self) -> str:
        """`imports 1.82s, process group 0.21s, ...`: the seconds between consecutive milestones."""
        marked = [(name, self.times[name]) for name in MILESTONES if name in self.times]
        pairs = zip(marked, marked[1:], strict=False)
        return ", ".join(f"{name.replace('_', ' ')} +{t - prev:.2f}s" for (_, prev), (name, t) in pairs)
