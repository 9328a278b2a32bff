"""The node verdict on a real sidecar over the fake NVML library: GPUs missing, NVML unavailable
where GPUs are expected, and GPU memory held by a worker whose rank is gone make the node unfit,
in `/metrics` (sidecar_node_fit, sidecar_node_unfit_reason), `/v1/status`, `sidecar status` (exit
1, UNFIT), `sidecar status --check node` (node-problem-detector's protocol: 0 fit, 1 unfit, 2
unknown) and `sidecar preflight` (FAIL); the verdict returns to fit when the cause is gone.
Before, such a node was HEALTHY and its exit status 0."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.config import load_settings
from sidecar.preflight import gpu_checks, node_checks
from sidecar.preflight.results import Context
from sidecar.testing import fake_nvml, fake_nvml_lib
from tests.ops.helpers import post, preflight_args, run_cli
from tests.support import Sidecar, wait_until

FAKE = "collectors.nvml_module=sidecar.testing.fake_nvml_lib"


def sample(sidecar: Sidecar, name: str, **labels: str) -> float | None:
    """The value of the first sample `name` in /metrics whose labels include `labels`."""
    for family in text_string_to_metric_families(sidecar.metrics()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def gpus(tmp_path, count: int, **per_gpu: dict) -> dict:
    spec = tmp_path / "nvml.json"
    spec.write_text(json.dumps({"gpu_count": count, "gpus": per_gpu}))
    return {"SIDECAR_FAKE_NVML": str(spec)}


def unfit(sidecar: Sidecar, reason: str) -> bool:
    return sample(sidecar, "sidecar_node_fit") == 0 and sample(sidecar, "sidecar_node_unfit_reason", reason=reason) == 1


def test_two_of_four_expected_gpus_make_the_node_unfit_and_sidecar_status_exit_1(tmp_path):
    with Sidecar(tmp_path, FAKE, "collectors.expected_gpus=4", env=gpus(tmp_path, 2)) as sidecar:
        wait_until(lambda: unfit(sidecar, "gpu_missing"), 30, what="the node unfit for gpu_missing")
        assert sample(sidecar, "sidecar_node_unfit_reason", reason="unkillable") == 0
        fitness = sidecar.status()["fitness"]
        assert fitness["fit"] is False and fitness["reasons"] == ["gpu_missing"]
        assert fitness["findings"][0]["text"].startswith("2 of 4 expected GPUs usable")

        out = run_cli("status", "--socket", sidecar.socket)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "UNFIT" in out.stdout.splitlines()[0]
        assert "node unfit (gpu_missing): 2 of 4 expected GPUs usable" in out.stdout

        check = run_cli("status", "--socket", sidecar.socket, "--check", "node")
        assert check.returncode == 1
        assert check.stdout.startswith("unfit (gpu_missing): gpu_missing: 2 of 4 expected GPUs usable")
        assert len(check.stdout.splitlines()) == 1


def test_no_nvml_on_a_node_that_expects_gpus_is_unfit_not_a_healthy_node_without_gpus(tmp_path):
    env = {"SIDECAR_FAKE_NVML": ""}  # the fake library then answers LIBRARY_NOT_FOUND, as without a driver
    with Sidecar(tmp_path, FAKE, "collectors.expected_gpus=8", env=env) as sidecar:
        wait_until(lambda: unfit(sidecar, "nvml_unavailable"), 30, what="the node unfit for nvml_unavailable")
        out = run_cli("status", "--socket", sidecar.socket, "--check", "node")
        assert out.returncode == 1 and out.stdout.startswith("unfit (nvml_unavailable)")
        assert "expects 8 GPUs" in out.stdout


def test_a_node_with_every_gpu_it_expects_is_fit(tmp_path):
    with Sidecar(tmp_path, FAKE, "collectors.expected_gpus=4", env=gpus(tmp_path, 4)) as sidecar:
        wait_until(lambda: sample(sidecar, "sidecar_gpu_info", gpu="3") is not None, 30)
        assert sample(sidecar, "sidecar_node_fit") == 1
        assert sidecar.status()["fitness"] == {"fit": True, "reasons": [], "findings": []}
        check = run_cli("status", "--socket", sidecar.socket, "--check", "node")
        assert (check.returncode, check.stdout) == (0, "fit\n")
        assert run_cli("status", "--socket", sidecar.socket).returncode == 0


def test_the_node_check_without_a_sidecar_is_unknown(tmp_path):
    out = run_cli("status", "--socket", str(tmp_path / "none.sock"), "--check", "node")
    assert out.returncode == 2 and out.stdout.startswith("unknown: ")


# A rank whose data-loader worker holds GPU memory: prints the worker's pid once it runs.
RANK_WITH_WORKER = (
    "import subprocess, sys, time; "
    "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "print(w.pid, flush=True); time.sleep(600)"
)


def register(sidecar: Sidecar, pid: int) -> None:
    status, answer = post(
        sidecar.socket,
        "/v1/register",
        {
            "job_id": "run-7",
            "rank": 0,
            "local_rank": 0,
            "world_size": 1,
            "local_world_size": 1,
            "restart_count": 0,
            "pid": pid,
            "step": None,
            "phase": None,
            "versions": {},
            "hooks_version": "0.1.0",
        },
    )
    assert status == 200, answer


def test_gpu_memory_held_by_a_worker_of_a_gone_rank_makes_the_node_unfit_until_the_worker_goes(tmp_path):
    rank = subprocess.Popen([sys.executable, "-c", RANK_WITH_WORKER], stdout=subprocess.PIPE, text=True)
    worker = int(rank.stdout.readline())
    try:
        env = gpus(tmp_path, 2, **{"1": {"processes": [{"pid": worker, "used_memory_bytes": 5 << 30}]}})
        with Sidecar(tmp_path, FAKE, "collectors.gpu_held_grace_seconds=0", env=env) as sidecar:
            register(sidecar, rank.pid)
            # Seen in the rank's tree (its memory is the rank's): then the rank dies, the worker lives on.
            wait_until(
                lambda: sample(sidecar, "sidecar_gpu_process_memory_bytes", gpu="1", job_id="run-7", rank="0"), 30
            )
            assert sample(sidecar, "sidecar_node_fit") == 1
            rank.kill()
            rank.wait()
            wait_until(lambda: unfit(sidecar, "gpu_held"), 30, what="the node unfit for gpu_held")
            (finding,) = sidecar.status()["fitness"]["findings"]
            assert finding["pids"] == [worker]
            assert f"pid {worker} (was in rank 0 of job run-7's tree) 5.0 GiB on GPU 1" in finding["text"]

            os.kill(worker, signal.SIGKILL)
            wait_until(lambda: sample(sidecar, "sidecar_node_fit") == 1, 30, what="the node fit again")
            assert run_cli("status", "--socket", sidecar.socket, "--check", "node").returncode == 0
    finally:
        rank.kill()
        rank.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


def test_preflight_fails_on_a_node_its_sidecar_finds_unfit(tmp_path):
    with Sidecar(tmp_path, FAKE, "collectors.expected_gpus=4", env=gpus(tmp_path, 2)) as sidecar:
        wait_until(lambda: unfit(sidecar, "gpu_missing"), 30)
        (result,) = node_checks.check_sidecar(Context(preflight_args(socket=sidecar.socket), load_settings(environ={})))
        assert result.outcome == "FAIL" and "finds this node unfit: gpu_missing: 2 of 4" in result.detail
        assert "runbook.md#sidecarnodeunfit" in result.hint


@pytest.fixture
def two_gpus():
    fake_nvml_lib.install()
    fake_nvml.configure({"gpu_count": 2})
    yield
    fake_nvml_lib.uninstall()
    fake_nvml.configure(None)


def test_preflight_counts_gpus_against_the_expected_gpus_setting_when_no_flag_is_given(two_gpus):
    settings = load_settings(
        overrides={"collectors.nvml_module": "sidecar.testing.fake_nvml_lib", "collectors.expected_gpus": 4},
        environ={},
    )
    (result,) = gpu_checks.check_gpu_count(Context(preflight_args(), settings))
    assert result.outcome == "FAIL" and result.detail == "2 GPUs visible, expected 4"
