"""The trainer's background lanes (sidecar_trainer/background.py): a bounded wait for a stop."""

from __future__ import annotations

import threading

import pytest

from sidecar_trainer.background import Lane


def test_a_bounded_wait_on_a_busy_lane_times_out_and_a_later_wait_sees_the_job_end():
    release = threading.Event()
    lane = Lane("test-lane")
    lane.submit(release.wait)
    with pytest.raises(TimeoutError, match="test-lane: still busy after 0.1s"):
        lane.wait(0.1)
    assert lane.busy
    release.set()
    assert lane.wait(10) < 10
    assert not lane.busy


def test_a_bounded_wait_still_hands_over_the_jobs_error_once():
    lane = Lane("failing-lane")

    def fail():
        raise OSError("disk full")

    lane.submit(fail)
    with pytest.raises(OSError, match="disk full"):
        lane.wait(10)
    assert lane.wait(10) < 10  # raised once
