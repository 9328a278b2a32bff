"""A lane of background work: one daemon thread running one job at a time, in order.

The training thread hands a job over with `submit` and continues; `wait` blocks until the lane
is idle and raises what the last job raised, so a failure surfaces on the training thread at a
point of its choosing. A daemon thread, so a job stuck in I/O or in a collective with a dead
peer never holds up the process's exit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Lane:
    def __init__(self, name: str) -> None:
        self._cv = threading.Condition()
        self._job: Callable[[], object] | None = None
        self._busy = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._busy

    def submit(self, job: Callable[[], object]) -> None:
        """Run `job` once the previous one is done (waits for it; raises its error first)."""
        self.wait()
        with self._cv:
            self._job, self._busy = job, True
            self._cv.notify_all()

    def wait(self, timeout: float | None = None) -> float:
        """Block until the lane is idle (TimeoutError after `timeout` seconds, if given); returns the
        seconds waited. Raises the last job's error once."""
        started = time.monotonic()
        with self._cv:
            if not self._cv.wait_for(lambda: not self._busy, timeout):
                raise TimeoutError(f"{self._thread.name}: still busy after {timeout:g}s")
            error, self._error = self._error, None
        if error is not None:
            raise error
        return time.monotonic() - started

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._job is None:
                    self._cv.wait()
                job, self._job = self._job, None
            try:
                job()
            except BaseException as e:  # handed to the training thread by wait()
                with self._cv:
                    self._error = e
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
