"""The shared-memory snapshot protocol: only sealed, intact snapshots count, a rank keeps two at
most, a finished job's files go, and a dead job's files are collected by the next job."""

from __future__ import annotations

import json
import logging
import os
import re
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


def test_the_users_directory_is_private_and_its_name_unguessable(store, memory_dir):
    user_dir = store.dir.parent
    assert re.fullmatch(rf"sidecar-trainer-{os.geteuid()}\.[0-9a-f]{{16}}", user_dir.name), user_dir.name
    assert (user_dir.stat().st_mode & 0o777, store.dir.stat().st_mode & 0o777) == (0o700, 0o700)


def test_a_restarted_rank_finds_the_users_directory_by_its_owner_not_its_name(store, memory_dir):
    write(store, 3)
    again = SnapshotStore.open(str(memory_dir), store.dir.name, rank=1)

    assert again is not None and again.dir == store.dir and again.steps() == [3]


@pytest.mark.parametrize("squat", ["0777 directory", "another user's directory", "symlink", "file"])
@pytest.mark.parametrize("name", ["the old fixed name", "the new form"])
def test_what_someone_else_put_under_the_users_names_is_passed_over_and_left_alone(memory_dir, tmp_path, squat, name):
    memory_dir.mkdir()
    memory_dir.chmod(0o1777)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    planted = memory_dir / f"sidecar-trainer-{os.geteuid()}" if name == "the old fixed name" else None
    planted = planted or memory_dir / f"sidecar-trainer-{os.geteuid()}.{'0' * 16}"
    if squat == "symlink":
        planted.symlink_to(elsewhere)
    elif squat == "file":
        planted.write_bytes(b"")
    else:
        planted.mkdir()
        planted.chmod(0o777 if squat == "0777 directory" else 0o700)
        if squat == "another user's directory":
            os.chown(planted, 54321, 54321)

    store = SnapshotStore.open(str(memory_dir), "job", rank=0)
    assert store is not None
    write(store, 1)

    assert store.dir.parent != planted and store.steps() == [1]
    assert list(elsewhere.iterdir()) == [] and (not planted.is_dir() or list(planted.iterdir()) == [])


@pytest.mark.parametrize(
    ("mode", "owner", "problem"),
    [
        (0o777, None, "others may write it and it is not sticky"),
        (0o1777, 54321, "is owned by uid 54321 (want root's or this user's)"),
    ],
)
def test_a_memory_dir_where_others_could_move_the_users_directory_turns_memory_snapshots_off(
    memory_dir, caplog, mode, owner, problem
):
    if owner is not None and os.geteuid() != 0:
        pytest.skip("needs root to give the directory to another user")
    memory_dir.mkdir()
    memory_dir.chmod(mode)
    if owner is not None:
        os.chown(memory_dir, owner, owner)

    with caplog.at_level(logging.WARNING, logger="sidecar_trainer"):
        assert SnapshotStore.open(str(memory_dir), "job", rank=0) is None
    assert "memory snapshots off" in caplog.text and problem in caplog.text
    assert list(memory_dir.iterdir()) == []


def test_a_sticky_shared_memory_dir_like_dev_shm_is_used(memory_dir):
    memory_dir.mkdir()
    memory_dir.chmod(0o1777)

    assert SnapshotStore.open(str(memory_dir), "job", rank=0) is not None


def test_each_rank_keeps_the_users_directory_that_holds_its_own_snapshots(memory_dir):
    """Two of the user's directories (two agents that started at once): a rank resumes from its own."""
    memory_dir.mkdir()
    first = SnapshotStore.open(str(memory_dir), "job", rank=0)
    assert first is not None
    second_dir = memory_dir / f"sidecar-trainer-{os.geteuid()}.{'f' * 16}"
    (second_dir / "job").mkdir(mode=0o700, parents=True)
    second_dir.chmod(0o700)
    write(SnapshotStore(second_dir / "job", rank=1), 4)

    mine = {rank: SnapshotStore.open(str(memory_dir), "job", rank=rank) for rank in (0, 1)}

    assert mine[0] is not None and mine[0].dir == first.dir
    assert mine[1] is not None and mine[1].dir == second_dir / "job" and mine[1].steps() == [4]


