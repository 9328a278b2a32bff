"""Python stack dumps on a signal, for the sidecar's watchdog.

At start the hooks register `faulthandler` on a signal (SIGUSR2 by default) with a per-rank
file, and tell the sidecar both in the register request. When a rank hangs, the sidecar
sends the signal and reads the file: faulthandler writes every thread's stack from inside
the signal handler, so it works even when the Python thread holding the GIL is stuck in C
(a NCCL collective, a dataloader queue).
"""
from __future__ import annotations

import faulthandler
import logging
import os
import re
import signal
from dataclasses import dataclass
from typing import IO

log = logging.getLogger("trainer_hooks")


@dataclass
class StackDump:
    signum: int
    path: str
    file: IO[str]

    def as_wire(self) -> dict:
        return {"signal": self.signum, "path": self.path}

    def close(self) -> None:
        """Unregister first: faulthandler writes to the file's descriptor, which must not be
        closed (and reused) while the handler is installed."""
        try:
            faulthandler.unregister(self.signum)
        finally:
            self.file.close()
        try:  # no dump was ever asked for: leave no empty file behind
            if os.path.getsize(self.path) == 0:
                os.unlink(self.path)
        except OSError:
            pass


def _safe_component(text: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", text)[:128]
    return cleaned if cleaned.strip(".") else "_"


def stacks_path(diag_dir: str, job_id: str, rank: int, pid: int) -> str:
    return os.path.join(diag_dir, _safe_component(job_id), f"rank{rank}-pid{pid}.stacks")


def install(diag_dir: str, job_id: str, rank: int, signum: int | None) -> StackDump | None:
    """Register the dump on `signum` writing to `<diag_dir>/<job_id>/rank<R>-pid<PID>.stacks`.
    None (no dump, nothing raised) when disabled, when the application already handles that
    signal itself, or when the file cannot be created."""
    if signum is None:
        return None
    try:
        current = signal.getsignal(signum)
    except (ValueError, OSError) as e:
        log.warning("trainer_hooks: no stack dumps: bad signal %s (%s)", signum, e)
        return None
    if current not in (signal.SIG_DFL, None):
        log.warning("trainer_hooks: no stack dumps: signal %s already has a handler", signum)
        return None
    path = stacks_path(diag_dir, job_id, rank, os.getpid())
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        file = open(path, "w")
    except OSError as e:
        log.warning("trainer_hooks: no stack dumps: cannot create %s (%s)", path, e.strerror)
        return None
    try:
        faulthandler.register(signum, file=file, all_threads=True, chain=False)
    except (ValueError, OSError, RuntimeError) as e:
        file.close()
        log.warning("trainer_hooks: no stack dumps: cannot register signal %s (%s)", signum, e)
        return None
    return StackDump(signum, path, file)
