"""Fixtures every test area may use."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile

import pytest

from tests.support import kill_tree


@pytest.fixture
def spawn():
    """Start real processes (standing in for ranks) in their own session, as torchrun starts
    workers; all killed, with their children, at teardown."""
    started: list[subprocess.Popen] = []

    def start(cmd: list[str] | None = None) -> subprocess.Popen:
        p = subprocess.Popen(cmd or ["sleep", "600"], start_new_session=True)
        started.append(p)
        return p

    yield start
    for p in started:
        kill_tree(p)


# Free ports per test worker: a port picked by binding port 0 and bound a moment later by the
# process under test was once taken meanwhile by another worker's sidecar (torchrun's rendezvous
# store then pinged an HTTP server). Each worker takes its ports in turn from its own slice of
# 20000-32000, below Linux's ephemeral range (32768-60999), which port-0 binds and outgoing
# connections use (harness.processes.free_port, DEMO_PORTS).
PORTS = (20000, 32000)


def pytest_configure(config: pytest.Config) -> None:
    from tests.support.cpu_account import register

    register(config)
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        warm_agents()  # a process that runs tests: an xdist worker, or pytest without -n (xdist's controller runs none)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and worker[2:].isdigit() and "DEMO_PORTS" not in os.environ:
        width = (PORTS[1] - PORTS[0]) // max(count, 1)
        low = PORTS[0] + int(worker[2:]) * width
        os.environ["DEMO_PORTS"] = f"{low}-{low + width}"


def warm_agents() -> None:
    """torchrun agents and sidecars forked from servers that imported torch or the daemon once
    (harness/zygote.py): about 1.5-2 CPU-s less per agent (over a hundred in the suite) and 0.3 per
    sidecar (hundreds). Each test process has its own servers, each started on its first request;
    `SIDECAR_TEST_COLD_AGENTS=1` starts every one of them as a new interpreter."""
    from harness import zygote

    if os.environ.get("SIDECAR_TEST_COLD_AGENTS", "") not in ("", "0"):
        return
    directory = tempfile.mkdtemp(prefix="sidecar-agents-")
    os.environ[zygote.ENV] = directory
    os.environ[zygote.OWNER_ENV] = zygote.owner()
    atexit.register(_end_warm_agents, directory)


def _end_warm_agents(directory: str) -> None:
    from harness import zygote

    zygote.stop()
    shutil.rmtree(directory, ignore_errors=True)
