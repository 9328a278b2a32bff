"""Killed workers come back through torchrun and finish exactly where an uninterrupted run does."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.helpers import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("trainer_torchrun")]


def assert_same_parameters(a, b) -> None:
    left, right = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert list(left) == list(right)
    for name in left:
        assert torch.equal(left[name], right[name]), f"parameter {name} differs"


def test_worker_sigkilled_mid_training_resumes_to_bitwise_identical_parameters(tmp_path, reference_run):
    run = torchrun(tmp_path, "faults.kind=sigkill", "faults.rank=1", "faults.at_step=13")

    assert run.returncode == 0, run.log[-3000:]
    assert "fault injection: sigkill on rank 1 at step 13" in run.log
    assert "restart_count=1" in run.log
    assert "resumed from step 10 " in run.log
    assert run.digest == reference_run.digest
    assert_same_parameters(run.final_params, reference_run.final_params)


def test_worker_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path, reference_run):
    run = torchrun(tmp_path, "faults.kind=sigkill_in_checkpoint", "faults.rank=1", "faults.at_step=12")

    assert run.returncode == 0, run.log[-3000:]
    assert "sigkill_in_checkpoint on rank 1 while writing step 15" in run.log
    assert "skipping" in run.log and "step-15.tmp" in run.log
    assert "resumed from step 10 " in run.log
    assert run.digest == reference_run.digest


def test_fsdp_run_killed_mid_training_matches_its_uninterrupted_twin(tmp_path):
    reference = torchrun(tmp_path / "reference", "parallel.strategy=fsdp")
    killed = torchrun(
        tmp_path / "killed", "parallel.strategy=fsdp", "faults.kind=sigkill", "faults.rank=0", "faults.at_step=17"
    )

    assert reference.returncode == 0, reference.log[-3000:]
    assert killed.returncode == 0, killed.log[-3000:]
    assert "resumed from step 15 " in killed.log
    assert killed.digest == reference.digest
    assert_same_parameters(killed.final_params, reference.final_params)
