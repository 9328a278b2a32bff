"""The hardware collectors (gpu, nic, process, node), built from settings. Each lives in its own
module; this package only assembles the enabled ones."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # keep `import sidecar.collectors` light: `sidecar metrics-doc` imports it
    from sidecar.collectors.base import Collector
    from sidecar.config import Settings


def build_collectors(settings: Settings, ranks: Callable[[], list[tuple[str, int, int]]],
                     job_versions: Callable[[], dict[str, dict[str, str]]]) -> list[Collector]:
    """The collectors named in `settings.collectors.enabled`, in that order.

    `ranks()` returns (job_id, rank, pid) of the live registered ranks; `job_versions()`
    returns {job_id: {"torch": ..., "cuda": ..., "nccl": ...}} as the ranks reported them.
    Both are called from executor threads.
    """
    import psutil

    from sidecar.collectors.gpu import GpuCollector
    from sidecar.collectors.nic import NicCollector
    from sidecar.collectors.node import NodeCollector
    from sidecar.collectors.process import ProcessCollector

    cfg = settings.collectors
    if cfg.procfs_root.rstrip("/") not in ("", "/proc"):
        psutil.PROCFS_PATH = cfg.procfs_root  # psutil reads one procfs for the whole process
    # With dcgm-exporter as the GPU source, no second NVML poller (docs/dcgm.md).
    gpu_on = "gpu" in cfg.enabled and cfg.gpu_source == "sidecar"
    gpu = GpuCollector(cfg.nvml_module, ranks, xid_events=cfg.xid_events) if gpu_on else None
    no_gpu_versions = lambda: ("", "")  # noqa: E731
    build: dict[str, Callable[[], Collector]] = {
        "nic": lambda: NicCollector(cfg.sysfs_root, cfg.nic_exclude, cfg.max_nics),
        "process": lambda: ProcessCollector(ranks),
        "node": lambda: NodeCollector(settings.checkpoint_dir, job_versions,
                                      gpu.versions if gpu is not None else no_gpu_versions),
    }
    out: list[Collector] = []
    for name in dict.fromkeys(cfg.enabled):
        if name != "gpu":
            out.append(build[name]())
        elif gpu is not None:
            out.append(gpu)
    return out