def test_a_failed_write_leaves_nothing_of_its_step_and_the_previous_snapshot_intact(store):
    write(store, 3)

    def short(f):
        f.write(b"the first half of step 4")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 40704 vs 40656")

    with pytest.raises(RuntimeError, match="unexpected pos"):
        store.write(4, short, {"world_size": 2})

    assert sorted(p.name for p in store.dir.glob("rank-1.*")) == ["rank-1.step-3.json", "rank-1.step-3.pt"]
    assert store.steps() == [3] and store.check(3) is None


def test_a_write_that_fails_at_its_seal_leaves_no_unsealed_payload(store, monkeypatch):
    import sidecar_trainer.snapshot_store as snapshot_store

    def no_room(path, data, interrupt=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot_store, "write_file", no_room)
    with pytest.raises(OSError, match="No space left"):
        write(store, 5)

    assert list(store.dir.glob("rank-1.*")) == []


def test_a_job_whose_owner_cannot_be_recorded_still_gets_its_store(memory_dir, caplog):
    memory_dir.mkdir()
    store = SnapshotStore.open(str(memory_dir), "job", rank=0)
    assert store is not None
    (store.dir / OWNER).unlink()
    (store.dir / OWNER).mkdir()  # the rename over it fails, as a write into a full tmpfs would

    with caplog.at_level(logging.WARNING, logger="sidecar_trainer"):
        again = SnapshotStore.open(str(memory_dir), "job", rank=0)

    assert again is not None and "cannot name the job's owner" in caplog.text
    assert not list(again.dir.glob("*.tmp"))


def test_a_dead_jobs_snapshots_are_collected_from_the_old_fixed_name_too(memory_dir):
    legacy = memory_dir / f"sidecar-trainer-{os.geteuid()}"
    dead = subprocess.Popen(["true"])
    dead.wait()
    (legacy / "old").mkdir(mode=0o700, parents=True)
    legacy.chmod(0o700)
    (legacy / "old" / OWNER).write_text(json.dumps({"pid": dead.pid, "start": 1}))

    assert SnapshotStore.open(str(memory_dir), "job", rank=0) is not None
    assert not (legacy / "old").exists()


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


def test_the_job_key_names_the_run_and_its_checkpoint_directory():
    assert job_key("run", "/a") == job_key("run", "/a")
    assert len({job_key("run", "/a"), job_key("run", "/b"), job_key("other", "/a")}) == 3


def test_failed_memory_snapshots_never_reach_the_training_thread_and_three_in_a_row_turn_them_off(
    tmp_path, monkeypatch, caplog
):
    """A full tmpfs (issue 28, row 4): each failure is skipped, the first and the last logged, and
    after MEMORY_FAILURES_OFF in a row the process stops taking snapshots; training goes on."""
    import datetime

    import torch

    from sidecar_trainer import checkpoint
    from sidecar_trainer.config import CheckpointConfig, FaultConfig
    from sidecar_trainer.data import DataPosition
    from sidecar_trainer.distributed import World
    from sidecar_trainer.faults import FaultInjector
    from sidecar_trainer.monitoring import NullMonitor

    monkeypatch.setattr(checkpoint.dist, "barrier", lambda *a, **k: None)  # a world of one, no group
    cfg = CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=1000, memory_dir=str(tmp_path / "shm"))
    world = World(0, 0, 1, 0, 1, "gloo", torch.device("cpu"), datetime.timedelta(seconds=60))
    ck = checkpoint.Checkpointer(cfg, world, "ddp", 0, FaultInjector(FaultConfig(), 0, 0), NullMonitor())
    assert ck.memory is not None
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    failing = [1, 2, 4, 5, 6]  # step 3 succeeds: the count is of failures in a row
    real_write = ck.memory.write

    def write(step, produce, meta):
        if step in failing:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 40704 vs 40656")
        real_write(step, produce, meta)

    monkeypatch.setattr(ck.memory, "write", write)
    taken = []
    with caplog.at_level(logging.WARNING, logger="sidecar_trainer"):
        for step in range(1, 10):
            ck.before_gradient_sync()  # where a lane's error used to reach the training thread
            taken.append(ck.memory_due(step))
            ck.after_step(step, 1000, model, optimizer, scheduler, DataPosition(), torch.tensor(1.0))
        ck.flush()

    assert taken == [True] * 6 + [False] * 3
    assert ck.memory.steps() == [3]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("memory snapshot of step 1 failed (RuntimeError: ") and "MiB free in" in warnings[0]
    assert warnings[1].startswith("memory snapshots off for this process: 3 failed in a row (the last of step 6")
