"""Registration on a kernel without pidfds (no SO_PEERPIDFD, no pidfd_open): the same checks
on pid numbers plus start times, documented in docs/security.md as the fallback."""

from __future__ import annotations

import signal

import pytest

from sidecar.daemon.api import DAEMON
from sidecar.host import identity
from sidecar.host.signals import send
from sidecar.watchdog.remediation import target_of
from tests.daemon.helpers import registration


@pytest.fixture
def no_pidfds(monkeypatch):
    monkeypatch.setattr(identity, "SO_PEERPIDFD", 0x7FFF)  # an option no kernel knows: ENOPROTOOPT
    monkeypatch.setattr(identity, "open_pidfd", lambda pid: None)


async def test_without_pidfds_a_rank_registers_and_is_signalled_by_pid_and_start_time(no_pidfds, sidecar, spawn):
    child = spawn()
    reply = await sidecar.post("/v1/register", registration(child.pid))
    assert reply.status == 200, reply.body
    rank = sidecar.app[DAEMON].registry.get("run-42", 0)
    assert rank.pidfd is None and rank.peer_verified and rank.pid_start_time is not None
    assert send(target_of(rank), signal.SIGKILL, "process") == [child.pid]
    assert child.wait(timeout=10) == -signal.SIGKILL


async def test_with_pidfds_the_rank_keeps_one_and_is_signalled_through_it(sidecar, spawn):
    child = spawn()
    assert (await sidecar.post("/v1/register", registration(child.pid))).status == 200
    rank = sidecar.app[DAEMON].registry.get("run-42", 0)
    assert isinstance(rank.pidfd, identity.PidFd) and rank.pidfd.alive() and rank.owner_uid == 0
    send(target_of(rank), signal.SIGKILL, "process")
    assert child.wait(timeout=10) == -signal.SIGKILL
    assert not rank.pidfd.alive()


async def test_without_pidfds_a_stranger_s_pid_is_still_refused(no_pidfds, sidecar, stranger_pid):
    reply = await sidecar.post("/v1/register", registration(stranger_pid))
    assert (reply.status, reply.code) == (403, "pid_mismatch")
