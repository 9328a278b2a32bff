"""Training counters and the step-time histogram on a real sidecar's /metrics: what a real
Monitor pushes accumulates, survives the rank's re-registration, and promtool accepts it."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from sidecar.ranks.stepcounters import STEP_TIME_BUCKETS, StepCounters
from tests.hooks.helpers import metric_value
from tests.support import PYTHON, ROOT, Sidecar

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def test_counters_count_steps_advanced_and_the_histogram_buckets_step_times():
    c = StepCounters()
    c.observe(1, {"samples": 8, "tokens": 100}, 0.07)
    c.observe(3, {"samples": 8, "tokens": float("nan")}, 1.0)  # a report every 3 steps; 1.0 is in le=1.0
    c.observe(1, {}, None)
    assert (c.steps, c.samples, c.tokens) == (5, 32, 100)
    buckets = dict(c.buckets())
    assert buckets["0.05"] == 0 and buckets["0.1"] == 1 and buckets["0.5"] == 1 and buckets["1.0"] == 2
    assert buckets["+Inf"] == c.step_time_count == 2 and abs(c.step_time_sum - 1.07) < 1e-9
    assert STEP_TIME_BUCKETS[0] <= 0.005 and STEP_TIME_BUCKETS[-1] >= 600  # milliseconds to minutes


PUSH = """
import sys, time
from trainer_hooks import Monitor
first, last, step_time = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
mon = Monitor(job_id="counters", rank=0, world_size=1, flush_interval=0.05)
for step in range(first, last + 1):
    mon.step(step, loss=1.0, samples=4, tokens=64, step_time_seconds=step_time)
deadline = time.monotonic() + 30
while mon.sent < last - first + 1 and time.monotonic() < deadline:
    time.sleep(0.05)
mon.close()
sys.exit(0 if mon.sent == last - first + 1 else 1)
"""


def push(sidecar: Sidecar, first: int, last: int, step_time: float) -> None:
    """A rank process (a child of the test, not of the sidecar) pushes steps first..last."""
    done = subprocess.run(
        [PYTHON, "-c", PUSH, str(first), str(last), str(step_time)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT), **sidecar.hook_env()},
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.system
def test_a_sidecar_exports_counters_and_a_histogram_that_continue_across_re_registration(tmp_path: Path):
    with Sidecar(tmp_path, "watchdog.observe_only=true") as sidecar:
        push(sidecar, 1, 10, 0.2)
        text = sidecar.metrics()
        labels = {"job_id": "counters", "rank": "0"}
        assert metric_value(text, "sidecar_training_steps_total", **labels) == 10
        assert metric_value(text, "sidecar_training_samples_total", **labels) == 40
        assert metric_value(text, "sidecar_training_tokens_total", **labels) == 640
        assert metric_value(text, "sidecar_training_step_duration_seconds_count", **labels) == 10
        assert metric_value(text, "sidecar_training_step_duration_seconds_bucket", le="0.1", **labels) == 0
        assert metric_value(text, "sidecar_training_step_duration_seconds_bucket", le="0.25", **labels) == 10
        # the worker restarts and resumes from step 5: a new registration, the same series, still rising
        time.sleep(0.1)
        push(sidecar, 5, 8, 3.0)
        text = sidecar.metrics()
        assert metric_value(text, "sidecar_training_steps_total", **labels) == 14
        assert metric_value(text, "sidecar_training_samples_total", **labels) == 56
        assert metric_value(text, "sidecar_training_step_duration_seconds_bucket", le="5.0", **labels) == 14
        assert metric_value(text, "sidecar_training_step_duration_seconds_bucket", le="2.5", **labels) == 10
        check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
