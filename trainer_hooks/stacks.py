"""Python stack dumps on a signal, for the sidecar's watchdog.

At start the hooks register `faulthandler` on a signal (SIGUSR2 by default), writing to the
process's stderr, and name the signal in the register request. The sidecar creates the
rank's dump file itself (owned by the rank's user, mode 0600, in a directory only the sidecar
may write) and answers its path; the hooks open it and point faulthandler there (`adopt`).
When a rank hangs, the sidecar sends the signal and reads the file: faulthandler writes the
stack of the thread that takes the signal, from inside the signal handler, so it works even when
that thread is stuck in C (a NCCL collective, a dataloader queue). The kernel gives a signal sent
to a process to its main thread first (unless that thread blocks it or already has one pending),
so the dump is the main thread's: where the training loop hangs, and what the watchdog's looks
compare.

Only that thread: a dump of every thread (`all_threads=False`) walks the other threads' frames
while they run, and a rank whose second thread ran Python died of it (SIGSEGV) in 69 of 301
signals here (0 of 4000 with the current thread alone); the watchdog's busy-or-hung looks signal
a running rank several times a check. Every thread's stack comes from py-spy
(`remediation.py_spy`), which reads a paused process.

The handler is installed before the first registration, so the signal never finds the rank
without one (its default action would end the process); until the sidecar's answer
arrives, a dump goes to stderr (the worker's log).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import stat
import sys
from typing import IO, Any

log = logging.getLogger("trainer_hooks")

_OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class StackDump:
    """The dump signal and where faulthandler writes: stderr, then the sidecar's file."""

    def __init__(self, signum: int, initial: Any):
        self.signum = signum
        self.path: str | None = None  # the sidecar's file, once adopted
        self._file: IO[str] | None = None
        self._initial = initial  # what faulthandler writes to before adopt (kept referenced)

    def as_wire(self) -> dict:
        return {"signal": self.signum}

    def adopt(self, path: str) -> bool:
        """Point faulthandler at the file the sidecar created for this rank. It must be a
        regular file of this process's user (never a symlink, FIFO or device: opened
        non-blocking, checked with fstat). False, and dumps keep their old target, otherwise."""
        if path == self.path:
            return True
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as e:
            log.warning("trainer_hooks: cannot open the stack-dump file %s (%s)", path, e.strerror)
            return False
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            log.warning("trainer_hooks: %s is not a regular file of this user; stack dumps stay on stderr", path)
            return False
        file = os.fdopen(fd, "w")
        try:
            # changes: stack-signal (docs/changes-to-others.md)
            faulthandler.register(self.signum, file=file, all_threads=False, chain=False)
        except (ValueError, OSError, RuntimeError) as e:
            file.close()
            log.warning("trainer_hooks: cannot point stack dumps at %s (%s)", path, e)
            return False
        old, self._file, self.path = self._file, file, path
        if old is not None:
            old.close()  # faulthandler now holds the new file's descriptor
        return True

    def close(self) -> None:
        """Unregister first: faulthandler writes to the file's descriptor, which must not be
        closed (and reused) while the handler is installed. The file itself stays: it is the
        sidecar's, in a directory the rank cannot write."""
        try:
            faulthandler.unregister(self.signum)
        finally:
            if self._file is not None:
                self._file.close()
            if self._initial is not None and self._initial is not sys.__stderr__:
                self._initial.close()


def _stderr() -> Any:
    """The process's stderr as faulthandler needs it (a file with a working fileno), else
    /dev/null: a dump then is lost, but the signal never kills the rank."""
    err = sys.__stderr__
    try:
        if err is not None:
            err.fileno()
            return err
    except (OSError, ValueError, AttributeError):
        pass
    return open(os.devnull, "w")  # noqa: SIM115 - kept open while faulthandler uses it


def install(signum: int | None) -> StackDump | None:
    """Register the dump on `signum` (to stderr until `adopt`). None (no dump, nothing raised)
    when disabled, or when the application already handles that signal itself."""
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
    initial = _stderr()
    try:
        # changes: stack-signal (docs/changes-to-others.md)
        faulthandler.register(signum, file=initial, all_threads=False, chain=False)
    except (ValueError, OSError, RuntimeError) as e:
        if initial is not sys.__stderr__:
            initial.close()
        log.warning("trainer_hooks: no stack dumps: cannot register signal %s (%s)", signum, e)
        return None
    return StackDump(signum, initial)
