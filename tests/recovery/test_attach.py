"""Zero-code attach (`python -m trainer_hooks.attach script.py`): an unmodified script is watched,
hangs are detected, killed and restarted; with no sidecar the script runs as it would alone."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cycles.runner import SCRIPTS, run_cycles
from tests.support import COLD_RANKS, PYTHON, ROOT, spawned, tail

RECORDER = r"""
import json, os, sys, tempfile
import torch
import torch.distributed.checkpoint as dcp
from trainer_hooks.attach import Attachment

class Recorder:
    calls = []
    def step(self, step, **m): self.calls.append(["step", step, sorted(m)])
    def phase_start(self, name, timeout=None): self.calls.append(["phase_start", name])
    def phase_end(self, name): self.calls.append(["phase_end", name])
    def event(self, name, **f): self.calls.append(["event", name, f.get("step")])
    def close(self, *a, **k): self.calls.append(["close"])

att = Attachment(Recorder()).install()
model = torch.nn.Linear(4, 1)
gen, disc = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters(), lr=0.2)
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
    gen.step(); disc.step()   # two optimizers per step: still one step each time
d = tempfile.mkdtemp()
torch.save(model.state_dict(), os.path.join(d, "m.pt"))
torch.load(os.path.join(d, "m.pt"))
dcp.save(model.state_dict(), checkpoint_id=os.path.join(d, "dcp"))
att.close()
gen.step()                     # after close: nothing recorded
print(json.dumps(Recorder.calls))
"""


def test_attach_reports_optimizer_steps_and_checkpoint_phases():
    done = subprocess.run(
        [sys.executable, "-c", RECORDER],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    calls = json.loads(done.stdout.strip().splitlines()[-1])
    assert [c[1] for c in calls if c[0] == "step"] == [1, 2, 3]
    assert calls[0][2] == ["lr"] and calls[1][2] == ["lr", "step_time_seconds"]
    rest = [c for c in calls if c[0] != "step"]
    saved = [["phase_start", "checkpoint_save"], ["phase_end", "checkpoint_save"], ["event", "checkpoint_saved", 3]]
    assert rest == [*saved, ["phase_start", "checkpoint_load"], ["phase_end", "checkpoint_load"], *saved, ["close"]]


def test_attach_without_a_script_says_how_to_use_it():
    done = subprocess.run(
        [sys.executable, "-m", "trainer_hooks.attach"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 2 and "usage: python -m trainer_hooks.attach" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "trainer_hooks.attach", "/no/such/script.py"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "no such script" in done.stderr


def torchrun_unmodified(tmp_path: Path, name: str, attach: bool, env: dict) -> str:
    log = tmp_path / f"{name}.log"
    tail_args = ["-m", "trainer_hooks.attach"] if attach else []
    cmd = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        *tail_args,
        str(SCRIPTS["unmodified"]),
    ]
    with spawned(
        cmd,
        log,
        env={"PYTHONPATH": str(ROOT), "CYCLE_HANGS": "0", "CYCLE_STEP_SECONDS": "0", "OMP_NUM_THREADS": "1", **env},
    ) as proc:
        try:
            rc = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun did not finish:\n{tail(log)}")
    assert rc == 0, tail(log)
    digests = re.findall(r"params_sha256=(\w+)", log.read_text())
    assert len(digests) == 1, tail(log)
    return digests[0]


@pytest.mark.slow
def test_with_no_sidecar_reachable_an_attached_script_trains_as_it_would_alone(tmp_path: Path):
    alone = torchrun_unmodified(tmp_path, "alone", attach=False, env={})
    attached = torchrun_unmodified(
        tmp_path, "attached", attach=True, env={"SIDECAR_SOCKET": str(tmp_path / "nobody-listens.sock")}
    )
    assert attached == alone


@pytest.mark.slow
def test_an_unmodified_script_under_attach_hangs_is_detected_killed_and_restarted(tmp_path: Path):
    result = run_cycles("unmodified", tmp_path, cycles=2, timeout=300, extra_env=COLD_RANKS)
    explain = f"{result.line()} generations {result.generations}\n{tail(result.log, 40)}"
    assert result.came_back == 2 and result.incidents >= 2, explain
    assert result.own_namespaces(), explain  # attach put the restart remedy into every attempt
    assert result.finished and result.returncode == 0, explain


@pytest.mark.slow
def test_the_environment_switch_attaches_every_torchrun_worker_of_an_unmodified_script(tmp_path: Path):
    """SIDECAR_ATTACH=1 and the autoattach directory on PYTHONPATH, the command line untouched."""
    autoattach = subprocess.run(
        [sys.executable, "-m", "trainer_hooks.attach", "--pythonpath"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=True,
    ).stdout.strip()
    assert (Path(autoattach) / "sitecustomize.py").is_file()
    result = run_cycles(
        "unmodified",
        tmp_path,
        cycles=1,
        timeout=300,
        attach=False,
        extra_env={"SIDECAR_ATTACH": "1", "PYTHONPATH": autoattach},
    )
    explain = f"{result.line()} generations {result.generations}\n{tail(result.log, 40)}"
    assert result.came_back == 1 and result.incidents >= 1, explain
    assert result.own_namespaces(), explain
    assert result.finished and result.returncode == 0, explain
