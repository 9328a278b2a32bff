"""A node that cannot recover, end to end with real kernel behaviour: a hooked rank frozen in a
cgroup v1 freezer stalls, the watchdog's SIGKILL stays pending (a frozen process handles no
signal until thawed), the incident says `unkillable` and names the process, its freezer state
and the GPU memory NVML (the fake library) lists for it, the node turns unfit and
SidecarNodeUnfit fires in a real Prometheus that evaluates the shipped rules (only `for:`
shortened). After the thaw the process dies, the incident records when, the node is fit again
and the alert resolves."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from alerts import build as alerts_build
from tests.alerts.realstack import Prometheus
from tests.ops.helpers import run_cli
from tests.support import Sidecar, freezer, tail, wait_until

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(not freezer.available(), reason="needs a writable cgroup v1 freezer hierarchy"),
]

# A rank as a trainer is one: trainer_hooks.Monitor, a few steps, then it says it is ready to be
# frozen and sleeps (its next step never comes).
HOOKED_RANK = r"""
import sys, time
from trainer_hooks import Monitor
mon = Monitor(job_id="frozen-job", rank=0, local_rank=0, world_size=1, local_world_size=1, flush_interval=0.1)
for step in range(1, 4):
    mon.step(step, loss=1.0)
    time.sleep(0.05)
open(sys.argv[1], "w").close()
time.sleep(600)
"""

SETTINGS = (
    "watchdog.check_interval_seconds=0.2",
    "hooks_flush_interval_seconds=0.2",
    "watchdog.floor_seconds=2",
    "watchdog.ceiling_seconds=3",
    "remediation.kill_without_restart=true",  # a plain python rank: nothing restarts it, kill it anyway
    "remediation.py_spy=false",
    "remediation.dump_wait_seconds=0.2",
    "remediation.grace_seconds=0.2",
    "remediation.kill_wait_seconds=1",
)


def fit(sidecar: Sidecar) -> float | None:
    line = next((x for x in sidecar.metrics().splitlines() if x.startswith("sidecar_node_fit ")), None)
    return None if line is None else float(line.split()[1])


def test_a_frozen_rank_is_unkillable_fires_sidecar_node_unfit_and_the_node_recovers_after_the_thaw(tmp_path):
    rules = tmp_path / "rules"
    alerts_build.write(rules, for_override="1s")
    ready = tmp_path / "ready"
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps({"gpu_count": 2}))
    with contextlib.ExitStack() as stack:
        sidecar = stack.enter_context(
            Sidecar(
                tmp_path / "sidecar",
                *SETTINGS,
                "collectors.nvml_module=sidecar.testing.fake_nvml_lib",
                env={"SIDECAR_FAKE_NVML": str(nvml)},
            )
        )
        prom = stack.enter_context(
            Prometheus(
                tmp_path / "prom", targets=[f"127.0.0.1:{sidecar.port}"], rule_files=sorted(rules.glob("*.rules.yml"))
            ).running()
        )
        env = {**sidecar.hook_env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        rank = subprocess.Popen([sys.executable, "-c", HOOKED_RANK, str(ready)], env=env, start_new_session=True)
        stack.callback(lambda: (rank.kill(), rank.wait()))
        cg = stack.enter_context(freezer.frozen_cgroup())  # thawed and emptied before the rank is reaped
        wait_until(ready.exists, 30, what="the rank's steps")
        wait_until(lambda: [r["step"] for r in sidecar.status()["ranks"]] == [3], 30, what="step 3 at the sidecar")
        # NVML lists the rank on GPU 1 (as CUDA would), and the GPU collector has seen it there.
        gpu_1 = {"processes": [{"pid": rank.pid, "used_memory_bytes": 2 << 30}]}
        nvml.write_text(json.dumps({"gpu_count": 2, "gpus": {"1": gpu_1}}))
        wait_until(
            lambda: 'sidecar_gpu_process_memory_bytes{gpu="1",job_id="frozen-job",rank="0"}' in sidecar.metrics(),
            30,
            what="the rank's GPU memory at the sidecar",
        )
        cg.add(rank.pid)
        cg.freeze()

        def explain() -> str:
            return f"\n--- sidecar\n{tail(sidecar.log, 30)}"

        firing = wait_until(lambda: prom.firing("SidecarNodeUnfit"), 60, interval=0.5, what="the alert" + explain())
        assert [(a["labels"]["reason"], a["labels"]["severity"]) for a in firing] == [("unkillable", "critical")]

        (brief,) = sidecar.status()["incidents"]  # one: a rank whose hooks fell silent stays stalled
        assert brief["outcome"] == "unkillable"
        record = json.loads(Path(brief["path"]).read_text())
        (stuck,) = record["unkillable"]
        assert (stuck["pid"], stuck["who"]) == (rank.pid, "rank 0")
        assert stuck["freezer"] == f"FROZEN in {cg.path}" and "SIGKILL" in stuck["pending_signals"]
        assert stuck["gpu_memory_bytes"] == {"1": 2 << 30}, "what it holds, from NVML's process list"
        check = run_cli("status", "--socket", sidecar.socket, "--check", "node")
        assert check.returncode == 1 and check.stdout.startswith("unfit (unkillable)"), check.stdout
        assert str(rank.pid) in check.stdout

        cg.thaw()  # the pending SIGKILL is delivered
        assert rank.wait(timeout=10) in (-signal.SIGTERM, -signal.SIGKILL)  # both were pending
        wait_until(lambda: fit(sidecar) == 1, 30, what="the node fit again" + explain())
        wait_until(lambda: not prom.firing("SidecarNodeUnfit"), 60, interval=0.5, what="the alert resolved")
        record = json.loads(Path(brief["path"]).read_text())
        assert record["timeline"][-1]["event"] == "unkillable_gone"
        assert run_cli("status", "--socket", sidecar.socket, "--check", "node").returncode == 0
