"""Killed workers come back through torchrun and finish exactly where an uninterrupted run does,
resuming from the newest state every rank holds: a memory snapshot or a checkpoint on disk."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from sidecar_trainer.snapshot_store import job_key
from tests.support import spawned, tail, wait_until
from tests.trainer.helpers import Run, torchrun, torchrun_command

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("trainer_torchrun")]

DISK_ONLY = "checkpoint.memory_every_steps=0"
KILL_RANK1_AT_13 = ("faults.kind=sigkill", "faults.rank=1", "faults.at_step=13")


def assert_same_parameters(a, b) -> None:
    left, right = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert list(left) == list(right)
    for name in left:
        assert torch.equal(left[name], right[name]), f"parameter {name} differs"


def loaded(run: Run) -> tuple[int, str]:
    """(step, source) of the resume, from rank 0's `checkpoint loaded` line."""
    found = re.findall(r"checkpoint loaded: step=(\d+) source=(\w+)", run.log)
    assert len(found) == 1, run.log[-3000:]
    return int(found[0][0]), found[0][1]


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory) -> Run:
    run = torchrun(tmp_path_factory.mktemp("fsdp-reference"), "parallel.strategy=fsdp")
    assert run.returncode == 0, run.log[-3000:]
    return run


def test_worker_sigkilled_mid_training_resumes_from_memory_to_bitwise_identical_parameters(tmp_path, reference_run):
    run = torchrun(tmp_path, *KILL_RANK1_AT_13)

    assert run.returncode == 0, run.log[-3000:]
    assert "fault injection: sigkill on rank 1 at step 13" in run.log and "restart_count=1" in run.log
    # Newer than the disk's step 10: step 12, or 11 when rank 1 died before sealing step 12's snapshot.
    assert loaded(run) in ((12, "memory"), (11, "memory"))
    assert run.digest == reference_run.digest
    assert_same_parameters(run.final_params, reference_run.final_params)


def test_a_finished_job_removes_its_memory_snapshots(reference_run):
    removed = re.findall(r"memory snapshots removed: (\S+)", reference_run.log)
    assert len(removed) == 1 and removed[0].startswith("/dev/shm/sidecar-trainer-"), reference_run.log[-3000:]
    assert not Path(removed[0]).exists()


def test_a_disk_only_run_sigkilled_mid_training_resumes_from_its_last_checkpoint(tmp_path, reference_run):
    run = torchrun(tmp_path, DISK_ONLY, *KILL_RANK1_AT_13)

    assert run.returncode == 0, run.log[-3000:]
    # Step 10 unless its background copy was still being written when rank 1 died.
    assert loaded(run) in ((10, "disk"), (5, "disk"))
    assert run.digest == reference_run.digest


def test_worker_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path, reference_run):
    run = torchrun(tmp_path, DISK_ONLY, "faults.kind=sigkill_in_checkpoint", "faults.rank=1", "faults.at_step=12")

    assert run.returncode == 0, run.log[-3000:]
    assert "sigkill_in_checkpoint on rank 1 while writing step 15" in run.log
    assert "skipping" in run.log and "step-15.tmp" in run.log
    assert loaded(run) == (10, "disk")  # copies are written one after the other: 10 was complete
    assert run.digest == reference_run.digest


def stopped_job(tmp_path: Path, run_id: str, memory: Path, *settings: str, memory_step: int) -> Path:
    """A job whose rank 1 hangs in step 13, stopped from outside (no restart) once step 10 is on
    disk and every rank sealed its memory snapshot of `memory_step`; returns the snapshots' directory."""
    key = job_key(run_id, str(tmp_path / "ckpt"))
    hang = ("faults.kind=sleep", "faults.rank=1", "faults.at_step=13")
    cmd = torchrun_command(tmp_path, f"checkpoint.memory_dir={memory}", *settings, *hang, max_restarts=0, run_id=run_id)
    log = tmp_path / "stopped.log"

    def ready() -> bool:
        # The user's directory has a random name: sidecar-trainer-<uid>.<16 hex digits>
        sealed = all(
            any(memory.glob(f"sidecar-trainer-{os.geteuid()}.*/{key}/rank-{r}.step-{memory_step}.json")) for r in (0, 1)
        )
        return sealed and "checkpoint saved: step=10 " in log.read_text(errors="replace")

    with spawned(cmd, log):
        wait_until(ready, 180, 0.2, what=f"step 10 on disk and step {memory_step} in memory:\n{tail(log)}")
    (snapshots,) = memory.glob(f"sidecar-trainer-{os.geteuid()}.*/{key}")
    return snapshots


def test_a_job_submitted_again_resumes_from_the_memory_snapshots_its_stopped_run_left(tmp_path, reference_run):
    memory = tmp_path / "shm"
    stopped_job(tmp_path, "submitted-again", memory, memory_step=12)

    again = torchrun(tmp_path, f"checkpoint.memory_dir={memory}", run_id="submitted-again")

    assert again.returncode == 0, again.log[-3000:]
    assert loaded(again) == (12, "memory")  # the disk has step 10
    assert again.digest == reference_run.digest


def test_memory_snapshots_older_than_the_disk_checkpoint_lose_to_it(tmp_path, reference_run):
    memory, every_7 = tmp_path / "shm", "checkpoint.memory_every_steps=7"
    stopped_job(tmp_path, "stale-memory", memory, every_7, memory_step=7)

    again = torchrun(tmp_path, f"checkpoint.memory_dir={memory}", every_7, run_id="stale-memory")

    assert again.returncode == 0, again.log[-3000:]
    assert loaded(again) == (10, "disk")
    assert again.digest == reference_run.digest


def test_corrupt_memory_snapshots_fall_back_to_the_disk_checkpoint(tmp_path, reference_run):
    memory = tmp_path / "shm"
    snapshots = stopped_job(tmp_path, "corrupt-memory", memory, memory_step=12)
    for payload in snapshots.glob("rank-1.step-*.pt"):
        data = bytearray(payload.read_bytes())
        data[len(data) // 2] ^= 0xFF
        payload.write_bytes(bytes(data))

    again = torchrun(tmp_path, f"checkpoint.memory_dir={memory}", run_id="corrupt-memory")

    assert again.returncode == 0, again.log[-3000:]
    for step in (12, 11):
        assert f"memory snapshot of step {step} unusable (rank 1: payload checksum mismatch)" in again.log
    assert loaded(again) == (10, "disk")
    assert again.digest == reference_run.digest


def test_fsdp_run_killed_mid_training_resumes_from_memory_to_its_uninterrupted_twins_parameters(
    tmp_path, fsdp_reference
):
    killed = torchrun(tmp_path, "parallel.strategy=fsdp", "faults.kind=sigkill", "faults.rank=0", "faults.at_step=17")

    assert killed.returncode == 0, killed.log[-3000:]
    assert loaded(killed) in ((16, "memory"), (15, "memory"))
    assert killed.digest == fsdp_reference.digest
    assert_same_parameters(killed.final_params, fsdp_reference.final_params)


def test_a_disk_only_fsdp_run_killed_mid_training_resumes_from_its_last_checkpoint(tmp_path, fsdp_reference):
    killed = torchrun(
        tmp_path, "parallel.strategy=fsdp", DISK_ONLY, "faults.kind=sigkill", "faults.rank=0", "faults.at_step=17"
    )

    assert killed.returncode == 0, killed.log[-3000:]
    assert loaded(killed) in ((15, "disk"), (10, "disk"))
    assert killed.digest == fsdp_reference.digest
    assert_same_parameters(killed.final_params, fsdp_reference.final_params)
