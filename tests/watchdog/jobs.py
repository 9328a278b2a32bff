"""Tiny real torchrun jobs for the end-to-end tests, built with the demo's command builders.

Every job trains the same 16 steps of the same model from the same seed, so any run that
finishes must end with the parameters of the uninterrupted reference run, bit for bit."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from harness.job import JobSpec
from tests.support import spawned, tail, wait_until

STEPS = 16
FAULT_STEP = 9  # checkpoints every 4 steps: a restart resumes from step 8
JOB_TIMEOUT = 240.0  # only catches hangs; a loaded machine is slow

# Fast detection for tests: a 3 s floor, quick dumps and a short grace period.
SIDECAR_SETTINGS = (
    "watchdog.floor_seconds=3",
    "watchdog.startup_timeout_seconds=180",
    "watchdog.check_interval_seconds=0.25",
    "remediation.dump_wait_seconds=1",
    "remediation.grace_seconds=3",
    "hooks_flush_interval_seconds=0.5",
)


def spec(**overrides) -> JobSpec:
    base = dict(
        steps=STEPS,
        fault="none",
        fault_rank=1,
        fault_step=FAULT_STEP,
        checkpoint_every=4,
        step_delay_seconds=0.02,
        max_restarts=3,
    )
    base.update(overrides)
    return JobSpec(**base)


@dataclass
class Finished:
    returncode: int
    log: Path
    digests: list[str] = field(default_factory=list)

    @property
    def digest(self) -> str | None:
        return self.digests[-1] if self.digests else None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def explain(self) -> str:
        return f"torchrun exited {self.returncode}; last lines of {self.log}:\n{tail(self.log, 40)}"


def start(job: JobSpec, workdir: Path, env: dict, name: str = "torchrun", rdzv_port: int | None = None):
    workdir.mkdir(parents=True, exist_ok=True)
    return spawned(job.command(workdir, rdzv_port), workdir / f"{name}.log", env=env)


def finish(proc: subprocess.Popen, log: Path, timeout: float = JOB_TIMEOUT) -> Finished:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"torchrun still running after {timeout}s:\n{tail(log, 40)}") from None
    digests = re.findall(r"params_sha256=(\w+)", log.read_text(errors="replace"))
    return Finished(proc.returncode, log, digests)


def run(job: JobSpec, workdir: Path, env: dict, name: str = "torchrun") -> Finished:
    with start(job, workdir, env, name) as proc:
        return finish(proc, workdir / f"{name}.log")


def incidents(sidecar) -> list[dict]:
    """The watchdog's stall incidents (not the exit incidents of ranks that died)."""
    directory = sidecar.workdir / "diag" / "incidents"
    records = [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]
    return [r for r in records if r.get("kind", "stall") == "stall"]


def wait_for_step(sidecar, step: int, timeout: float = JOB_TIMEOUT) -> None:
    def reached():
        try:
            return any((r.get("step") or 0) >= step for r in sidecar.status()["ranks"])
        except Exception:
            return False

    wait_until(reached, timeout, interval=0.2, what=f"a rank at step {step}")
