"""A cgroup v1 freezer cgroup for the tests of processes that cannot die.

A process in a frozen freezer cgroup handles no signal until it is thawed: a SIGKILL stays
pending (real kernel behaviour, the same as a rank stuck in a driver call). `frozen_cgroup()`
makes a fresh child cgroup of /sys/fs/cgroup/freezer and, whatever happens in the test, thaws
it, kills what is still in it and removes it.

    with frozen_cgroup() as cg:
        cg.add(pid)
        cg.freeze()
        ...
        cg.thaw()
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

FREEZER = Path("/sys/fs/cgroup/freezer")


def available() -> bool:
    """A cgroup v1 freezer hierarchy this process may create cgroups in."""
    return (FREEZER / "cgroup.procs").exists() and os.access(FREEZER, os.W_OK)


class Freezer:
    def __init__(self, path: Path):
        self.path = path

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def state(self) -> str:
        return (self.path / "freezer.state").read_text().strip()

    def freeze(self, timeout: float = 10.0) -> None:
        (self.path / "freezer.state").write_text("FROZEN\n")
        self._wait("FROZEN", timeout)

    def thaw(self, timeout: float = 10.0) -> None:
        (self.path / "freezer.state").write_text("THAWED\n")
        self._wait("THAWED", timeout)

    def _wait(self, state: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.state() != state:
            if time.monotonic() > deadline:
                raise TimeoutError(f"freezer {self.path} did not become {state} (it is {self.state()})")
            time.sleep(0.01)


@contextlib.contextmanager
def frozen_cgroup() -> Iterator[Freezer]:
    path = FREEZER / f"sidecar-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    cg = Freezer(path)
    try:
        yield cg
    finally:
        with contextlib.suppress(OSError, TimeoutError):
            cg.thaw()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                left = cg.pids()
            except OSError:
                break
            if not left:
                break
            for pid in left:  # only the test's own processes are ever put in it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        with contextlib.suppress(OSError):
            path.rmdir()
