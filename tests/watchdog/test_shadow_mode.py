"""Shadow mode with figures (issue 29, item 3), end to end: a job asks for observe-only at
registration (the hooks' SIDECAR_OBSERVE_ONLY); its rank pauses past the floor and resumes. It is
not killed; the stall is a would-be kill and, having ended by itself, a false alarm whose duration
/metrics and /v1/status show; the job learns from it, so the same pause again is no stall.

Real sidecar, real hooks (`Monitor`) under torchrun's variables (a launcher with restarts left:
the watchdog would have killed it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.hooks.helpers import metric_value
from tests.support import Sidecar, kill_tree
from tests.watchdog.test_floor_is_the_ranks_own import FLOOR, SETTINGS, stalled_at

pytestmark = pytest.mark.slow

PAUSE = 7.0  # past the 5 s floor, under 1.5 x itself
# Steps every 50 ms; pauses PAUSE seconds after 40 steps and again after 30 more, then 20 steps.
# The step-time window is 20 steps: the first pause is out of the adaptive timeout's window before
# the second (only what the job learned covers it).
RANK = r"""
import sys, time
from trainer_hooks import Monitor
pause = float(sys.argv[1])
mon = Monitor(job_id="shadow", rank=0, local_rank=0, world_size=1, local_world_size=1)
step = 0
for n, then in ((40, pause), (30, pause), (20, 0.0)):
    for _ in range(n):
        step += 1
        time.sleep(0.05)
        mon.step(step, loss=1.0)
    time.sleep(then)
mon.close()
"""


def test_a_job_s_own_observe_only_counts_a_would_be_kill_and_a_false_alarm_and_learns(tmp_path):
    with Sidecar(tmp_path, *SETTINGS, "watchdog.window=20") as sidecar:
        env = {**os.environ, **sidecar.hook_env(), "SIDECAR_OBSERVE_ONLY": "1"}
        env.update(TORCHELASTIC_RUN_ID="shadow", TORCHELASTIC_MAX_RESTARTS="3", TORCHELASTIC_RESTART_COUNT="0")
        env.pop("SIDECAR_FLUSH_INTERVAL", None)
        rank = subprocess.Popen([sys.executable, "-c", RANK, str(PAUSE)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert rank.wait(timeout=60) == 0, rank.stderr.read() if rank.stderr else ""  # never killed
            log = sidecar.log.read_text(errors="replace")
            assert len(stalled_at(sidecar, "rank shadow/0")) == 1, log  # the first pause only
            assert "asks for observe-only" in log and "honoured" in log
            metrics = sidecar.metrics()
            job = {"job_id": "shadow"}
            assert metric_value(metrics, "sidecar_watchdog_stalls_total", **job) == 1
            assert metric_value(metrics, "sidecar_watchdog_remediations_total", outcome="observe_only", **job) == 1
            assert metric_value(metrics, "sidecar_watchdog_would_kill_total", **job) == 1
            assert metric_value(metrics, "sidecar_watchdog_false_alarms_total", phase="steps", **job) == 1
            steps = {"phase": "steps", **job}
            assert metric_value(metrics, "sidecar_watchdog_false_alarm_duration_seconds_count", **steps) == 1
            took = metric_value(metrics, "sidecar_watchdog_false_alarm_duration_seconds_sum", **steps)
            assert took is not None and PAUSE <= took <= PAUSE + 1.0, took
            shadow = sidecar.status()["watchdog"]["shadow"]["shadow"]
            assert shadow["observe_only"] is True and shadow["would_kill"] == 1 and shadow["false_alarms"] == 1
            longest = shadow["phases"]["steps"]["longest_pause_seconds"]
            assert longest == pytest.approx(took, abs=0.01)
            assert shadow["floor_killing_none_seconds"] == pytest.approx(longest + 0.25, abs=0.01)  # a tick
            assert shadow["learned_budgets_seconds"]["steps"] == pytest.approx(1.5 * took, abs=0.01)
            assert FLOOR < 1.5 * PAUSE
            incident = next(i for i in sidecar.status()["incidents"] if i["job_id"] == "shadow")
            assert incident["outcome"] == "observe_only"
        finally:
            kill_tree(rank)
