"""The node collector: CPU, memory, load, checkpoint filesystem, and the versions info series."""

from __future__ import annotations

import os
import platform

from sidecar.collectors.node import NodeCollector, online_cpus, os_name, read_load1
from tests.collectors.helpers import run, series


def collect(tmp_path, jobs=None, driver=("", "")):
    result = run(NodeCollector(str(tmp_path), lambda: jobs or {}, lambda: driver))
    assert result.success, result.error
    return result.families


def value(families, name):
    (v,) = series(families, name).values()
    return v


def test_cpu_memory_and_load_are_exported(tmp_path):
    families = collect(tmp_path)
    assert 0 <= value(families, "sidecar_node_cpu_utilization_ratio") <= 1
    total = value(families, "sidecar_node_memory_total_bytes")
    assert total >= value(families, "sidecar_node_memory_available_bytes") > 0
    assert value(families, "sidecar_node_load1") >= 0


def test_load_and_cpus_are_read_from_the_roots_the_settings_name(tmp_path):
    """The house rule: collectors read from collectors.procfs_root / sysfs_root (a container's
    mounted host /proc and /sys), never the sidecar's own: before, os.getloadavg() ignored it."""
    proc, sys_root = tmp_path / "proc", tmp_path / "sys"
    proc.mkdir()
    (proc / "loadavg").write_text("37.50 20.00 10.00 3/900 12345\n")
    cpu = sys_root / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text("0-63,65,70-71\n")
    result = run(NodeCollector(str(tmp_path), dict, procfs_root=str(proc), sysfs_root=str(sys_root)))
    assert result.success, result.error
    assert value(result.families, "sidecar_node_load1") == 37.5
    assert value(result.families, "sidecar_node_cpus") == 67
    assert read_load1(str(tmp_path / "nowhere")) is None and online_cpus(str(tmp_path / "nowhere")) is None
    assert online_cpus() == len(os.sched_getaffinity(0)) or online_cpus() >= 1  # this machine's own


def test_the_checkpoint_filesystem_is_measured(tmp_path):
    families = collect(tmp_path)
    fs = os.statvfs(tmp_path)
    assert value(families, "sidecar_checkpoint_filesystem_size_bytes") == fs.f_blocks * fs.f_frsize
    assert 0 < value(families, "sidecar_checkpoint_filesystem_avail_bytes") <= fs.f_blocks * fs.f_frsize


def test_a_missing_checkpoint_directory_has_no_series(tmp_path):
    families = collect(tmp_path / "not-yet")
    assert not series(families, "sidecar_checkpoint_filesystem_avail_bytes")


def test_versions_without_a_job_have_one_series_with_empty_job_id(tmp_path):
    (labels,) = series(collect(tmp_path), "sidecar_versions_info")
    labels = dict(labels)
    assert labels["job_id"] == "" and labels["driver_version"] == "" and labels["kernel"] == platform.release()


def test_versions_have_one_series_per_job_with_driver_from_nvml(tmp_path):
    jobs = {"run-1": {"torch": "2.13.0", "cuda": "12.8", "nccl": "2.27.3"}, "run-2": {"torch": "2.4.0"}}
    info = [dict(k) for k in series(collect(tmp_path, jobs, ("550.54.15", "12.4")), "sidecar_versions_info")]
    by_job = {i["job_id"]: i for i in info}
    assert set(by_job) == {"run-1", "run-2"}
    assert by_job["run-1"]["torch_version"] == "2.13.0" and by_job["run-1"]["nccl_version"] == "2.27.3"
    assert by_job["run-2"]["nccl_version"] == ""
    assert by_job["run-2"]["driver_version"] == "550.54.15" and by_job["run-2"]["cuda_version"] == "12.4"


def test_os_name_comes_from_os_release(tmp_path):
    path = tmp_path / "os-release"
    path.write_text('NAME="Ubuntu"\nVERSION_ID="22.04"\nPRETTY_NAME="Ubuntu 22.04.4 LTS"\n')
    assert os_name(path) == "Ubuntu 22.04.4 LTS"
    path.write_text('NAME="Rocky Linux"\nVERSION_ID="9.3"\n')
    assert os_name(path) == "Rocky Linux 9.3"
    assert os_name(tmp_path / "missing") == ""
