"""Running the bundled trainer for real: `python -m sidecar_trainer` and torchrun jobs on CPU/gloo."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import PYTHON, ROOT, free_port, spawned, tail

# Small enough for seconds per run on a busy 2-core machine, long enough to checkpoint 6 times.
TINY = [
    "train.steps=30",
    "train.log_every_steps=5",
    "batch.global_batch_size=32",
    "batch.micro_batch_size=8",
    "data.kwargs={size: 1024}",
    "checkpoint.every_steps=5",
    "checkpoint.keep_last=2",
    "monitor.enabled=false",
]


@dataclass
class Run:
    returncode: int
    log: str
    final_params: Path

    @property
    def digest(self) -> str:
        found = re.findall(r"training finished: step=\d+ params_sha256=([0-9a-f]{64})", self.log)
        assert found, f"no 'training finished' line in the log:\n{self.log[-3000:]}"
        return found[-1]


def torchrun_command(
    workdir: Path,
    *settings: str,
    nproc: int = 2,
    max_restarts: int = 1,
    run_id: str | None = None,
    launcher: str = "torch.distributed.run",
) -> list[str]:
    """A torchrun job of the trainer with TINY settings plus `settings`: `--standalone` (a fresh run
    id each time), or a one-node c10d rendezvous with `run_id` (the same job submitted again).
    `launcher="sidecar_trainer.launch"`: the trainer's own torchrun, workers forked from a warm server."""
    rendezvous = (
        ["--standalone"]
        if run_id is None
        else ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={run_id}"]
    )
    cmd = [
        PYTHON,
        "-m",
        launcher,
        *rendezvous,
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "-m",
        "sidecar_trainer",
        "--final-params",
        str(workdir / "final.pt"),
        "--set",
        f"checkpoint.dir={workdir / 'ckpt'}",
    ]
    for s in (*TINY, *settings):
        cmd += ["--set", s]
    return cmd


def torchrun(
    workdir: Path,
    *settings: str,
    nproc: int = 2,
    max_restarts: int = 1,
    timeout: float = 240,
    run_id: str | None = None,
    log_name: str = "torchrun.log",
    launcher: str = "torch.distributed.run",
) -> Run:
    """Run `torchrun_command(...)` to its end."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / log_name
    cmd = torchrun_command(workdir, *settings, nproc=nproc, max_restarts=max_restarts, run_id=run_id, launcher=launcher)
    with spawned(cmd, log) as proc:
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun still running after {timeout}s:\n{tail(log)}")
    return Run(code, log.read_text(errors="replace"), workdir / "final.pt")


def trainer_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m sidecar_trainer ARGS` as a subprocess, without torchrun."""
    import os

    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [PYTHON, "-m", "sidecar_trainer", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
