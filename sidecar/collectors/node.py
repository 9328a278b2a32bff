"""Node metrics: CPU and memory, load, free space where checkpoints go, and the software versions
that matter when a job misbehaves after an upgrade (driver, CUDA, torch, NCCL, kernel, OS)."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil
from prometheus_client.core import Metric

from sidecar.collectors.base import BuildContext
from sidecar.metric import spec

NAME = "node"

CPU_UTILIZATION = spec(NAME, "node_cpu_utilization_ratio", "gauge", "Share of all CPUs busy since the previous sample.")
MEMORY_TOTAL = spec(NAME, "node_memory_total_bytes", "gauge", "Physical memory.")
MEMORY_AVAILABLE = spec(
    NAME, "node_memory_available_bytes", "gauge", "Memory available to new work without swapping (MemAvailable)."
)
LOAD1 = spec(NAME, "node_load1", "gauge", "1-minute load average (procfs_root/loadavg).")
CPUS = spec(
    NAME, "node_cpus", "gauge",
    "Online CPUs (sysfs_root/devices/system/cpu/online): divide load or busy cores by it for per-CPU thresholds.",
)  # fmt: skip
CHECKPOINT_SIZE = spec(
    NAME, "checkpoint_filesystem_size_bytes", "gauge", "Size of the filesystem holding the checkpoint directory."
)
CHECKPOINT_AVAIL = spec(
    NAME,
    "checkpoint_filesystem_avail_bytes",
    "gauge",
    "Space on the checkpoint filesystem available to unprivileged users.",
)
VERSIONS = spec(
    NAME,
    "versions",
    "info",
    "Software versions, one series per registered job (job_id is empty when none is "
    "registered); driver and CUDA come from NVML, torch and NCCL from the ranks.",
    ["job_id", "driver_version", "cuda_version", "torch_version", "nccl_version", "kernel", "os"],
)

METRICS = (CPU_UTILIZATION, MEMORY_TOTAL, MEMORY_AVAILABLE, LOAD1, CPUS, CHECKPOINT_SIZE, CHECKPOINT_AVAIL, VERSIONS)

JobVersionsFn = Callable[[], dict[str, dict[str, str]]]
DriverVersionsFn = Callable[[], tuple[str, str]]


def os_name(os_release: str | Path = "/etc/os-release") -> str:
    """PRETTY_NAME from os-release ("Debian GNU/Linux 12 (bookworm)"); "" when unreadable."""
    fields: dict[str, str] = {}
    try:
        for line in Path(os_release).read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep:
                fields[key.strip()] = value.strip().strip('"').strip("'")
    except OSError:
        return ""
    return fields.get("PRETTY_NAME") or " ".join(v for v in (fields.get("NAME"), fields.get("VERSION_ID")) if v)


class NodeCollector:
    name = NAME
    metrics = METRICS

    def __init__(
        self,
        checkpoint_dir: str,
        job_versions: JobVersionsFn,
        driver_versions: DriverVersionsFn = lambda: ("", ""),
        os_release: str = "/etc/os-release",
        procfs_root: str = "/proc",
        sysfs_root: str = "/sys",
    ):
        self.checkpoint_dir = checkpoint_dir
        self.procfs_root, self.sysfs_root = procfs_root, sysfs_root
        self.job_versions = job_versions
        self.driver_versions = driver_versions
        self.kernel = platform.release()
        self.os = os_name(os_release)
        psutil.cpu_percent(interval=None)  # the first call only sets the baseline

    def collect(self) -> Iterable[Metric]:
        cpu, total, available, load1, cpus, ckpt_size, ckpt_avail, versions = (s.family() for s in METRICS)
        cpu.add_metric([], psutil.cpu_percent(interval=None) / 100.0)
        memory = psutil.virtual_memory()
        total.add_metric([], memory.total)
        available.add_metric([], memory.available)
        if (load := read_load1(self.procfs_root)) is not None:
            load1.add_metric([], load)
        if (online := online_cpus(self.sysfs_root)) is not None:
            cpus.add_metric([], online)
        try:
            fs = os.statvfs(self.checkpoint_dir) if self.checkpoint_dir else None
        except OSError:
            fs = None  # no checkpoint directory (yet): no series
        if fs is not None:
            ckpt_size.add_metric([], fs.f_blocks * fs.f_frsize)
            ckpt_avail.add_metric([], fs.f_bavail * fs.f_frsize)
        driver, cuda = self.driver_versions()
        jobs = self.job_versions() or {"": {}}
        for job_id, v in sorted(jobs.items()):
            versions.add_metric(
                [job_id, driver, cuda, str(v.get("torch") or ""), str(v.get("nccl") or ""), self.kernel, self.os], {}
            )
        return [f for f in (cpu, total, available, load1, cpus, ckpt_size, ckpt_avail, versions) if f.samples]


def read_load1(procfs_root: str = "/proc") -> float | None:
    """The 1-minute load average from `<procfs_root>/loadavg` (the root the settings name, like
    every collector's reads), or None when it cannot be read."""
    try:
        with open(os.path.join(procfs_root, "loadavg")) as f:
            return float(f.read(256).split()[0])
    except (OSError, ValueError, IndexError):
        return None


def online_cpus(sysfs_root: str = "/sys") -> int | None:
    """How many CPUs are online, from `<sysfs_root>/devices/system/cpu/online` ("0-63,65"), or None."""
    try:
        with open(os.path.join(sysfs_root, "devices", "system", "cpu", "online")) as f:
            text = f.read(4096).strip()
        count = 0
        for part in text.split(","):
            first, _, last = part.partition("-")
            count += (int(last) - int(first) + 1) if last else 1
        return count if count > 0 else None
    except (OSError, ValueError):
        return None


def build(context: BuildContext) -> NodeCollector:
    gpu = context.built.get("gpu")
    versions = getattr(gpu, "versions", None) or _no_gpu_versions
    c = context.settings.collectors
    return NodeCollector(
        context.settings.checkpoint_dir, context.job_versions, versions,
        procfs_root=c.procfs_root, sysfs_root=c.sysfs_root,
    )  # fmt: skip


def _no_gpu_versions() -> tuple[str, str]:
    return ("", "")
