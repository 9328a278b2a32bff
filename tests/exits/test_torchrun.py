"""Exits of real torchrun workers: a CUDA out-of-memory error and a real gloo collective timeout,
reported by the hooks' excepthook, classified by the sidecar."""

from __future__ import annotations

import pytest

from tests.exits.helpers import RANK, TIMEOUT, counted, exits_of, incidents, rank_env, wait_for_exit
from tests.support import PYTHON, free_port, spawned, tail

pytestmark = pytest.mark.slow

TORCHRUN = [
    PYTHON,
    "-m",
    "torch.distributed.run",
    "--nnodes",
    "1",
    "--rdzv-backend",
    "c10d",
    "--max-restarts",
    "1",
    "--monitor-interval",
    "0.2",
]


def torchrun(tmp_path, sidecar, job_id: str, nproc: int, mode: str):
    env = {**rank_env(sidecar, job_id), "OMP_NUM_THREADS": "1"}
    for key in ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(key)
    cmd = TORCHRUN + [
        "--nproc-per-node",
        str(nproc),
        "--rdzv-id",
        job_id,
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        RANK,
        "--mode",
        mode,
        "--steps",
        "2",
    ]
    log = tmp_path / f"{job_id}.log"
    with spawned(cmd, log, env=env) as proc:
        code = proc.wait(timeout=TIMEOUT * 2)
    return code, log


def test_a_cuda_out_of_memory_error_under_torchrun_is_exception_cuda_oom(tmp_path, sidecar):
    code, log = torchrun(tmp_path, sidecar, "cuda-oom", 1, "cuda_oom")
    assert code != 0, tail(log)
    assert "torch.OutOfMemoryError: CUDA out of memory" in log.read_text()
    wait_for_exit(sidecar, "cuda-oom", reason="exception/cuda_oom")
    wait_for_exit(sidecar, "cuda-oom", reason="exception/cuda_oom", restart=1)
    recorded = exits_of(sidecar, "cuda-oom")
    assert len(recorded) == 2, "the first attempt and torchrun's restart both died of it"
    assert len([i for i in incidents(sidecar, "exit") if i["job_id"] == "cuda-oom"]) == 2, "one per attempt"
    for e in recorded:
        assert e["reason"] == "exception/cuda_oom"
        assert e["exception"]["type"] == "torch.OutOfMemoryError"
        assert e["exception"]["message"].startswith("CUDA out of memory. Tried to allocate 20.00 GiB")
        assert any("exited with status 1" in line for line in e["evidence"]), e["evidence"]
    assert counted(sidecar, "cuda-oom") == {"exception/cuda_oom": 2.0}
    assert counted(sidecar, "cuda-oom", "sidecar_job_failures_total") == {"exception/cuda_oom": 2.0}


def test_a_gloo_collective_timeout_is_classified_on_the_surviving_rank(tmp_path, sidecar):
    """Rank 1 never joins the all_reduce; rank 0's times out after the group's 3 s timeout."""
    code, log = torchrun(tmp_path, sidecar, "gloo-timeout", 2, "gloo_timeout")
    assert code != 0, tail(log)
    assert "Timed out waiting 3000ms" in log.read_text()
    wait_for_exit(sidecar, "gloo-timeout", reason="exception/collective_timeout", rank=0, restart=0)
    first = [e for e in exits_of(sidecar, "gloo-timeout") if e["rank"] == 0 and e["restart_count"] == 0][0]
    assert first["exception"]["type"] == "RuntimeError"
    assert "gloo" in first["exception"]["message"] and "Timed out waiting 3000ms" in first["exception"]["message"]
    # torchrun stops the straggler when rank 0 fails: a signal from outside, not the cause.
    straggler = wait_for_exit(sidecar, "gloo-timeout", rank=1, restart=0)
    assert straggler["reason"] == "signal"
    assert counted(sidecar, "gloo-timeout", "sidecar_job_failures_total")["exception/collective_timeout"] >= 1
    assert "signal" not in counted(sidecar, "gloo-timeout", "sidecar_job_failures_total")
