"""The training loop in one process (`python -m sidecar_trainer` without torchrun: a world of one)."""

from __future__ import annotations

import re

import pytest

from tests.trainer.helpers import TINY, trainer_cli


def run_single(tmp_path, *settings: str) -> str:
    args = ["--set", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    for s in (*TINY, "train.steps=12", *settings):
        args += ["--set", s]
    result = trainer_cli(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.mark.slow
def test_evaluation_runs_in_its_phase_and_never_changes_the_trained_parameters(tmp_path):
    plain = run_single(tmp_path / "plain")
    evaluated = run_single(tmp_path / "eval", "eval.every_steps=4")

    assert len(re.findall(r"eval: step=\d+ loss=[0-9.]+", evaluated)) == 3
    digest = re.compile(r"params_sha256=(\w+)")
    assert digest.search(plain)[1] == digest.search(evaluated)[1]


@pytest.mark.slow
def test_a_finished_run_started_again_resumes_at_its_end_and_trains_no_further(tmp_path):
    first = run_single(tmp_path)
    again = run_single(tmp_path)

    assert "checkpoint saved: step=12" in first
    assert "resumed from step 12 " in again and "checkpoint saved" not in again
    assert re.search(r"params_sha256=(\w+)", first)[1] == re.search(r"params_sha256=(\w+)", again)[1]
