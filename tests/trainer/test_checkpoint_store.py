"""The on-disk checkpoint protocol: only committed, intact step-N/ directories count."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from sidecar_trainer.checkpoint_store import COMMIT, MANIFEST, CheckpointStore, write_file


def save(store: CheckpointStore, step: int, payload: bytes = b"weights") -> Path:
    """What the ranks and rank 0 do together, in one process."""
    store.root.mkdir(parents=True, exist_ok=True)
    tmp = store.begin(step)
    digests = {
        "rank-0.pt": write_file(tmp / "rank-0.pt", payload + str(step).encode()),
        "rank-1.pt": write_file(tmp / "rank-1.pt", payload * 2),
    }
    path = store.commit(step, digests)
    store.prune(step)
    return path


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ckpt", keep_last=2)


def test_a_committed_checkpoint_is_the_latest_complete_one(store):
    save(store, 5)
    save(store, 10)
    found = store.latest_complete()
    assert found is not None and found.step == 10 and found.path.name == "step-10"


def test_an_empty_or_missing_directory_has_no_checkpoint(store):
    assert store.latest_complete() is None


def test_a_temp_directory_left_by_a_dead_writer_is_skipped_with_a_warning(store, caplog):
    save(store, 5)
    tmp = store.begin(10)
    write_file(tmp / "rank-0.pt", b"half")

    with caplog.at_level(logging.WARNING, logger="sidecar_trainer"):
        found = store.latest_complete()

    assert found.step == 5
    assert "step-10.tmp" in caplog.text and "never committed" in caplog.text


def test_a_step_directory_without_commit_marker_is_skipped_with_a_warning(store, caplog):
    save(store, 5)
    (save(store, 10) / COMMIT).unlink()

    with caplog.at_level(logging.WARNING, logger="sidecar_trainer"):
        assert store.latest_complete().step == 5
    assert "step-10" in caplog.text and "no COMMIT marker" in caplog.text


def test_a_file_with_a_bad_checksum_makes_the_checkpoint_corrupt(store, caplog):
    save(store, 5)
    damaged = save(store, 10) / "rank-1.pt"
    data = bytearray(damaged.read_bytes())
    data[0] ^= 0xFF  # same size, different bytes
    damaged.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="sidecar_trainer"):
        assert store.latest_complete().step == 5
    assert "rank-1.pt checksum mismatch" in caplog.text


def test_a_truncated_file_or_unreadable_manifest_makes_the_checkpoint_corrupt(store):
    truncated, garbled = save(store, 5), save(store, 10)
    (truncated / "rank-0.pt").write_bytes(b"w")
    (garbled / MANIFEST).write_text("{not json")

    assert "bytes, manifest says" in store.check(truncated)
    assert "COMMIT does not match" in store.check(garbled)
    assert store.latest_complete() is None


def test_pruning_keeps_the_newest_k_complete_checkpoints(store):
    for step in (5, 10, 15, 20):
        save(store, step)
    assert sorted(p.name for p in store.root.iterdir()) == ["step-15", "step-20"]


def test_pruning_removes_older_debris(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep_last=1)
    save(store, 5)
    store.begin(7)  # a writer died at step 7

    save(store, 10)

    assert sorted(p.name for p in store.root.iterdir()) == ["step-10"]


def test_pruning_never_deletes_the_checkpoint_just_committed_nor_newer_ones(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep_last=1)
    (save(store, 10) / COMMIT).unlink()  # step 10 turned out incomplete, so the run resumed earlier
    later = store.begin(12)
    save(store, 5)  # the resumed run commits step 5 and prunes

    assert store.latest_complete().step == 5
    assert (store.root / "step-10").is_dir() and later.is_dir()  # replaced when the run gets there


def test_a_new_commit_replaces_a_corrupt_directory_of_the_same_step(store):
    save(store, 5)
    (save(store, 10) / COMMIT).write_text("garbage")

    save(store, 10, payload=b"retrained")

    assert store.latest_complete().step == 10
    assert store.check(store.path_for(10)) is None
