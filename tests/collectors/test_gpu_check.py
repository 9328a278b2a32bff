"""bench/gpu_check.py: skips cleanly without a driver, passes on the fake library when every
missing family is explained, and fails a family missing without a reason."""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check
from tests.collectors.helpers import exposition, run

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, **(env or {})},
    )


def test_it_skips_cleanly_without_a_driver():
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has the NVIDIA driver")
    proc = _gpu_check()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("no NVIDIA driver: skipped")


@pytest.mark.system
def test_it_passes_on_the_fake_library_when_each_missing_family_has_a_reason(tmp_path):
    spec = tmp_path / "nvml.json"
    errors = {"nvmlDeviceGetPowerUsage": "no_permission"}
    spec.write_text(json.dumps({"gpu_count": 2, "gpus": {"1": {"errors": errors}}}))
    proc = _gpu_check(
        "--nvml-module", "sidecar.testing.fake_nvml_lib", "--rounds", "2", env={"SIDECAR_FAKE_NVML": str(spec)}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "promtool check metrics: ok" in proc.stdout
    assert "gpu 1: sidecar_gpu_power_watts unavailable (power: no_permission)" in proc.stdout
    assert "NVML calls per GPU per round" in proc.stdout and proc.stdout.rstrip().endswith("gpu check: passed")


def test_a_family_missing_without_a_reason_fails(fake_gpus, gpu_collector):
    fake_gpus({"gpu_count": 2})
    text = exposition(run(gpu_collector(xid_events=False)).families)
    assert gpu_check.check_families(text)[1] == []
    without = "\n".join(
        line for line in text.splitlines() if not line.startswith('sidecar_gpu_temperature_celsius{gpu="1"}')
    )
    failures = gpu_check.check_families(without)[1]
    assert failures == [
        (
            "gpu 1: sidecar_gpu_temperature_celsius missing and no reason reported "
            "(sidecar_gpu_field_unavailable has none of temperature)"
        )
    ]
