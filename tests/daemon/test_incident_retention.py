"""Incident records are kept within the settings' count, megabytes and days (issue 31, item 9):
the oldest go first, a record written in the last ten minutes never, and a link planted in the
incidents directory (root in a pod that mounts diag/ read-write could) is removed itself, never
what it points to. Before, nothing was ever removed: a node whose jobs kept failing filled its
tmpfs diagnostics directory with records."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sidecar.incidents import store as store_module
from sidecar.incidents.store import IN_PROGRESS_SECONDS, IncidentStore, Retention
from tests.support import make_settings

DAY = 86400.0


def record(directory: Path, stem: str, age: float, size: int = 100, fr: bool = False) -> None:
    """An incident record as the store writes it: json, txt and (optionally) a .fr directory."""
    directory.mkdir(parents=True, exist_ok=True)
    names = [directory / f"{stem}.json", directory / f"{stem}.txt"]
    for path in names:
        path.write_bytes(b"x" * size)
    if fr:
        d = directory / f"{stem}.fr"
        d.mkdir()
        (d / "rank_0").write_bytes(b"y" * size)
        names.append(d / "rank_0")
        names.append(d)
    when = time.time() - age
    for path in names:
        os.utime(path, (when, when), follow_symlinks=False)


def stems(directory: Path) -> list[str]:
    return sorted({p.name.rsplit(".", 1)[0] for p in directory.iterdir()})


@pytest.fixture
def incidents(tmp_path) -> Path:
    return tmp_path / "incidents"


def test_the_oldest_records_go_beyond_the_count_with_their_flight_recorder_dumps(tmp_path, incidents):
    for i in range(6):
        record(incidents, f"2026120{i}T000000.000Z-job", age=(6 - i) * DAY, fr=i < 2)
    removed = IncidentStore(tmp_path, retention=Retention(count=3)).prune()
    assert removed == [f"2026120{i}T000000.000Z-job" for i in range(3)]
    assert stems(incidents) == [f"2026120{i}T000000.000Z-job" for i in range(3, 6)]
    assert not (incidents / "20261200T000000.000Z-job.fr").exists()


def test_the_oldest_records_go_beyond_the_bytes_and_the_days(tmp_path, incidents):
    for i in range(4):
        record(incidents, f"2026120{i}T000000.000Z-job", age=(10 - i) * DAY, size=1000)  # 2000 bytes each
    assert IncidentStore(tmp_path, retention=Retention(bytes=5000)).prune() == [
        "20261200T000000.000Z-job", "20261201T000000.000Z-job",
    ]  # fmt: skip
    assert IncidentStore(tmp_path, retention=Retention(seconds=7.5 * DAY)).prune() == ["20261202T000000.000Z-job"]
    assert stems(incidents) == ["20261203T000000.000Z-job"]


def test_a_record_written_in_the_last_ten_minutes_stays_whatever_the_limits(tmp_path, incidents):
    record(incidents, "20261201T000000.000Z-old", age=DAY)
    record(incidents, "20261202T000000.000Z-live", age=IN_PROGRESS_SECONDS / 2)
    record(incidents, "20261203T000000.000Z-live", age=1)
    assert IncidentStore(tmp_path, retention=Retention(count=1)).prune() == ["20261201T000000.000Z-old"]
    assert stems(incidents) == ["20261202T000000.000Z-live", "20261203T000000.000Z-live"]


def test_no_limits_remove_nothing_and_other_files_are_left_alone(tmp_path, incidents):
    for i in range(3):
        record(incidents, f"2026120{i}T000000.000Z-job", age=400 * DAY)
    (incidents / ".job-owners.json.tmp-x").write_text("{}")
    (incidents / "notes").write_text("an operator's")
    assert IncidentStore(tmp_path).prune() == []
    assert IncidentStore(tmp_path, retention=Retention(count=1)).prune() == [
        "20261200T000000.000Z-job", "20261201T000000.000Z-job",
    ]  # fmt: skip
    assert (incidents / "notes").exists() and (incidents / ".job-owners.json.tmp-x").exists()


def test_a_link_planted_among_the_records_is_removed_itself_never_what_it_points_to(tmp_path, incidents):
    """What root in a training pod with diag/ mounted read-write could plant: links named like old
    records, to a file and to a directory of someone else's. Retention runs as root."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    record(incidents, "20261205T000000.000Z-job", age=DAY)
    (incidents / "20261201T000000.000Z-a.fr").symlink_to(victim)
    (incidents / "20261201T000000.000Z-a.json").symlink_to(victim / "precious")
    for link in ("20261201T000000.000Z-a.fr", "20261201T000000.000Z-a.json"):
        old = time.time() - 3 * DAY
        os.utime(incidents / link, (old, old), follow_symlinks=False)
    removed = IncidentStore(tmp_path, retention=Retention(count=1)).prune()
    assert removed == ["20261201T000000.000Z-a"]
    assert (victim / "precious").read_text() == "keep me" and victim.is_dir()
    assert not os.path.lexists(incidents / "20261201T000000.000Z-a.fr")
    assert not os.path.lexists(incidents / "20261201T000000.000Z-a.json")


