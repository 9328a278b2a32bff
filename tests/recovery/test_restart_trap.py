"""The restart trap, for every user: a plain `init_process_group` next to the hooks' Monitor comes
back after every hang -> kill -> restart, and a rank that registers without the remedy (torchrun
sharing its store across attempts) is named by `sidecar status` and `/v1/status` with the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cycles.runner import run_cycles
from sidecar.problems import RESTART_TRAP_FIX
from tests.support import COLD_RANKS, PYTHON, ROOT, Sidecar, free_port, spawned, tail, wait_until

# Without the restart remedy about half of all restarts never train again (bench_cycles --baseline: 5
# of 10), which a few lucky cycles could miss; so every attempt's ranks also say which store namespace
# their group formed in (`own_namespaces`: the remedy in effect on every restart, whatever the odds).
# Two cycles: a restart after a restart. `make bench` (bench_cycles, 10 cycles per script) keeps the long proof.
CYCLES = 2

RANK = """
import time, torch, torch.distributed as dist
from trainer_hooks import Monitor
agent = dist.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False)  # torchrun's agent's store
dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=0, world_size=1)
mon = Monitor()
mon.step(1, loss=1.0)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)  # 2 cycles of 3-8 s each on a loaded 2-core machine
def test_the_readmes_monitor_example_unchanged_comes_back_from_every_hang(tmp_path: Path):
    """bench/cycles/train_readme.py: `dist.init_process_group("gloo")` called directly."""
    result = run_cycles("readme", tmp_path, cycles=CYCLES, timeout=240, extra_env=COLD_RANKS)
    explain = f"{result.line()} generations {result.generations}\n{tail(result.log, 40)}"
    assert result.came_back == CYCLES, explain
    assert result.own_namespaces(), explain
    assert result.incidents >= CYCLES, explain  # the sidecar, not a crash, ended every hung attempt
    assert result.finished and result.returncode == 0, explain


def start_rank(sidecar: Sidecar, workdir: Path, name: str, port: int, **env: str):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SIDECAR_", "RANK"))}
    torchrun_worker = {
        "TORCHELASTIC_RUN_ID": name,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "PYTHONPATH": str(ROOT),
    }
    full = {**clean, **sidecar.hook_env(), **torchrun_worker, **env}
    return spawned([PYTHON, "-c", RANK.format(port=port)], workdir / f"{name}.log", env=full)


def test_status_names_a_job_whose_ranks_would_not_come_back_and_the_fix(tmp_path: Path):
    with Sidecar(tmp_path) as sidecar:
        with (
            start_rank(sidecar, tmp_path, "trapped", free_port(), SIDECAR_ATTEMPT_STORE="0"),
            start_rank(sidecar, tmp_path, "remedied", free_port()),
        ):

            def both_registered() -> dict | None:
                status = sidecar.status()
                return status if {r["job_id"] for r in status["ranks"]} == {"trapped", "remedied"} else None

            status = wait_until(both_registered, 120, 0.2, what=f"both ranks registered:\n{tail(sidecar.log)}")
            safe = {r["job_id"]: r["restart_safe"] for r in status["ranks"]}
            assert safe == {"trapped": False, "remedied": True}
            (problem,) = [p for p in status["problems"] if "torchrun restart" in p]
            assert problem.startswith("job trapped: rank 0 would not come back")
            assert problem.endswith(f"fix: {RESTART_TRAP_FIX}")

            done = subprocess.run(
                [sys.executable, "-m", "sidecar", "status", "--socket", sidecar.socket],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=ROOT,
            )
            assert done.returncode == 1, done.stdout + done.stderr
            assert "job trapped: rank 0 would not come back" in done.stdout
            assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in done.stdout
            as_json = subprocess.run(
                [sys.executable, "-m", "sidecar", "status", "--socket", sidecar.socket, "--json"],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=ROOT,
            )
            assert problem in json.loads(as_json.stdout)["problems"]
