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
        # A push can be taken while the loop's last collectives are in flight (enqueued 7, completed 4
        # beside the suite): read until one taken after the loop, whose record holds nothing in flight.
        deadline, value, done = time.monotonic() + 60, None, None
        while time.monotonic() < deadline and proc.poll() is None:
            text = sidecar.metrics()
            value = metric_value(text, "sidecar_rank_collective_enqueued_seq", job_id="coll-job", rank="0", pg="0")
            done = metric_value(text, "sidecar_rank_collective_completed_seq", job_id="coll-job", rank="0", pg="0")
            if value is not None and value >= 7 and done == value:
                break
            time.sleep(0.2)
        release.touch()
        assert proc.wait(timeout=60) == 0, tail(log)
    assert value is not None and value >= 7, tail(log)
    assert done == value  # nothing in flight once the loop is done
    status = json.dumps(sidecar.status())
    assert "coll-job" in status


class FakeC10d:
    """torch's dump call on a CPU build: pg_status always, the entries only when asked for them
    (what holds the GIL); counts the reads of entries."""

    def __init__(self) -> None:
        self.enqueued, self.completed, self.entry_reads = 4, 4, 0

    def _dump_fr_trace_json(self, includeCollectives: bool = True, onlyActive: bool = False) -> bytes:
        status = {
            "0": {
                "last_enqueued_collective": str(self.enqueued),
                "last_completed_collective": str(self.completed),
                "last_started_collective": "-1",
            }
        }
        trace: dict = {"version": "2.10", "pg_config": {}, "pg_status": status}
        if includeCollectives:
            self.entry_reads += 1
            trace["entries"] = [
                {"collective_seq_id": s, "pg_id": 0, "process_group": ["0", "default_pg"], "is_p2p": False,
                 "profiling_name": "gloo:all_reduce", "input_sizes": [[8]], "retired": s <= self.completed,
                 "state": "scheduled", "time_created_ns": int(1e18) + s}
                for s in range(max(1, self.enqueued - 3), self.enqueued + 1)
            ]  # fmt: skip
        return json.dumps(trace).encode()


def test_the_entries_are_read_only_when_they_matter(monkeypatch):
    fake = FakeC10d()
    monkeypatch.setattr(collectives, "_c10d", lambda: fake)
    monkeypatch.setattr(collectives, "_members", lambda: {"0": ("default_pg", [0, 1])})
    monkeypatch.setattr(collectives, "_cache", collectives._Cache())
    first = collectives.read(now=1.0)
    assert first is not None and fake.entry_reads == 1  # the first read learns the groups' names
    for step in range(5):  # a healthy rank: the group moves between reads
        fake.enqueued = fake.completed = 5 + step
        record = collectives.read(now=2.0 + step)
        assert record is not None and record["groups"][0]["completed"] == 5 + step
    assert fake.entry_reads == 1  # pg_status alone (no GIL held for the ring)
    fake.enqueued = 10  # #10 in flight ...
    assert collectives.read(now=8.0)["groups"][0]["pending"] == []  # type: ignore[index]
    waiting = collectives.read(now=9.0)  # ... and still in flight at the next read: a wait
    assert fake.entry_reads == 2 and waiting is not None
    assert [p["seq"] for p in waiting["groups"][0]["pending"]] == [10]
    collectives.read(now=10.0, whole=True)  # the sidecar asked
    assert fake.entry_reads == 3


def test_the_record_carries_when_the_rank_entered_its_recent_collectives():
    """Per group, [seq, created] of its newest collectives, completed or not, in sequence order:
    what the sidecar measures a straggler's lateness from."""
    record = collectives.summarize(GLOO_DUMP, {"0": ("default_pg", [0, 1])}, now=1796385427.0)
    recent = {g["pg"]: g["recent"] for g in record["groups"]}
    assert recent == {"0": [[4, 1796385425.663110], [5, 1796385425.665564]], "1": [[3, 1796385425.664110]]}