def test_the_store_looks_its_directory_over_when_it_opens_an_incident_at_most_once_a_minute(
    tmp_path, incidents, monkeypatch
):  # fmt: skip
    settings = make_settings(tmp_path, incident_retention_count=2)
    store = IncidentStore.for_settings(settings)
    directory = store.directory
    for i in range(4):
        record(directory, f"2026110{i}T000000.000Z-old", age=DAY)
    store.open("j1", blamed_rank=None, blame_reason="", timeout_seconds=None, observe_only=True, ranks=[])
    assert len(stems(directory)) == 2  # the new one and the newest old one
    for i in range(4):
        record(directory, f"2026100{i}T000000.000Z-older", age=2 * DAY)
    store.open("j2", blamed_rank=None, blame_reason="", timeout_seconds=None, observe_only=True, ranks=[])
    assert len(stems(directory)) == 7  # within the minute: not looked over again
    monkeypatch.setattr(store_module, "RETENTION_CHECK_SECONDS", 0.0)
    store._pruned_at = -1.0
    store.open("j3", blamed_rank=None, blame_reason="", timeout_seconds=None, observe_only=True, ranks=[])
    assert len(stems(directory)) == 3  # the three new ones, each within ten minutes: kept


def test_the_settings_are_checked():
    from sidecar.config import ConfigError

    with pytest.raises(ConfigError, match="incident_retention_days"):
        make_settings(Path("/tmp"), incident_retention_days=-1)


def test_two_incidents_of_a_job_opened_in_one_millisecond_get_two_records(tmp_path, monkeypatch):
    """Beside a busy suite, both attempts' exits of a job were decided at one instant (the first
    rank's exit seen only when the second's was): both incidents got the same id, the second
    record replaced the first, and one exit was lost (tests/exits/test_torchrun.py, one run of
    make test-under-load)."""

    class OneMillisecond:  # the store's clock, stopped (time.time itself is the test runner's too)
        def __getattr__(self, name):
            return getattr(time, name)

        def time(self) -> float:
            return 1796594400.1234

    monkeypatch.setattr(store_module, "time", OneMillisecond())
    store = IncidentStore(tmp_path)
    fields = {"blamed_rank": 0, "blame_reason": "x", "timeout_seconds": 1.0, "observe_only": False, "ranks": []}
    first, second = store.open("job", **fields), store.open("job", **fields)
    assert first.id != second.id and first.id.endswith(".123Z-job") and second.id.startswith(first.id)
    assert sorted(p.name for p in (tmp_path / "incidents").glob("*.json")) == sorted(
        [f"{first.id}.json", f"{second.id}.json"]
    )
