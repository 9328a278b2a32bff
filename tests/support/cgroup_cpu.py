"""A real cgroup v1 CPU quota for a test's process (`/sys/fs/cgroup/cpu`, mounted on this machine;
root only): what slows a straggler in the CPU-throttling tests."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

CPU_V1 = Path("/sys/fs/cgroup/cpu")


def unavailable() -> str | None:
    """Why no quota can be set here, or None."""
    if not (CPU_V1 / "cgroup.procs").exists():
        return f"no cgroup v1 cpu hierarchy at {CPU_V1}"
    if not os.access(CPU_V1, os.W_OK):
        return f"{CPU_V1} is not writable (run as root)"
    return None


@contextlib.contextmanager
def cpu_quota(pid: int, quota_us: int | None, name: str = "test") -> Iterator[Path]:
    """`pid` in a fresh cpu cgroup with `quota_us` of CPU per 100 ms (None: no quota); moved back to
    the root group and the group removed after."""
    group = CPU_V1 / f"{name}-{os.getpid()}-{quota_us}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        if quota_us is not None:
            (group / "cpu.cfs_quota_us").write_text(str(quota_us))
        (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        with contextlib.suppress(OSError):
            (CPU_V1 / "cgroup.procs").write_text(str(pid))
        for _ in range(100):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.05)
