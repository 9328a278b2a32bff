"""The shared-memory snapshot protocol: only sealed, intact snapshots count, a rank keeps two at
most, a finished job's files go, and a dead job's files are collected by the next job."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest

from sidecar_trainer.snapshot_store import OWNER, SnapshotStore, collect_garbage, job_key, process_identity


def write(store: SnapshotStore, step: int, payload: bytes | None = None) -> None:
    store.write(step, lambda f: f.write(payload or f"state of step {step}".encode()), {"world_size": 2})


@pytest.fixture
def memory_dir(tmp_path) -> Path:
    return tmp_path / "shm"


@pytest.fixture
def store(memory_dir) -> SnapshotStore:
    memory_dir.mkdir()
    opened = SnapshotStore.open(str(memory_dir), job_key("run", "/ckpt"), rank=1)
    assert opened is not None
    return opened


def test_a_sealed_snapshot_is_listed_and_intact(store):
    write(store, 7)

    assert store.steps() == [7]
    assert store.check(7) is None
    assert store.seal(7)["meta"] == {"world_size": 2}
    assert store.payload(7).read_bytes() == b"state of step 7"


def test_a_rank_keeps_its_two_newest_snapshots(store):
    for step in (1, 2, 3, 4):
        write(store, step)

    assert store.steps() == [4, 3]
    assert sorted(p.name for p in store.dir.glob("rank-1.*")) == [
        "rank-1.step-3.json",
        "rank-1.step-3.pt",
        "rank-1.step-4.json",
        "rank-1.step-4.pt",
    ]


def test_ranks_keep_their_own_snapshots(store):
    other = SnapshotStore(store.dir, rank=0)
    write(other, 5)
    for step in (6, 7, 8):
        write(store, step)

    assert other.steps() == [5] and store.steps() == [8, 7]


def test_a_payload_without_its_seal_does_not_count_and_the_next_write_removes_it(store):
    write(store, 3)
    (store.dir / "rank-1.step-4.pt").write_bytes(b"half of step 4")  # killed before the seal
    (store.dir / "rank-1.pt.tmp").write_bytes(b"half of step 5")  # killed while writing

    assert store.steps() == [3]
    write(store, 5)
    assert store.steps() == [5, 3]
    assert not (store.dir / "rank-1.step-4.pt").exists() and not (store.dir / "rank-1.pt.tmp").exists()


def test_a_payload_that_changed_after_its_seal_fails_its_check(store):
    write(store, 3)
    data = bytearray(store.payload(3).read_bytes())
    data[0] ^= 0xFF
    store.payload(3).write_bytes(bytes(data))

    assert store.check(3) == "payload checksum mismatch"


def test_a_truncated_payload_or_a_garbled_seal_fails_its_check(store):
    write(store, 3)
    write(store, 4)
    store.payload(3).write_bytes(b"short")
    (store.dir / "rank-1.step-4.json").write_text("{not json")

    assert store.check(3) == "payload has 5 bytes, the seal says 15"
    assert store.check(4) == "no readable seal"


def test_the_users_directory_is_private(store, memory_dir):
    user_dir = memory_dir / f"sidecar-trainer-{os.geteuid()}"
    assert (user_dir.stat().st_mode & 0o777, store.dir.stat().st_mode & 0o777) == (0o700, 0o700)


def test_a_users_directory_others_can_write_turns_memory_snapshots_off(memory_dir, caplog):
    user_dir = memory_dir / f"sidecar-trainer-{os.geteuid()}"
    user_dir.mkdir(parents=True)
    user_dir.chmod(0o777)

    with caplog.at_level(logging.WARNING, logger="sidecar_trainer"):
        assert SnapshotStore.open(str(memory_dir), "job", rank=0) is None
    assert "memory snapshots off" in caplog.text and "want this user's, 0700" in caplog.text


def test_a_symlink_in_place_of_the_users_directory_turns_memory_snapshots_off(memory_dir, tmp_path):
    memory_dir.mkdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (memory_dir / f"sidecar-trainer-{os.geteuid()}").symlink_to(tmp_path / "elsewhere")

    assert SnapshotStore.open(str(memory_dir), "job", rank=0) is None


def test_removing_the_last_ranks_files_removes_the_jobs_directory(store):
    other = SnapshotStore(store.dir, rank=0)
    write(other, 5)
    write(store, 5)

    store.remove()
    assert store.dir.is_dir() and other.steps() == [5]
    other.remove()
    assert not store.dir.exists()


def test_the_job_is_owned_by_the_process_that_restarts_its_ranks(store):
    owner = json.loads((store.dir / OWNER).read_text())
    assert owner == {"pid": os.getppid(), "start": process_identity(os.getppid())}


def test_a_dead_jobs_snapshots_are_collected_and_a_live_ones_kept(store):
    user_dir = store.dir.parent
    dead, alive = subprocess.Popen(["true"]), subprocess.Popen(["sleep", "60"])
    dead.wait()
    try:
        for name, proc in (("dead", dead), ("alive", alive)):
            job = SnapshotStore(user_dir / name, rank=0)
            job.dir.mkdir(mode=0o700)
            (job.dir / OWNER).write_text(json.dumps({"pid": proc.pid, "start": process_identity(alive.pid)}))
            write(job, 1)

        removed = collect_garbage(user_dir, keep=store.dir.name)
    finally:
        alive.kill()
        alive.wait()
    assert removed == [user_dir / "dead"]
    assert sorted(p.name for p in user_dir.iterdir()) == sorted(["alive", store.dir.name])


def test_a_restarted_rank_opens_its_jobs_snapshots_again(store, memory_dir):
    write(store, 9)
    again = SnapshotStore.open(str(memory_dir), store.dir.name, rank=1)

    assert again is not None and again.steps() == [9]


def test_the_job_key_names_the_run_and_its_checkpoint_directory():
    assert job_key("run", "/a") == job_key("run", "/a")
    assert len({job_key("run", "/a"), job_key("run", "/b"), job_key("other", "/a")}) == 3
