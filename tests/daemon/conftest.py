"""Fixtures for the daemon's tests: the real application served in-process on a real Unix
socket and a real TCP port, real processes standing in for ranks (helpers:
tests/daemon/helpers.py)."""

from __future__ import annotations

import subprocess

import pytest

from sidecar.daemon.app import build_app
from tests.daemon.helpers import DAEMON, Served
from tests.support import kill_tree, make_settings


@pytest.fixture
async def serve(tmp_path):
    """serve(**settings) -> Served; every server is closed at teardown."""
    servers: list[Served] = []

    async def start(**overrides) -> Served:
        settings = make_settings(tmp_path, DAEMON, **overrides)
        served = await Served(build_app(settings), settings.socket).start()
        servers.append(served)
        return served

    yield start
    for s in servers:
        await s.close()


@pytest.fixture
async def sidecar(serve) -> Served:
    return await serve()


@pytest.fixture
def child_pid(spawn) -> int:
    """A child of the test process: the test may register it over the Unix socket."""
    return spawn().pid


@pytest.fixture
def stranger_pid():
    """A process that is not a descendant of the test process (re-parented to init or a
    subreaper), so the test may not register it over the Unix socket."""
    out = subprocess.run(
        ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
        start_new_session=True,
    )
    pid = int(out.stdout.strip())
    yield pid
    kill_tree(pid)
