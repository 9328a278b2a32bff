"""The hooks' collective record (trainer_hooks/collectives.py): the Flight Recorder turned on before
the group forms unless the user set it, its dump summarised into what the sidecar judges from,
and a real rank's record reaching the sidecar's metrics."""

from __future__ import annotations

import json
import time

import pytest

from tests.hooks.helpers import metric_value, rank_env
from tests.support import (
    PYTHON,
    ROOT,  # noqa: I001
    spawned,
    tail,
)
from trainer_hooks import collectives

# What `_dump_fr_trace_json` gave on this machine (torch 2.13, gloo): rank 0 waiting in all-reduce
# #5 of the default group, a subgroup "1" idle; the entries' state stays "scheduled" on gloo.
GLOO_DUMP = {
    "comm_lib_version": "", "nccl_comm_state": {}, "version": "2.10",
    "pg_config": {"": {"desc": "", "name": "", "ranks": "[]"}},
    "pg_status": {
        "0": {"last_completed_collective": "4", "last_enqueued_collective": "5", "last_started_collective": "-1"},
        "1": {"last_completed_collective": "3", "last_enqueued_collective": "3", "last_started_collective": "-1"},
    },
    "entries": [
        {"collective_seq_id": 4, "input_sizes": [[1000]], "is_p2p": False, "pg_id": 0,
         "process_group": ["0", "default_pg"], "profiling_name": "gloo:all_reduce",
         "retired": True, "state": "scheduled",
         "time_created_ns": 1796385425663110270},
        {"collective_seq_id": 3, "input_sizes": [[1]], "is_p2p": False, "pg_id": 1,
         "process_group": ["1", "undefined"], "profiling_name": "gloo:all_reduce",
         "retired": True, "state": "scheduled",
         "time_created_ns": 1796385425664110270},
        {"collective_seq_id": 5, "input_sizes": [[1000]], "is_p2p": False, "pg_id": 0,
         "process_group": ["0", "default_pg"], "profiling_name": "gloo:all_reduce",
         "retired": False, "state": "scheduled",
         "time_created_ns": 1796385425665564232},
    ],
}  # fmt: skip


def test_a_gloo_dump_becomes_the_record_the_sidecar_judges_from():
    members = {"0": ("default_pg", [0, 1]), "1": ("", [0, 1])}
    record = collectives.summarize(GLOO_DUMP, members, now=1796385427.0)
    first, second = record["groups"]
    assert (first["pg"], first["enqueued"], first["completed"], first["ranks"]) == ("0", 5, 4, [0, 1])
    assert [p["seq"] for p in first["pending"]] == [5]  # completed #4 is not in flight
    assert first["pending"][0]["op"] == "all_reduce" and first["pending"][0]["sizes"] == [[1000]]
    assert first["pending"][0]["created"] == pytest.approx(1796385425.665564)
    assert (second["pg"], second["pending"]) == ("1", [])  # the idle group comes after the waiting one
    from sidecar.ranks.collectives import parse_collectives

    parsed = parse_collectives(record)
    assert parsed is not None and parsed.groups[0].waiting and not parsed.groups[1].waiting


def test_the_recorder_is_turned_on_unless_the_user_chose():
    env: dict[str, str] = {}
    assert collectives.enable(env) and env[collectives.BUFFER_ENV] == str(collectives.DEFAULT_BUFFER)
    mine = {collectives.BUFFER_ENV: "2000"}
    assert collectives.enable(mine) and mine[collectives.BUFFER_ENV] == "2000"
    off = {collectives.BUFFER_ENV: "0"}
    assert not collectives.enable(off) and off[collectives.BUFFER_ENV] == "0"
    switched = {collectives.SWITCH: "0"}
    assert not collectives.enable(switched) and collectives.BUFFER_ENV not in switched


def test_without_torch_or_a_group_there_is_no_record():
    assert collectives.read() is None and collectives.dump_json() is None


@pytest.mark.slow
def test_a_real_ranks_record_reaches_the_sidecars_metrics(sidecar, tmp_path):
    release = tmp_path / "release"
    env = rank_env(sidecar, "coll-job", PYTHONPATH=str(ROOT))
    log = tmp_path / "rank.log"
    with spawned([PYTHON, "-m", "tests.hooks.collective_rank", "--steps", "7", "--release", str(release)], log,
                 env=env) as proc:  # fmt: skip
        deadline, value = time.monotonic() + 60, None
        while time.monotonic() < deadline and proc.poll() is None:
            text = sidecar.metrics()
            value = metric_value(text, "sidecar_rank_collective_enqueued_seq", job_id="coll-job", rank="0", pg="0")
            if value is not None and value >= 7:
                break
            time.sleep(0.2)
        release.touch()
        assert proc.wait(timeout=60) == 0, tail(log)
    assert value is not None and value >= 7, tail(log)
    done = metric_value(text, "sidecar_rank_collective_completed_seq", job_id="coll-job", rank="0", pg="0")
    assert done == value  # nothing in flight once the loop is done
    status = json.dumps(sidecar.status())
    assert "coll-job" in status