def test_recent_keeps_the_newest_and_leaves_out_what_the_sidecar_refuses():
    n = collectives.COLLECTIVES_MAX_RECENT + 8
    entry = {"input_sizes": [[8]], "is_p2p": False, "pg_id": 0, "process_group": ["0", "default_pg"],
             "profiling_name": "gloo:all_reduce", "retired": True, "state": "scheduled"}  # fmt: skip
    entries = [{**entry, "collective_seq_id": s, "time_created_ns": int(1.8e18) + s * 1000} for s in range(1, n + 1)]
    entries += [
        {**entry, "collective_seq_id": n, "time_created_ns": int(1.8e18)},  # a coalesced one's earlier entry
        {**entry, "collective_seq_id": n + 1, "time_created_ns": 0},
        {**entry, "collective_seq_id": n + 2, "time_created_ns": int(2e21)},  # past wire.MAX_TIME
        {**entry, "collective_seq_id": n + 3},
    ]
    status = {"0": {"last_enqueued_collective": str(n + 3), "last_completed_collective": str(n + 3)}}
    record = collectives.summarize({"pg_status": status, "entries": entries}, {}, now=1.8e9)
    recent = record["groups"][0]["recent"]
    assert len(recent) == collectives.COLLECTIVES_MAX_RECENT
    assert [s for s, _ in recent] == list(range(n - collectives.COLLECTIVES_MAX_RECENT + 1, n + 1))
    assert recent[-1] == [n, 1.8e9]
    from sidecar.ranks.collectives import parse_collectives

    parsed = parse_collectives(json.loads(json.dumps(record)))
    assert parsed is not None and len(parsed.groups[0].recent) == collectives.COLLECTIVES_MAX_RECENT


def test_the_entries_are_read_whole_once_per_wall_clock_slot(monkeypatch):
    """Every rank reads its entries in the same slots of the wall clock, so that the sidecar gets the
    ranks' entry times of the same collectives; between them, the last whole read's `recent` again."""
    fake = FakeC10d()
    monkeypatch.setattr(collectives, "_c10d", lambda: fake)
    monkeypatch.setattr(collectives, "_members", lambda: {"0": ("default_pg", [0, 1])})
    monkeypatch.setattr(collectives, "_cache", collectives._Cache())
    every = collectives.WHOLE_EVERY_SECONDS
    start = 1000 * every + 0.5
    for i in range(25):
        fake.enqueued = fake.completed = 5 + i
        record = collectives.read(now=start + i)
        assert record is not None and record["groups"][0]["recent"]
    assert fake.entry_reads == 3  # at start, start + 10, start + 20 (wall clock), not 10 s after each other
    assert record["groups"][0]["recent"][-1][0] == 5 + 20  # the whole read of the slot


def test_a_node_whose_clock_is_off_reads_in_its_coordinators_slots(monkeypatch):
    """Issue 48: a node 3 s ahead read its entries 3 s apart from its peers in each slot; its ranks'
    `recent` windows (a second of collectives) then shared no collective with the others', and the
    coordinator judged no rank. With the offset the sidecar passes on, the slots are the coordinator's."""
    fake = FakeC10d()
    monkeypatch.setattr(collectives, "_c10d", lambda: fake)
    monkeypatch.setattr(collectives, "_members", lambda: {"0": ("default_pg", [0, 1])})
    whole = collectives._read_whole
    read_at: list[float] = []
    monkeypatch.setattr(collectives, "_read_whole", lambda c, when, slot: read_at.append(when) or whole(c, when, slot))
    every, skew = collectives.WHOLE_EVERY_SECONDS, 3.0
    start = 1000 * every + 0.5  # the coordinator's clock: half a second into one of its slots

    def reads(offset: float) -> list[float]:
        """The coordinator's clock at each whole read, of reads once a second on this node's clock."""
        read_at.clear()
        monkeypatch.setattr(collectives, "_cache", collectives._Cache())
        for i in range(25):
            fake.enqueued = fake.completed = 5 + i
            collectives.read(now=start + skew + i, clock_offset=offset)
        return [t - skew - 1000 * every for t in read_at]

    assert reads(skew) == [0.5, 10.5, 20.5]  # the first read in each of the coordinator's slots, as its peers'
    assert reads(0.0) == [0.5, 7.5, 17.5]  # on its own clock's slots: 2.5 s before its peers


def test_the_clock_offset_a_sidecar_says_is_taken_only_when_plausible():
    take = collectives.clock_offset
    assert take(2.5, 0.0) == 2.5 and take(-0.25, 1.0) == -0.25 and take(0, 1.0) == 0.0
    for bad in (None, "3", True, float("nan"), float("inf"), 1e9, [1.0], {"x": 1}):
        assert take(bad, 1.5) == 1.5, bad
