"""`sidecar drill` on a real 2-rank torchrun job with the hooks: one rank is stopped, the watchdog
detects the stall, kills the group, torchrun restarts it from its checkpoint, and the drill prints
each figure; the incident is recorded as a drill and the failure counter does not move. A job that
nothing would restart (torchrun --max-restarts 0) is refused and left alone."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.support import PYTHON, Sidecar
from tests.watchdog import jobs

pytestmark = pytest.mark.slow

CHECKPOINT_EVERY = 4
JOB = dict(steps=60, step_delay_seconds=0.25, fault="none", checkpoint_every=CHECKPOINT_EVERY)


def drill(sidecar: Sidecar, *flags: str, timeout: float = 200.0) -> subprocess.CompletedProcess:
    job_id = sidecar.status()["ranks"][0]["job_id"]  # torchrun --standalone names its own run
    return subprocess.run(
        [PYTHON, "-m", "sidecar", "drill", "--job", job_id, "--socket", sidecar.socket, *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def seconds(text: str, words: str) -> float:
    found = re.search(r"^\s+([\d.]+)s " + re.escape(words), text, re.MULTILINE)
    assert found, f"no {words!r} line in:\n{text}"
    return float(found.group(1))


def test_a_drill_stops_a_rank_and_reports_detection_kill_and_resume_without_a_failure(tmp_path):
    with Sidecar(tmp_path, *jobs.SIDECAR_SETTINGS) as sidecar:
        with jobs.start(jobs.spec(**JOB), tmp_path, sidecar.hook_env()) as proc:
            jobs.wait_for_step(sidecar, 6)
            done = drill(sidecar, "--rank", "1", "--timeout", "150")
            print(done.stdout, done.stderr)  # the figures, for the record (pytest -s)
            result = jobs.finish(proc, tmp_path / "torchrun.log")
        assert done.returncode == 0, done.stdout + done.stderr
        out = done.stdout
        stopped = re.search(r"stopped rank 1 of job \S+ \(pid \d+\) at step (\d+)", out)
        assert stopped, out
        detected = seconds(out, "detected the stall")
        killed = seconds(out, "sent the kill (SIGTERM)")
        again = seconds(out, "training again")
        assert 0 < detected <= killed <= again, out
        assert detected < 30, "detected within the 3 s floor and its slack"
        resumed = re.search(r"resumed from step (\d+)", out)
        assert resumed and int(resumed.group(1)) > 0, out
        assert "recorded as a drill, not counted as a failure" in out

        assert result.returncode == 0, result.explain()
        # the step the drill says the job resumed from is the trainer's own: its newest state, within
        # one checkpoint interval of the last step rank 0 logged before the kill (the stopped rank's
        # last report to the sidecar can lag the job by a flush interval or more under load)
        log = result.text()
        before = log[: log.index("resumed from step")]
        last = max(int(m) for m in re.findall(r"step (\d+)/60 loss=", before))
        assert last - CHECKPOINT_EVERY <= int(resumed.group(1)) <= last, (last, out)
        (incident,) = jobs.incidents(sidecar)
        assert incident["drill"] and incident["drill"].startswith("drill-"), incident
        assert incident["outcome"] == "killed" and incident["blamed_rank"] == 1
        metrics = sidecar.metrics()
        assert "sidecar_job_failures_total{" not in metrics, "a drill is not a failure"
        # counted apart: no stall, remediation or verdict counter (and no alert on them) moves for it
        assert re.search(r'sidecar_watchdog_drills_total\{job_id="[^"]+",outcome="killed"\} 1\.0', metrics), metrics
        for family in ("sidecar_watchdog_stalls_total{", "sidecar_watchdog_remediations_total{",
                       "sidecar_stall_verdicts_total{"):  # fmt: skip
            assert family not in metrics, family
        assert 'reason="watchdog"' in metrics, "the drill's exits are still classified (sidecar_rank_exits_total)"


def test_a_job_that_nothing_would_restart_is_refused(tmp_path):
    with Sidecar(tmp_path, *jobs.SIDECAR_SETTINGS) as sidecar:
        # 20 steps: the refusal comes at step 3, and the job then trains to its end untouched
        with jobs.start(jobs.spec(**{**JOB, "steps": 20}, max_restarts=0), tmp_path, sidecar.hook_env()) as proc:
            jobs.wait_for_step(sidecar, 3)
            refused = drill(sidecar)
            states = {r["state"] for r in sidecar.status()["ranks"]}
            result = jobs.finish(proc, tmp_path / "torchrun.log")
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "nothing would restart the job" in refused.stderr and "no restart left" in refused.stderr
        assert states <= {"healthy", "suspect"}, states
        assert result.returncode == 0, result.explain()
        assert jobs.incidents(sidecar) == []
