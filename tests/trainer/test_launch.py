"""`python -m sidecar_trainer.launch`: torchrun whose workers are forked from a server that
imported torch once, so a restarted worker trains again without importing anything."""

from __future__ import annotations

import re
import subprocess

import pytest

from sidecar_trainer.launch import WORKER, torchrun_argv
from tests.support import PYTHON, ROOT
from tests.trainer.helpers import torchrun
from trainer_hooks.rendezvous import _frame_function_name
from trainer_hooks.rendezvous import fast_event_names as fast_rendezvous_event_names


def test_the_launcher_passes_torchruns_options_on_and_runs_the_trainer_as_a_forked_function():
    argv = ["--standalone", "--nproc-per-node", "2", "--max-restarts=3", "-m", "sidecar_trainer", "--set", "a.b=1"]

    assert torchrun_argv(argv) == [
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts=3",
        "--run-path",
        "--start-method",
        "forkserver",
        str(WORKER),
        "--set",
        "a.b=1",
    ]


def test_the_launchers_rendezvous_names_its_events_as_torch_does_without_inspect_stack(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    torchs = dynamic_rendezvous.get_method_name
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", torchs)  # undone after the test

    def record(depth: int) -> tuple[str, str]:  # where torch calls it: a method recording an event
        return torchs(depth), _frame_function_name(depth)

    def the_callers_method(depth: int) -> tuple[str, str]:
        return record(depth)

    for depth in (1, 2, 3, 10_000):  # 0 is the function itself; 10_000 is past the stack's end
        assert record(depth)[0] == record(depth)[1]
    assert the_callers_method(2) == ("the_callers_method", "the_callers_method")
    assert record(10_000) == ("no_method_name", "no_method_name")

    assert fast_rendezvous_event_names()
    assert dynamic_rendezvous.get_method_name is _frame_function_name


def test_the_launcher_refuses_any_other_script_and_says_what_to_use():
    done = subprocess.run(
        [PYTHON, "-m", "sidecar_trainer.launch", "--standalone", "train.py"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )

    assert done.returncode == 2
    assert "runs the bundled trainer only" in done.stderr and "use torchrun for other scripts" in done.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("trainer_torchrun")
def test_a_worker_killed_under_the_launcher_restarts_without_imports_and_resumes_exactly(tmp_path, reference_run):
    run = torchrun(
        tmp_path, "faults.kind=sigkill", "faults.rank=1", "faults.at_step=13", launcher="sidecar_trainer.launch"
    )

    assert run.returncode == 0, run.log[-3000:]
    assert "restart_count=1" in run.log
    assert re.search(r"checkpoint loaded: step=1[12] source=memory", run.log)
    assert run.digest == reference_run.digest
    # The restarted rank 0 was forked with torch in memory: by its imports_done it had spent a
    # fraction of the CPU a fresh interpreter spends importing torch and torch._dynamo (2-3.5 CPU-s
    # here). Its CPU, not its wall time: beside the suite a forked worker waited 1.06 s for a core.
    cpu = [float(c) for c in re.findall(r"startup: imports_done t=[\d.]+ cpu_s=([\d.]+)", run.log)]
    assert len(cpu) == 2, run.log[-3000:]
    assert cpu[1] < 0.5, cpu


@pytest.mark.slow
@pytest.mark.xdist_group("trainer_torchrun")
def test_a_worker_under_the_launcher_loads_its_data_in_dataloader_worker_processes(tmp_path):
    # A forkserver child is left with forkserver as its default start method and mid-bootstrap: a
    # DataLoader's workers started from it failed ("An attempt has been made to start a new process
    # before the current process has finished its bootstrapping phase") at every attempt.
    run = torchrun(tmp_path, "data.num_workers=1", nproc=1, max_restarts=0, launcher="sidecar_trainer.launch")

    assert run.returncode == 0, run.log[-3000:]
    assert "training finished" in run.log
