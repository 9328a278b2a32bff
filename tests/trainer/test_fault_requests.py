"""Fault requests (`faults.request_file`): the rank named takes a request once, fires it at its step,
and a restarted worker does not fire it again; a pause on every rank starts at the same step."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from sidecar_trainer import fault_requests
from sidecar_trainer.config import ConfigError, FaultConfig, load_config
from sidecar_trainer.fault_requests import FaultRequest, RequestWatch, taken_marker, write_request
from sidecar_trainer.faults import FaultInjector

PAUSE = "fault injection: pause on rank"


def steps(watch: RequestWatch, first: int, last: int) -> None:
    for step in range(first, last + 1):
        watch.step_start(step)


def test_an_unset_request_file_costs_nothing_per_step():
    assert FaultInjector(FaultConfig(), rank=0, restart_count=0).requests is None


def test_the_injector_looks_at_the_request_file_at_each_step_start(tmp_path, caplog):
    path = tmp_path / "fault.json"
    inj = FaultInjector(FaultConfig(request_file=str(path)), rank=1, restart_count=3)  # any attempt takes one
    write_request(path, FaultRequest("p1", "pause", 1, 4, 0.01))
    for step in range(1, 6):
        inj.step_start(step)
    assert "fault injection: pause on rank 1 at step 4" in caplog.text


def test_a_one_rank_request_fires_once_at_its_step_and_is_renamed_away(tmp_path, caplog):
    path = tmp_path / "fault.json"
    write_request(path, FaultRequest("f1", "pause", 1, 5, 0.01))
    other, mine = RequestWatch(str(path), 0), RequestWatch(str(path), 1)
    for step in range(1, 5):
        other.step_start(step)
        mine.step_start(step)
    assert PAUSE not in caplog.text
    assert not path.exists() and (tmp_path / "fault.json.f1.rank1.taken").exists()
    steps(mine, 5, 8)
    steps(other, 5, 8)
    assert caplog.text.count(PAUSE) == 1 and "on rank 1 at step 5" in caplog.text


def test_a_restarted_worker_does_not_fire_a_request_its_rank_took(tmp_path, caplog):
    path = tmp_path / "fault.json"
    write_request(path, FaultRequest("f1", "pause", 0, 3, 0.01))
    steps(RequestWatch(str(path), 0), 1, 4)
    # the bench (or a stale copy) puts the same request back: the rank took it already
    write_request(path, FaultRequest("f1", "pause", 0, 3, 0.01))
    steps(RequestWatch(str(path), 0), 2, 6)
    assert caplog.text.count(PAUSE) == 1


def test_a_request_without_a_step_fires_at_the_next_one(tmp_path, caplog):
    path = tmp_path / "fault.json"
    watch = RequestWatch(str(path), 2)
    steps(watch, 1, 3)
    write_request(path, FaultRequest("now", "pause", 2, None, 0.01))
    watch.step_start(4)
    assert "fault injection: pause on rank 2 at step 4" in caplog.text


def test_a_pause_of_every_rank_starts_at_the_same_step_on_each_once(tmp_path, caplog):
    path = tmp_path / "fault.json"
    watches = [RequestWatch(str(path), r) for r in range(3)]
    write_request(path, FaultRequest("all1", "pause", None, 7, 0.01))
    for step in range(1, 10):
        for w in watches:
            w.step_start(step)
    for r in range(3):
        assert f"fault injection: pause on rank {r} at step 7" in caplog.text
        assert (tmp_path / f"fault.json.all1.rank{r}.taken").exists()
    assert caplog.text.count(PAUSE) == 3 and path.exists()  # it stays for every rank
    steps(RequestWatch(str(path), 1), 5, 9)  # rank 1 restarted before step 7: it took it already
    assert caplog.text.count(PAUSE) == 3


def test_a_rank_that_reads_an_every_rank_request_after_its_step_skips_it(tmp_path, caplog):
    path = tmp_path / "fault.json"
    write_request(path, FaultRequest("late", "pause", None, 3, 0.01))
    steps(RequestWatch(str(path), 0), 5, 8)
    assert PAUSE not in caplog.text and "skipped on rank 0: read at step 5, too late" in caplog.text


@pytest.mark.parametrize(
    "content, problem",
    [
        ("{not json", "fault request"),
        (json.dumps({"id": "x", "kind": "explode", "rank": 0}), "kind: expected one of deadlock, spin, pause"),
        (json.dumps({"id": "x", "kind": "spin", "rank": -1}), "rank: expected a rank >= 0"),
        (json.dumps({"id": "x", "kind": "spin", "rank": "all"}), "at_step: a request for every rank needs"),
        (json.dumps({"id": "x", "kind": "pause", "rank": 0}), "seconds: a pause needs its length"),
        (json.dumps({"id": "../x", "kind": "spin", "rank": 0}), "id: expected"),
        (json.dumps({"id": "x", "kind": "spin", "rank": 0, "at_step": 0}), "at_step: expected a step >= 1"),
    ],
)
def test_a_bad_request_is_logged_and_ignored(tmp_path, caplog, content, problem):
    path = tmp_path / "fault.json"
    path.write_text(content)
    steps(RequestWatch(str(path), 0), 1, 3)
    assert problem in caplog.text and "fault injection" not in caplog.text
    assert caplog.text.count("ignored") == 1  # read once, not at every step


def test_the_deadlock_holds_two_threads_on_each_others_lock():
    victim = threading.Thread(target=fault_requests.deadlock, daemon=True)
    victim.start()
    victim.join(0.5)
    other = next((t for t in threading.enumerate() if t.name == "fault-deadlock"), None)
    assert victim.is_alive() and other is not None and other.is_alive()


def test_a_pause_computes_for_its_seconds_without_touching_the_training_rng():
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    started = time.monotonic()
    fault_requests.pause(0.3)
    assert time.monotonic() - started >= 0.3
    assert torch.equal(torch.random.get_rng_state(), before)


def test_the_marker_names_the_request_and_the_rank(tmp_path):
    assert taken_marker(tmp_path / "f.json", "a1", 3) == str(tmp_path / "f.json.a1.rank3.taken")


@pytest.mark.parametrize(
    "value, problem",
    [
        ("relative/fault.json", "must be an absolute path"),
        ("/nonexistent-dir-for-the-test/fault.json", "does not exist"),
        ("/tmp/", "must name a file"),
    ],
)
def test_a_bad_request_file_setting_names_the_field(value, problem):
    with pytest.raises(ConfigError, match=f"^faults.request_file: .*{problem}"):
        load_config(None, {"faults.request_file": value}, environ={})
