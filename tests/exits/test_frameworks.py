"""The Hugging Face and Lightning adapters need no code for exits: a real framework run whose
step raises torch.OutOfMemoryError is reported as exception/cuda_oom."""

from __future__ import annotations

import pytest

from tests.exits.helpers import exits_of, rank_env, wait_for_exit
from tests.support import PYTHON, ROOT, spawned, tail

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_a_cuda_oom_in_a_framework_run_is_exception_cuda_oom(framework, sidecar, tmp_path):
    pytest.importorskip({"hf": "transformers", "lightning": "lightning"}[framework])
    job = f"{framework}-oom"
    env = {**rank_env(sidecar, job), "FRAMEWORK_RANK_OOM_AT_STEP": "3", "PYTHONPATH": str(ROOT)}
    for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # HF would take them for a torch.distributed launch
        env.pop(key)
    log = tmp_path / f"{framework}.log"
    with spawned(
        [PYTHON, "-m", "tests.hooks.framework_rank", framework, str(tmp_path / "calls.json"), str(tmp_path)],
        log,
        env=env,
        cwd=ROOT,
    ) as proc:
        assert proc.wait(timeout=300) == 1, tail(log)
    assert "torch.OutOfMemoryError: CUDA out of memory" in log.read_text()
    wait_for_exit(sidecar, job, reason="exception/cuda_oom")
    (recorded,) = exits_of(sidecar, job)
    assert recorded["exception"]["type"] == "torch.OutOfMemoryError"
    assert recorded["step"] == 2, "the last step reported before the failing one"
