"""The Hugging Face and Lightning callbacks, driven by the frameworks' real trainers on a
tiny random model, report steps, evaluation and checkpoints to a real sidecar."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hooks.helpers import metric_value, rank_env, rank_status
from tests.support import PYTHON, free_port, spawned, tail, wait_until


def train(framework: str, sidecar, tmp_path: Path, job_id: str) -> list:
    out, log = tmp_path / "calls.json", tmp_path / "train.log"
    with spawned(
        [PYTHON, "-m", "tests.hooks.framework_rank", framework, str(out), str(tmp_path)],
        log,
        env=rank_env(sidecar, job_id),
    ) as proc:
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{framework} training did not finish:\n{tail(log)}")
    assert rc == 0, f"{framework} training failed:\n{tail(log)}"
    return json.loads(out.read_text())


def steps(calls: list) -> list[int]:
    return [c[1] for c in calls if c[0] == "step"]


def python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_importing_the_hooks_pulls_in_no_framework_and_no_torch():
    assert (
        python(
            "import sys, trainer_hooks; print([m for m in ('torch', 'transformers', 'lightning') if m in sys.modules])"
        )
        == "[]"
    )


@pytest.mark.parametrize(
    "module, absent, package",
    [
        ("trainer_hooks.hf", ["transformers"], "pip install transformers"),
        ("trainer_hooks.lightning", ["lightning", "lightning.pytorch", "pytorch_lightning"], "pip install lightning"),
        ("trainer_hooks.accelerate", ["accelerate", "accelerate.tracking"], "pip install accelerate"),
    ],
)
def test_adapter_without_its_framework_says_what_to_install(module: str, absent: list, package: str):
    hide = "; ".join(f"sys.modules[{m!r}] = None" for m in absent)  # makes `import m` fail
    message = python(f"import sys; {hide}\ntry:\n    import {module}\nexcept ImportError as e:\n    print(e)")
    assert package in message


def assert_saves_inside_their_phase(calls: list, saves: int) -> None:
    """The framework writes each checkpoint between a checkpoint_save phase's start and end,
    so a long save is judged by the phase's budget, not the step timeout."""
    starts = [i for i, c in enumerate(calls) if c[:2] == ["phase_start", "checkpoint_save"]]
    ends = [i for i, c in enumerate(calls) if c[:2] == ["phase_end", "checkpoint_save"]]
    events = [i for i, c in enumerate(calls) if c[:2] == ["event", "checkpoint_saved"]]
    assert len(starts) == len(ends) == len(events) == saves
    assert all(s < e < ev for s, e, ev in zip(starts, ends, events, strict=True))


@pytest.mark.slow  # a real training run (7.6 s alone)
def test_hugging_face_callback_reports_a_real_trainer_run(sidecar, tmp_path: Path):
    pytest.importorskip("transformers")
    calls = train("hf", sidecar, tmp_path, "adapter-hf")
    assert steps(calls) == [1, 2, 3, 4, 5, 6]
    step_metrics = [c[2] for c in calls if c[0] == "step"]
    # tokens: the Trainer's num_input_tokens_seen (include_num_input_tokens_seen=True)
    assert all({"loss", "grad_norm", "lr", "samples", "tokens", "step_time_seconds"} <= set(m) for m in step_metrics)
    # eval every 3 steps as a phase, checkpoints at steps 4 and 6, the monitor closed at the end
    first_eval = calls.index(["phase_start", "eval"])
    assert first_eval < calls.index(["phase_end", "eval"]) < calls.index(["step", 4, step_metrics[3]])
    assert [c[2] for c in calls if c[:2] == ["event", "evaluated"]] == [3, 6]
    assert [c[2] for c in calls if c[:2] == ["event", "checkpoint_saved"]] == [4, 6]
    assert_saves_inside_their_phase(calls, 2)
    assert calls[-1] == ["close"]
    seen = wait_until(lambda: rank_status(sidecar, "adapter-hf"), 10, what="rank in status")
    assert seen["step"] == 6 and seen["loss"] > 0 and seen["lr"] > 0 and seen["state"] == "gone"
    assert metric_value(sidecar.metrics(), "sidecar_training_last_checkpoint_step", job_id="adapter-hf") == 6


@pytest.mark.slow  # a real training run (10.6 s alone)
def test_lightning_callback_reports_a_real_trainer_run(sidecar, tmp_path: Path):
    pytest.importorskip("lightning")
    calls = train("lightning", sidecar, tmp_path, "adapter-lightning")
    # 12 batches, 2 per optimizer step: each step reported once
    assert steps(calls) == [1, 2, 3, 4, 5, 6]
    # grad_norm: what Lightning's grad_norm utility logs as grad_2.0_norm_total
    logged = {"loss", "lr", "samples", "grad_norm", "step_time_seconds"}
    assert all(logged <= set(c[2]) for c in calls if c[0] == "step")
    assert calls.count(["phase_start", "eval"]) == calls.count(["phase_end", "eval"]) >= 1
    assert [c[2] for c in calls if c[:2] == ["event", "checkpoint_saved"]] == [4]
    assert_saves_inside_their_phase(calls, 1)
    assert calls[-1] == ["close"]
    # the run's end (its deregistration) reaches the sidecar a moment after the process exits
    seen = wait_until(lambda: (s := rank_status(sidecar, "adapter-lightning")) and s["state"] == "gone" and s, 10,
                      what="rank gone in status")  # fmt: skip
    assert seen["step"] == 6 and seen["loss"] > 0 and seen["state"] == "gone"


@pytest.mark.slow
def test_accelerate_tracker_reports_every_process_of_a_real_run(sidecar, tmp_path: Path):
    """Accelerate logs on the main process only; the tracker still reports each process's steps."""
    pytest.importorskip("accelerate")
    out, log = tmp_path / "out", tmp_path / "torchrun.log"
    out.mkdir()
    cmd = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--rdzv-backend",
        "c10d",  # the run id is the job id
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        "adapter-accelerate",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "-m",
        "tests.hooks.accelerate_rank",
        str(out),
    ]
    with spawned(cmd, log, env=rank_env(sidecar, "adapter-accelerate")) as proc:
        try:
            rc = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail(f"accelerate training did not finish:\n{tail(log)}")
    assert rc == 0, tail(log)
    calls = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    for r in (0, 1):
        assert steps(calls[r]) == [1, 2, 3, 4], (r, calls[r])
        assert all({"lr", "step_time_seconds"} <= set(c[2]) for c in calls[r] if c[0] == "step" and c[1] > 1)
    # what accelerator.log passed rides with the main process's steps
    assert all({"loss", "samples"} <= set(c[2]) for c in calls[0] if c[0] == "step")
    both = wait_until(
        lambda: len([r for r in (0, 1) if (rank_status(sidecar, "adapter-accelerate", r) or {}).get("step") == 4]) == 2,
        10,
        what="both ranks at step 4",
    )
    assert both
