"""All hardware collectors as the daemon builds them, rendered by prometheus-client and linted by
the real `promtool check metrics`."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from sidecar.collectors.base import CollectorRunner
from sidecar.collectors.factory import build_collectors
from sidecar.config import load_settings
from tests.collectors.helpers import FAKE, FIXTURE_SYSFS, by_label, exposition, series
from tests.support import wait_until

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
SPEC = {
    "gpu_count": 8,
    "xid_events": [{"gpu": 2, "xid": 79}],
    "gpus": {"6": {"errors": {"nvmlDeviceGetPowerUsage": "not_supported"}}},
}


@pytest.fixture
def collectors(tmp_path, fake_gpus, rank_process):
    proc, _ = rank_process()
    fake_gpus({**SPEC, "gpus": {**SPEC["gpus"], "0": {"processes": [{"pid": proc.pid, "used_memory_bytes": 2**30}]}}})
    settings = load_settings(
        environ={},
        overrides={
            "collectors.nvml_module": FAKE,
            "collectors.sysfs_root": str(FIXTURE_SYSFS),
            "checkpoint_dir": str(tmp_path),
        },
    )
    built = build_collectors(
        settings,
        ranks=lambda: [("run-42", 0, proc.pid)],
        job_versions=lambda: {"run-42": {"torch": "2.13.0", "cuda": "12.8", "nccl": "2.27.3"}},
    )
    yield built
    for c in built:
        getattr(c, "close", lambda: None)()


def run_all(collectors) -> CollectorRunner:
    runner = CollectorRunner(collectors, interval=1.0)
    for c in collectors:
        runner.results[c.name] = runner.run_once_sync(c)
    return runner


def test_build_collectors_returns_the_enabled_ones_in_order(tmp_path):
    settings = load_settings(environ={}, overrides={"collectors.enabled": ["node", "nic"]})
    assert [c.name for c in build_collectors(settings, lambda: [], lambda: {})] == ["node", "nic"]
    every = build_collectors(load_settings(environ={}), lambda: [], lambda: {})
    assert [c.name for c in every] == ["gpu", "nic", "process", "node"]


def test_the_node_collector_reports_the_gpu_drivers_versions(collectors):
    runner = run_all(collectors)  # the gpu collector runs first and opens NVML
    info = series(runner.results["node"].families, "sidecar_versions_info")
    (labels,) = [dict(k) for k in info]
    assert labels["driver_version"] == "550.54.15" and labels["cuda_version"] == "12.4"
    assert labels["job_id"] == "run-42" and labels["torch_version"] == "2.13.0"


def test_every_collector_succeeds_on_a_healthy_node(collectors):
    runner = run_all(collectors)
    assert {name: r.error for name, r in runner.results.items() if not r.success} == {}
    families = list(runner.families())
    assert by_label(families, "sidecar_scrape_collector_success", "collector") == {
        "gpu": 1,
        "nic": 1,
        "process": 1,
        "node": 1,
    }
    assert series(families, "sidecar_gpu_process_memory_bytes") == {
        (("gpu", "0"), ("job_id", "run-42"), ("rank", "0")): 2**30
    }


@pytest.mark.system
def test_promtool_accepts_the_exposition(collectors):
    gpu = collectors[0]
    run_all(collectors)
    wait_until(lambda: gpu.xid.snapshot()[0], 10, what="the XID event")
    text = exposition(list(run_all(collectors).families()))
    for family in (
        "sidecar_gpu_xid_errors_total",
        "sidecar_network_up",
        "sidecar_infiniband_port_up",
        "sidecar_process_resident_memory_bytes",
        "sidecar_versions_info",
        "sidecar_gpu_nvlink_up",
    ):
        assert f"\n{family}{{" in text, family
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check.stdout + check.stderr
