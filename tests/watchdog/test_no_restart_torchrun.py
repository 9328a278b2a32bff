"""Kills that lead somewhere, with real launchers: a hung rank that nothing would restart (torchrun
with `--max-restarts 0`, or a plain `python` rank) is recorded and its stacks dumped, but left
alive, and the incident says why; `remediation.kill_without_restart` kills it anyway."""

from __future__ import annotations

import pytest

from sidecar.watchdog.restarts import NOT_KILLED_NO_RESTART
from tests.support import PYTHON, Sidecar, spawned, wait_until
from tests.watchdog import jobs

pytestmark = pytest.mark.slow

DETECT_TIMEOUT = 120.0  # the trainer's start on a loaded machine, then the 3 s floor


def stall_incident(sidecar: Sidecar, timeout: float = DETECT_TIMEOUT) -> dict:
    def finished():
        done = [i for i in jobs.incidents(sidecar) if i["outcome"] != "pending"]
        return done[0] if done else None

    return wait_until(finished, timeout, interval=0.25, what="the stall's incident")


def assert_left_alive(incident: dict, proc, why: str) -> None:
    assert incident["outcome"] == NOT_KILLED_NO_RESTART, incident
    assert any(why in note and "not killing" in note for note in incident["notes"]), incident["notes"]
    assert "sigterm" not in [e["event"] for e in incident["timeline"]]
    assert proc.poll() is None, "the job was killed though nothing would restart it"


def test_a_hung_rank_under_torchrun_with_max_restarts_0_is_not_killed(tmp_path):
    with Sidecar(tmp_path, *jobs.SIDECAR_SETTINGS) as sidecar:
        with jobs.start(jobs.spec(fault="sleep", max_restarts=0), tmp_path, sidecar.hook_env()) as proc:
            incident = stall_incident(sidecar)
            assert_left_alive(incident, proc, "--max-restarts 0")
            (culprit,) = [r for r in incident["ranks"] if r["rank"] == 1]
            assert culprit["stack_head"], "the hung rank's stacks were dumped"
            assert f'outcome="{NOT_KILLED_NO_RESTART}"' in sidecar.metrics()
            states = {r["rank"]: r["state"] for r in sidecar.status()["ranks"]}
            assert "stalled" in states.values(), states  # still alerting: the stall stays visible


def test_a_hung_plain_python_rank_is_not_killed(tmp_path):
    command = [
        PYTHON,
        "-m",
        "sidecar_trainer",
        "--set",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "--set",
        "data.delay_seconds=0.02",
        "--set",
        "faults.kind=sleep",
        "--set",
        "faults.rank=0",
        "--set",
        f"faults.at_step={jobs.FAULT_STEP}",
    ]
    with Sidecar(tmp_path, *jobs.SIDECAR_SETTINGS) as sidecar:
        with spawned(command, tmp_path / "python.log", env=sidecar.hook_env()) as proc:
            incident = stall_incident(sidecar)
            assert_left_alive(incident, proc, "no torchrun")


def test_kill_without_restart_kills_a_hung_rank_that_nothing_restarts(tmp_path):
    settings = (*jobs.SIDECAR_SETTINGS, "remediation.kill_without_restart=true")
    with Sidecar(tmp_path, *settings) as sidecar:
        result = jobs.run(jobs.spec(fault="sleep", max_restarts=0), tmp_path, sidecar.hook_env())
        assert result.returncode != 0, "nothing restarted the killed group: the job fails"
        (incident,) = jobs.incidents(sidecar)
        assert incident["outcome"] == "killed", incident
        assert any("killing anyway" in note for note in incident["notes"]), incident["notes"]
