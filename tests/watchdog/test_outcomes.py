"""What remediation reports is what happened, and nothing of the group outlives it: a rank that
exits promptly on SIGTERM is "killed" (it used to be "failed": the SIGCONT that follows the
SIGTERM found it gone), every member of a group still alive after the grace gets SIGKILL (it
used to go only to ranks), both through pidfds and on the pid-number fallback. And a restarted
sidecar judges a rank inside a declared phase by that phase's own budget."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from sidecar.host import identity, procs
from sidecar.ranks.protocol import Registration
from sidecar.ranks.registry import Registry
from sidecar.watchdog.machine import Watchdog
from sidecar.watchdog.stormcap import OwnerStormCaps
from tests.support import make_settings, wait_until
from tests.watchdog.helpers import WATCHDOG, FakeClock
from tests.watchdog.test_remediation import events, finish, stall

# A rank that leads its group, started a worker that ignores SIGTERM, and itself dies on it.
GROUP_WITH_STUBBORN_WORKER = r"""
import signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE, text=True)
worker.stdout.readline()
print(worker.pid, flush=True)
time.sleep(600)
"""


def register(registry: Registry, pid: int, with_pidfd: bool, job: str = "job"):
    reg = Registration(job_id=job, rank=0, local_rank=0, world_size=1, local_world_size=1, pid=pid)
    return registry.register(
        reg,
        pid_start_time=procs.start_time(pid),
        peer_verified=True,
        pidfd=identity.open_pidfd(pid) if with_pidfd else None,
        owner_uid=0,
    )


@pytest.mark.asyncio
@pytest.mark.parametrize("with_pidfd", [True, False], ids=["pidfd", "pid-numbers"])
async def test_every_group_member_alive_after_the_grace_gets_sigkill(tmp_path, clock, spawn, with_pidfd):
    s = make_settings(tmp_path, WATCHDOG, **{"remediation.grace_seconds": 0.5})
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=clock)
    rank = subprocess.Popen(
        [sys.executable, "-c", GROUP_WITH_STUBBORN_WORKER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        worker = psutil.Process(int(rank.stdout.readline()))
        r = register(registry, rank.pid, with_pidfd)
        await stall(dog, registry, clock, [r])
        await finish(dog)
        assert rank.wait(timeout=10) == -signal.SIGTERM, "the rank itself died on SIGTERM"
        wait_until(
            lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE,
            10,
            what="the worker that ignored SIGTERM killed",
        )
        record = json.loads(Path(dog.incidents()[0]["path"]).read_text())
        assert events(record)[-3:] == ["sigterm", "sigkill", "exit_observed"], events(record)
        assert record["outcome"] == "killed"
    finally:
        rank.kill()
        rank.wait()
        try:
            worker.kill()
        except (psutil.Error, NameError):
            pass


# A launcher that reaps its rank the moment it dies, as torchrun's agent does.
REAPING_PARENT = r"""
import subprocess, sys
rank = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
                        stdout=subprocess.PIPE, text=True)
rank.stdout.readline()
print(rank.pid, flush=True)
rank.wait()
import time; time.sleep(600)
"""


@pytest.mark.asyncio
@pytest.mark.parametrize("with_pidfd", [True, False], ids=["pidfd", "pid-numbers"])
async def test_a_rank_that_exits_promptly_on_sigterm_is_killed_not_failed(tmp_path, clock, spawn, with_pidfd):
    s = make_settings(tmp_path, WATCHDOG)
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=clock)
    parent = subprocess.Popen(
        [sys.executable, "-c", REAPING_PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        rank_pid = int(parent.stdout.readline())
        r = register(registry, rank_pid, with_pidfd)
        await stall(dog, registry, clock, [r])
        await finish(dog)
        record = json.loads(Path(dog.incidents()[0]["path"]).read_text())
        assert record["outcome"] == "killed", record
        assert "sigkill" not in events(record) and events(record)[-1] == "exit_observed"
        assert dog.counters.remediations[("job", "killed")] == 1
    finally:
        parent.kill()
        parent.wait()


def test_the_storm_cap_is_per_owner_under_a_node_ceiling():
    clock = FakeClock()
    caps = OwnerStormCaps(per_owner=2, node=3, window=60, clock=clock)
    assert caps.allow(1000) is None and caps.allow(1000) is None
    assert "uid 1000" in caps.allow(1000)  # the user's own budget is spent
    assert caps.allow(0) is None, "another owner (root) still has its own"
    assert "max_per_window_node" in caps.allow(1001)  # the node's ceiling: 3
    clock.advance(61)
    assert caps.allow(1000) is None and caps.in_window() == 1


def test_a_re_registered_rank_inside_a_phase_keeps_the_phase_s_own_budget(tmp_path):
    s = make_settings(tmp_path, WATCHDOG)
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=FakeClock())
    reg = Registration(
        job_id="job",
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        pid=12345,
        step=40,
        phase="checkpoint_save",
        phase_timeout_seconds=7200.0,
    )
    r = registry.register(reg, pid_start_time=None, peer_verified=True)
    d = dog.deadline(r)
    assert (d.timeout, d.basis) == (7200.0, "phase:checkpoint_save")
