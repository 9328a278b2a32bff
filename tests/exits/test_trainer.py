"""The bundled trainer under real torchrun, with no exit-specific code of its own: its
`finally: monitor.close("failed")` sends the exception it is dying of."""

from __future__ import annotations

import pytest

from tests.exits.helpers import exits_of, incidents, wait_for_exit
from tests.support import Sidecar
from tests.watchdog import jobs

pytestmark = pytest.mark.slow


def test_a_cuda_oom_in_the_trainer_is_exception_cuda_oom_and_the_restart_finishes(tmp_path):
    with Sidecar(tmp_path, *jobs.SIDECAR_SETTINGS) as sidecar:
        result = jobs.run(jobs.spec(fault="cuda_oom", steps=12), tmp_path, sidecar.hook_env())
        assert result.returncode == 0, result.explain()
        assert "resumed from step 8" in result.text()
        culprit = wait_for_exit(sidecar, exits_of_job(sidecar), reason="exception/cuda_oom", rank=1)
        assert culprit["step"] == 8
        (incident,) = [i for i in incidents(sidecar, "exit")]
        first = incident["exits"][0]
        assert (first["rank"], first["reason"]) == (1, "exception/cuda_oom"), incident["summary"]
        assert first["exception"]["type"] == "torch.OutOfMemoryError"
        assert any("train.py" in frame for frame in first["exception"]["traceback"])
        assert incident["summary"].startswith(f"job {incident['job_id']}: rank 1 exited: exception/cuda_oom")


def test_a_nonfinite_loss_guard_names_the_checkpoint_before_the_nan(tmp_path):
    """Rank 1's loss is NaN at step 9; the guard stops it at step 10, before the step-12
    checkpoint; the restart resumes from step 8, which the incident names. Every copy to disk takes
    a second, so the step-8 copy is still being written when the guard stops (as under load): the
    stop finishes it first, and its checkpoint is on disk and named."""
    with Sidecar(tmp_path, *jobs.SIDECAR_SETTINGS) as sidecar:
        extra = ["train.nonfinite_loss_limit=2", "faults.checkpoint_delay_seconds=1"]
        job = jobs.spec(fault="nan_loss", steps=12, extra=extra)
        result = jobs.run(job, tmp_path, sidecar.hook_env())
        assert result.returncode == 0, result.explain()
        assert "resumed from step 8" in result.text()
        first_attempt = result.text().split("failed (exitcode")[0]  # up to torchrun's word on the failure
        assert "checkpoint saved: step=8" in first_attempt, result.explain()
        job_id = exits_of_job(sidecar)
        wait_for_exit(sidecar, job_id, reason="exception/nonfinite")
        nonfinite = [e for e in exits_of(sidecar, job_id) if e["reason"] == "exception/nonfinite"]
        for e in nonfinite:
            assert e["rollback"]["first_nonfinite_loss_step"] in (9, 10), e["rollback"]
            assert e["rollback"]["checkpoint_step"] == 8 and e["rollback"]["checkpoint_path"].endswith("step-8")
            assert e["exception"]["type"] == "FloatingPointError"


def exits_of_job(sidecar) -> str:
    """The job id torchrun gave the run (the rendezvous id)."""
    ranks = sidecar.status()["ranks"]
    assert ranks, "no rank registered"
    return ranks[0]["job_id"]
