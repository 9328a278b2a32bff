"""A kill must lead somewhere: when nothing would restart a hung rank (it has no launcher, or
torchrun's --max-restarts is used up), the watchdog records the stall, dumps the stacks and
leaves the processes alive, unless `remediation.kill_without_restart` says to kill anyway.
Stand-in rank processes in a real Registry; tests/watchdog/test_no_restart_torchrun.py runs
the same under real torchrun."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from sidecar.host import procs
from sidecar.host.stackfiles import StackFile
from sidecar.ranks.protocol import Launcher, Registration
from sidecar.ranks.registry import Registry
from sidecar.watchdog.machine import Watchdog
from tests.support import make_settings
from tests.watchdog.helpers import WATCHDOG
from tests.watchdog.test_remediation import finish, stall

pytestmark = pytest.mark.asyncio

NO_LAUNCHER = Launcher("none")


def register(registry: Registry, proc, stacks: Path, launcher: Launcher | None, restart_count: int = 0):
    reg = Registration(
        job_id="job",
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        pid=proc.pid,
        restart_count=restart_count,
        stack_signal=int(signal.SIGUSR2),
        launcher=launcher,
    )
    r = registry.register(reg, pid_start_time=procs.start_time(proc.pid), peer_verified=True)
    r.stack_file = StackFile.existing(stacks)
    return r


async def stalled_incident(tmp_path, clock, hung_rank, launcher, restart_count=0, **settings) -> tuple:
    s = make_settings(tmp_path, WATCHDOG, **settings)
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=clock)
    proc, stacks = hung_rank()
    r = register(registry, proc, stacks, launcher, restart_count)
    await stall(dog, registry, clock, [r])
    await finish(dog)
    record = json.loads(Path(dog.incidents()[0]["path"]).read_text())
    return dog, r, proc, record


async def test_a_rank_without_a_launcher_is_not_killed_and_the_incident_says_why(tmp_path, clock, hung_rank):
    dog, r, proc, record = await stalled_incident(tmp_path, clock, hung_rank, NO_LAUNCHER)
    assert proc.poll() is None, "nothing would restart it: it must be left alive"
    assert record["outcome"] == "not_killed_no_restart"
    assert any("no torchrun" in note and "not killing" in note for note in record["notes"]), record["notes"]
    assert "sigterm" not in [e["event"] for e in record["timeline"]]
    assert dog.rank_state(r) == "stalled"
    assert dog.counters.remediations[("job", "not_killed_no_restart")] == 1


async def test_a_rank_left_alive_still_has_its_stacks_dumped(tmp_path, clock, hung_rank):
    _, _, _, record = await stalled_incident(tmp_path, clock, hung_rank, NO_LAUNCHER)
    (rank,) = record["ranks"]
    assert any("hang_in_the_training_step" in line for line in rank["stack_head"]), rank


async def test_a_rank_whose_torchrun_used_its_restarts_is_not_killed(tmp_path, clock, hung_rank):
    _, _, proc, record = await stalled_incident(tmp_path, clock, hung_rank, Launcher("torchrun", 3), restart_count=3)
    assert proc.poll() is None
    assert record["outcome"] == "not_killed_no_restart"
    assert any("--max-restarts 3" in note for note in record["notes"]), record["notes"]


async def test_a_rank_whose_torchrun_has_restarts_left_is_killed(tmp_path, clock, hung_rank):
    _, _, proc, record = await stalled_incident(tmp_path, clock, hung_rank, Launcher("torchrun", 3), restart_count=2)
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert record["outcome"] == "killed" and record["notes"] == []


async def test_a_rank_that_does_not_say_its_launcher_is_killed_as_before(tmp_path, clock, hung_rank):
    _, _, proc, record = await stalled_incident(tmp_path, clock, hung_rank, None)
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert record["outcome"] == "killed"


async def test_kill_without_restart_kills_and_the_incident_says_nothing_will_restart_it(tmp_path, clock, hung_rank):
    _, _, proc, record = await stalled_incident(
        tmp_path, clock, hung_rank, NO_LAUNCHER, **{"remediation.kill_without_restart": True}
    )
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert record["outcome"] == "killed"
    assert any("killing anyway" in note for note in record["notes"]), record["notes"]


async def test_a_stall_left_alive_spends_nothing_of_the_storm_cap(tmp_path, clock, hung_rank):
    dog, _, _, _ = await stalled_incident(tmp_path, clock, hung_rank, NO_LAUNCHER)
    assert dog.storm_cap.in_window() == 0
