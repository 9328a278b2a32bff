"""A real sidecar and real rank processes (tests/exits/exit_rank.py) that die in chosen ways
(helpers: tests/exits/helpers.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from pathlib import Path

import pytest

from tests.exits.helpers import SETTINGS, Rank
from tests.support import Sidecar, kill_tree, wait_until


@pytest.fixture
def sidecar(tmp_path):
    with Sidecar(tmp_path, *SETTINGS) as s:
        yield s


@pytest.fixture
def ranks(tmp_path):
    started: list[Rank] = []

    def start(env: dict, mode: str, *args: str, name: str = "rank") -> Rank:
        r = Rank(tmp_path, env, mode, *args, name=name)
        started.append(r)
        return r

    yield start
    for r in started:
        r.close()


# ---------------------------------------------------------------- a small memory cgroup


def _own_memory_cgroup() -> tuple[int, Path] | None:
    with open("/proc/self/cgroup") as f:
        lines = f.read().splitlines()
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and Path("/sys/fs/cgroup/memory").is_dir():
            return 1, Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            return 2, Path("/sys/fs/cgroup") / path.lstrip("/")
    return None


@pytest.fixture
def small_memory_cgroup():
    """A fresh memory cgroup limited to 96 MiB (no swap): a process that moves in and allocates
    is killed by the kernel's OOM killer. Needs root and a writable memory hierarchy."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a memory cgroup")
    found = _own_memory_cgroup()
    if found is None:
        pytest.skip("no memory cgroup hierarchy")
    version, parent = found
    path = parent / f"exits-test-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
        limit = str(96 << 20)
        if version == 1:
            (path / "memory.limit_in_bytes").write_text(limit)
            with contextlib.suppress(OSError):
                (path / "memory.memsw.limit_in_bytes").write_text(limit)
        else:
            (path / "memory.max").write_text(limit)
            with contextlib.suppress(OSError):
                (path / "memory.swap.max").write_text("0")
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup under {parent}: {e}")
    yield path
    for pid in (path / "cgroup.procs").read_text().split():
        with contextlib.suppress(Exception):
            kill_tree(int(pid))
            os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(OSError):
        wait_until(lambda: not (path / "cgroup.procs").read_text().strip(), 10)
        path.rmdir()
