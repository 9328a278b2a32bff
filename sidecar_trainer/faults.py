"""Fault injection for watchdog tests and demos: one rank misbehaves at one step in a chosen way.

The hooks sit where real faults happen: a dead or frozen process at the start of a step, a hang
inside the step before its gradient all-reduce (the other ranks then wait in the collective, as
they do behind a real straggler), a data fetch that never returns, a crash half-way through
writing a checkpoint. Configured by the `faults` section (see sidecar_trainer/config.py).

Faults asked for while the job runs (deadlock, spin, a pause on every rank), through
`faults.request_file`, are sidecar_trainer/fault_requests.py's.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from sidecar_trainer.config import FaultConfig
from sidecar_trainer.fault_requests import RequestWatch, spin

log = logging.getLogger("sidecar_trainer")


class FaultInjector:
    def __init__(self, cfg: FaultConfig, rank: int, restart_count: int, generation: int = 1) -> None:
        self.cfg = cfg
        # A node whose workers hung rather than failed restarts them without counting a restart,
        # so its TORCHELASTIC_RESTART_COUNT may still be 0: the job-wide generation settles it.
        first_attempt = restart_count == 0 and generation == 1
        self.armed = cfg.kind != "none" and rank == cfg.rank and (first_attempt or not cfg.only_first_attempt)
        self.rank = rank
        self.requests = RequestWatch(cfg.request_file, rank) if cfg.request_file else None

    def _fires(self, kind: str, step: int) -> bool:
        if self.armed and self.cfg.kind == kind and step == self.cfg.at_step:
            log.warning("fault injection: %s on rank %d at step %d (pid %d)", kind, self.rank, step, os.getpid())
            return True
        return False

    def step_start(self, step: int) -> None:
        if self.requests is not None:
            self.requests.step_start(step)
        if self._fires("sigkill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fires("sigstop", step):
            os.kill(os.getpid(), signal.SIGSTOP)

    def before_allreduce(self, step: int) -> None:
        """Inside the step, after the forward pass, before backward starts DDP's all-reduce."""
        if self._fires("cuda_oom", step):
            import torch

            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                "1.02 GiB is free. (fault injection)"
            )
        if self._fires("loop", step):
            spin()
        if self._fires("sleep", step):
            time.sleep(self.cfg.sleep_seconds)

    def poison(self, step: int, loss):
        """The step's loss, NaN on the faulty rank at at_step (kind `nan_loss`)."""
        if self._fires("nan_loss", step):
            return loss * float("nan")
        return loss

    def fetch(self, step: int, next_step: Callable):
        """Fetch step `step`'s batches through `next_step`, or never return."""
        if self._fires("dataloader", step):
            _dataloader_never_returns()
        return next_step()

    def checkpoint_interrupt(self, step: int) -> Callable[[], None] | None:
        """A callable that SIGKILLs this rank half-way through writing its file of checkpoint `step`."""
        if self.armed and self.cfg.kind == "sigkill_in_checkpoint" and step >= self.cfg.at_step:

            def die() -> None:
                log.warning(
                    "fault injection: sigkill_in_checkpoint on rank %d while writing step %d (pid %d)",
                    self.rank,
                    step,
                    os.getpid(),
                )
                os.kill(os.getpid(), signal.SIGKILL)

            return die
        return None

    def checkpoint_delay(self) -> None:
        if self.cfg.checkpoint_delay_seconds:
            time.sleep(self.cfg.checkpoint_delay_seconds)


def _dataloader_never_returns() -> None:
    threading.Event().wait()
