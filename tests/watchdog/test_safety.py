"""The safety rules, checked right before every signal: only the registered process (pid plus
start time), never pid 1, the sidecar or its ancestors."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from sidecar.host import procs
from sidecar.host.signals import Refused, Target, refusal, send


def target(pid: int, start_time: float | None, verified: bool = True) -> Target:
    return Target("job", 0, pid, start_time, verified=verified)


def test_a_reused_pid_is_never_signalled(spawn):
    """A process with the registered pid but another start time is someone else."""
    p = spawn()
    started = procs.start_time(p.pid)
    with pytest.raises(Refused, match="no longer the process that registered"):
        send(target(p.pid, started - 5.0), signal.SIGTERM)
    assert psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE
    assert p.poll() is None


def test_pid_1_is_never_signalled():
    assert "never signalled" in refusal(target(1, procs.start_time(1) or 0.0))
    with pytest.raises(Refused):
        send(target(1, procs.start_time(1)), signal.SIGCONT)


def test_the_sidecar_itself_is_never_signalled():
    with pytest.raises(Refused, match="sidecar or one of its ancestors"):
        send(target(os.getpid(), procs.start_time(os.getpid())), signal.SIGTERM)


def test_the_sidecar_s_ancestors_are_never_signalled():
    for pid in procs.ancestors(os.getpid()):
        if pid > 1:
            assert "ancestors" in refusal(target(pid, procs.start_time(pid)))


def test_a_process_without_recorded_start_time_is_never_signalled(spawn):
    p = spawn()
    with pytest.raises(Refused, match="no recorded start time"):
        send(target(p.pid, None), signal.SIGTERM)
    assert p.poll() is None


def test_an_exited_process_is_never_signalled(spawn):
    p = spawn()
    started = procs.start_time(p.pid)
    p.kill()
    p.wait()
    assert refusal(target(p.pid, started)) is not None


def test_a_rank_registered_by_an_unverified_client_is_never_signalled(spawn):
    """A client that could claim any pid must not be able to get a process killed."""
    p = spawn()
    with pytest.raises(Refused, match="could not be verified"):
        send(target(p.pid, procs.start_time(p.pid), verified=False), signal.SIGTERM)
    assert p.poll() is None


def test_a_registered_group_leader_is_signalled_as_a_group(spawn):
    """torchrun starts each worker in its own session: the worker and what it started go together."""
    leader = spawn(["bash", "-c", "sleep 600 & sleep 600 & wait"])
    children = _wait_children(leader.pid, 2)
    sent = send(target(leader.pid, procs.start_time(leader.pid)), signal.SIGKILL)
    assert sent == [-leader.pid]
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive
    leader.wait(timeout=10)


def test_a_rank_that_does_not_lead_its_group_is_signalled_with_its_descendants_only(spawn):
    """A rank inside someone else's group (here, a shell's): the group is not ours to kill."""
    shell = spawn(["bash", "-c", "bash -c 'sleep 600 & wait' & wait"])
    (rank,) = _wait_children(shell.pid, 1, recursive=False)
    (grandchild,) = _wait_children(rank.pid, 1)
    sent = send(target(rank.pid, procs.start_time(rank.pid)), signal.SIGKILL)
    assert set(sent) == {rank.pid, grandchild.pid}
    psutil.wait_procs([grandchild], timeout=10)
    assert shell.wait(timeout=10) == 0, "the shell leading the group was not signalled"


def _wait_children(pid: int, n: int, recursive: bool = True) -> list[psutil.Process]:
    from tests.support import wait_until

    return wait_until(
        lambda: (lambda c: c if len(c) >= n else None)(psutil.Process(pid).children(recursive=recursive)),
        10,
        what=f"{n} children of {pid}",
    )
