"""Exclusion at the next restart (issue 30, item 4), end to end on one node: two real gloo ranks with
`Monitor` hooks, rank 1 computing 100 ms longer per step, on a GPU (the fake NVML library, which the
real collector reads) whose clocks are held down by a thermal slowdown. With
`job_view.straggler_exclude_after_seconds` set, the sidecar names rank 1 its job's straggler with the
cause `throttled` in the hardware, marks the node (fitness `straggler`: `sidecar status --check node`
exits 1 for node-problem-detector), and the bare-metal launcher with LEAVE_IF_UNFIT=1 then leaves
the job instead of joining it; before the mark it joins. Nothing is killed: both ranks run on."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.hooks.test_collectives_lateness import GLOO_RANK, Job
from tests.ops.helpers import run_cli
from tests.support import PYTHON, ROOT, Sidecar, cgroup_cpu

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lateness")]

HW_THERMAL_SLOWDOWN = 0x40  # nvmlClocksEventReasonHwThermalSlowdown
FAKE = "collectors.nvml_module=sidecar.testing.fake_nvml_lib"


def _nvml(path, gpus: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpu_count": 2, "gpus": gpus}))
    os.replace(tmp, path)  # the fake re-reads the file when it changes: never half written


def _launch(sidecar: Sidecar, tmp_path) -> subprocess.CompletedProcess:
    env = {
        "PATH": f"{os.path.dirname(PYTHON)}:/usr/bin:/bin",
        "DRY_RUN": "1",
        "PREFLIGHT": "0",
        "LEAVE_IF_UNFIT": "1",
        "NNODES": "2:3",
        "RDZV_ENDPOINT": "node-0:29400",
        "CONFIG": "train.yaml",
        "SIDECAR_SOCKET": sidecar.socket,
    }
    return subprocess.run(
        ["bash", str(ROOT / "deploy/baremetal/torchrun-launch.sh")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
    )  # fmt: skip


def test_a_straggler_on_a_hot_gpu_marks_its_node_and_the_launcher_leaves_the_job_at_the_next_start(tmp_path):
    spec = tmp_path / "nvml.json"
    _nvml(spec, {})
    settings = ("watchdog.observe_only=true", "hooks_flush_interval_seconds=0.5",
                "job_view.straggler_exclude_after_seconds=5")  # fmt: skip
    with Sidecar(tmp_path / "sidecar", FAKE, *settings, env={"SIDECAR_FAKE_NVML": str(spec)}) as sidecar:
        joined = _launch(sidecar, tmp_path)  # a fit node joins: the torchrun command is run (printed here)
        assert joined.returncode == 0 and "torch.distributed.run" in joined.stdout, joined.stdout + joined.stderr
        job = Job(tmp_path, sidecar, "hot-job", slow=True)
        try:
            gpu = lambda pid, reasons: {"processes": [{"pid": pid, "used_memory_bytes": 2 << 30}],  # noqa: E731
                                        "clock_event_reasons": reasons}  # fmt: skip
            _nvml(spec, {"0": gpu(job.procs[0].pid, 0), "1": gpu(job.procs[1].pid, HW_THERMAL_SLOWDOWN)})
            deadline, check = time.monotonic() + 150, None
            while time.monotonic() < deadline:
                job.check_alive()
                check = run_cli("status", "--check", "node", "--socket", sidecar.socket)
                if check.returncode == 1:
                    break
                time.sleep(1)
            assert check is not None and check.returncode == 1, (check and check.stdout, sidecar.status()["stragglers"])
            assert check.stdout.startswith(
                "unfit (straggler): straggler: job hot-job: rank 1 has been its straggler"
            ), check.stdout
            assert "GPU 1 clocks held down (hw_thermal_slowdown)" in check.stdout, check.stdout

            status = sidecar.status()
            named = [(s["rank"], s.get("cause")) for j in status["stragglers"] if j["job_id"] == "hot-job"
                     for s in j["stragglers"]]  # fmt: skip
            assert set(named) == {(1, "throttled")}, status["stragglers"]  # judged by the node and the coordinator
            (incident,) = [i for i in status["incidents"] if i.get("kind") == "straggler"]
            assert incident["straggler"]["hardware"] is True and incident["blamed_rank"] == 1, incident

            left = _launch(sidecar, tmp_path)
            assert left.returncode == 0 and left.stdout == "", left.stdout + left.stderr
            assert "leaves the job: sidecar says unfit (straggler)" in left.stderr, left.stderr
            assert "the other nodes form the job without it" in left.stderr, left.stderr
            # reported and marked, never killed
            job.check_alive()
            assert {r["state"] for r in status["ranks"] if r["job_id"] == "hot-job"} == {"healthy"}
        finally:
            job.close()


# The same DDP-like step, its compute spent on the CPU (process time), so that a CPU quota slows it.
BUSY_RANK = GLOO_RANK.replace(
    "    time.sleep(compute + (extra if slow and rank == 1 and step >= slow_from else 0.0))\n",
    "    end = time.process_time() + compute\n    while time.process_time() < end:\n        pass\n",
)


assert BUSY_RANK != GLOO_RANK, "the step's sleep was not replaced"


@pytest.mark.skipif(cgroup_cpu.unavailable() is not None, reason=str(cgroup_cpu.unavailable()))
def test_a_rank_held_by_a_real_cpu_quota_is_named_throttled_and_its_node_is_not_marked(tmp_path):
    """The CPU cause end to end: rank 1 of two real gloo ranks, both computing 50 ms of CPU time per
    step, is put under a cgroup v1 quota of 20% of a CPU. The sidecar names it the job's straggler
    with the cause `throttled` and the cgroup's counters as evidence; exclusion is on, yet the node
    stays fit: a CPU quota is the job's own setting, not the node's hardware."""
    settings = ("watchdog.observe_only=true", "hooks_flush_interval_seconds=0.5",
                "job_view.straggler_exclude_after_seconds=5")  # fmt: skip
    with Sidecar(tmp_path / "sidecar", *settings) as sidecar:
        job = Job(tmp_path, sidecar, "quota-job", slow=False, script=BUSY_RANK)
        try:
            deadline = time.monotonic() + 60
            while job.last_step(1) < 5:
                job.check_alive()
                assert time.monotonic() < deadline, "the job did not start"
                time.sleep(0.2)
            with cgroup_cpu.cpu_quota(job.procs[1].pid, 20_000, "test-straggler-quota"):
                deadline, named = time.monotonic() + 150, []
                while time.monotonic() < deadline:
                    job.check_alive()
                    status = sidecar.status()
                    named = [(s["rank"], s.get("cause"), s.get("cause_evidence")) for j in status["stragglers"]
                             if j["job_id"] == "quota-job" for s in j["stragglers"]]  # fmt: skip
                    if named and all(cause == "throttled" for _, cause, _ in named):
                        break
                    time.sleep(1)
                print(f"\nquota: named {named}; lateness {job.lateness(sidecar)}")
                assert named and {rank for rank, _, _ in named} == {1}, status["stragglers"]
                assert all(c == "throttled" and "CPU cgroup throttled" in (e or "") for _, c, e in named), named
                time.sleep(6)  # past exclude_after: still fit, a CPU quota never marks the node
                check = run_cli("status", "--check", "node", "--socket", sidecar.socket)
                assert check.returncode == 0 and check.stdout.strip() == "fit", check.stdout
                (incident,) = [i for i in sidecar.status()["incidents"] if i.get("kind") == "straggler"]
                assert incident["straggler"]["hardware"] is False and incident["blamed_rank"] == 1, incident
        finally:
            job.close()
