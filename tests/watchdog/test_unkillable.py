"""Processes that outlive SIGKILL, made with real kernel behaviour: a rank (or a worker of its
group) in a frozen cgroup v1 freezer handles no signal until it is thawed. Remediation reports
`unkillable` (it used to say `failed` and nothing more), names each process with what the kernel
says of it, keeps the node unfit while it lives, and records when it finally goes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from sidecar.fitness import Reason
from sidecar.ranks.registry import Registry
from sidecar.watchdog.machine import Watchdog
from tests import freezer
from tests.support import make_settings, wait_until
from tests.watchdog.helpers import WATCHDOG, register_hung
from tests.watchdog.test_outcomes import GROUP_WITH_STUBBORN_WORKER, register
from tests.watchdog.test_remediation import events, finish, stall

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.skipif(not freezer.available(), reason="needs a writable cgroup v1 freezer hierarchy"),
]

QUICK = {
    "remediation.dump_wait_seconds": 0.2,
    "remediation.grace_seconds": 0.2,
    "remediation.kill_wait_seconds": 0.5,
}


def record_of(dog: Watchdog) -> dict:
    return json.loads(Path(dog.incidents()[0]["path"]).read_text())


async def test_a_frozen_rank_is_unkillable_named_with_its_state_and_the_node_unfit_until_it_goes(
    tmp_path, clock, hung_rank
):
    s = make_settings(tmp_path, WATCHDOG, QUICK)
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=clock)
    proc, stacks = hung_rank()
    r = register_hung(registry, proc, stacks)
    with freezer.frozen_cgroup() as cg:
        cg.add(proc.pid)
        cg.freeze()
        await stall(dog, registry, clock, [r])
        await finish(dog)
        record = record_of(dog)
        assert record["outcome"] == "unkillable", record["timeline"]
        assert events(record)[-3:] == ["sigkill", "still_running", "unkillable"]
        (stuck,) = record["unkillable"]
        assert (stuck["pid"], stuck["who"]) == (proc.pid, "rank 0")
        assert stuck["state"] == "D (uninterruptible sleep)"
        assert stuck["freezer"] == f"FROZEN in {cg.path}"
        assert "SIGKILL" in stuck["pending_signals"] and stuck["wchan"]
        assert stuck["kernel_stack"] and stuck["kernel_stack_error"] is None  # root reads it here
        assert "freezer cgroup is FROZEN" in stuck["why"]
        assert f"rank 0 (pid {proc.pid}, python" in Path(record["path"]).with_suffix(".txt").read_text()
        assert dog.counters.remediations[("job", "unkillable")] == 1
        (finding,) = dog.remediator.unkillable.findings()
        assert finding.reason is Reason.UNKILLABLE and finding.pids == (proc.pid,)
        dog.tick()
        assert dog.remediator.unkillable.findings(), "still unfit while the process lives"

        cg.thaw()  # the pending SIGKILL is delivered
        assert proc.wait(timeout=10) == -signal.SIGKILL
        dog.tick()
        assert dog.remediator.unkillable.findings() == [], "fit again once it is gone"
        record = record_of(dog)  # saved again, saying when
        gone = record["timeline"][-1]
        assert gone["event"] == "unkillable_gone" and gone["pids"] == [proc.pid]
        assert gone["gone_after_seconds"] >= 0 and record["outcome"] == "unkillable"


async def test_a_frozen_worker_of_a_rank_that_died_is_unkillable_as_a_member_of_its_group(tmp_path, clock):
    s = make_settings(tmp_path, WATCHDOG, QUICK)
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=clock)
    rank = subprocess.Popen(
        [sys.executable, "-c", GROUP_WITH_STUBBORN_WORKER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    worker = psutil.Process(int(rank.stdout.readline()))
    try:
        with freezer.frozen_cgroup() as cg:
            cg.add(worker.pid)
            cg.freeze()
            r = register(registry, rank.pid, with_pidfd=True)
            await stall(dog, registry, clock, [r])
            await finish(dog)
            assert rank.wait(timeout=10) == -signal.SIGTERM, "the rank itself died"
            record = record_of(dog)
            assert record["outcome"] == "unkillable"
            (stuck,) = record["unkillable"]
            assert (stuck["pid"], stuck["who"]) == (worker.pid, f"pid {worker.pid} of rank 0's group")
            assert stuck["freezer"].startswith("FROZEN")
            cg.thaw()
            wait_until(
                lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, 10, what="worker gone"
            )
            dog.tick()
            assert dog.remediator.unkillable.findings() == []
            assert events(record_of(dog))[-1] == "unkillable_gone"
    finally:
        rank.kill()
        rank.wait()
