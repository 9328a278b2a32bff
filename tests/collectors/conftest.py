"""Fixtures for the collector tests: the real pynvml over a fake NVML library configured per test,
GPU collectors that are always closed, and real processes standing in for ranks."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from sidecar.collectors import ranktree, xid
from sidecar.collectors.gpu import GpuCollector
from sidecar.testing import fake_nvml, fake_nvml_lib
from tests.collectors.helpers import FAKE
from tests.support import kill_tree


@pytest.fixture
def fake_gpus():
    """Boot a machine: `fake_gpus({"gpu_count": 8, ...})` (the spec of sidecar.testing.fake_nvml,
    plus "driver_generation" and "missing_functions") installs a fake libnvidia-ml under the real
    pynvml and returns it (its `calls` count the C calls). Uninstalled afterwards."""
    yield fake_nvml_lib.configure
    fake_nvml_lib.uninstall()
    fake_nvml.configure(None)


@pytest.fixture(autouse=True)
def quick_and_fresh(monkeypatch):
    """XID threads wait in short slices, so closing a GPU collector takes milliseconds; every
    process-tree lookup scans anew, so a child started just before is always seen."""
    monkeypatch.setattr(xid, "WAIT_MS", 50)
    monkeypatch.setattr(ranktree, "SNAPSHOT_MAX_AGE", 0.0)


@pytest.fixture
def gpu_collector():
    """A factory of GPU collectors over the stand-in; all are closed (XID threads stopped) after."""
    made: list[GpuCollector] = []

    def make(**kw) -> GpuCollector:
        kw.setdefault("xid_events", True)
        c = GpuCollector(FAKE, kw.pop("ranks", lambda: []), **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


RANK_SCRIPT = textwrap.dedent("""
    import signal, subprocess, sys, time
    ballast = bytearray(64 * 1024 * 1024)  # touched below, so it is resident
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    # The child says when its interpreter is up: before that its memory still grows, and a test
    # that compares a sample with a later reading would race it.
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print(flush=True); time.sleep(600)"], stdout=subprocess.PIPE
    )
    child.stdout.readline()

    def stop(*_):  # reap the child ourselves: an orphan waits long for this container's init
        child.terminate()
        child.wait()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    print(child.pid, flush=True)
    time.sleep(600)
""")


@pytest.fixture
def rank_process():
    """A real process standing in for a rank: 64 MiB resident and one child. Yields
    (proc, child_pid); the tree is killed afterwards."""
    procs = []

    def start() -> tuple[subprocess.Popen, int]:
        proc = subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        procs.append(proc)
        child_pid = int(proc.stdout.readline())
        return proc, child_pid

    yield start
    for p in procs:
        kill_tree(p)
