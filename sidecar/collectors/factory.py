"""Building the enabled hardware collectors from settings: each collector module's `build`
gets one `BuildContext` (its settings, what it may read of the registry, the collectors built
before it), in the order `config.COLLECTORS` lists them."""

from __future__ import annotations

import importlib

import psutil

from sidecar.collectors.base import BuildContext, Collector
from sidecar.collectors.node import JobVersionsFn
from sidecar.collectors.ranktree import RanksFn
from sidecar.config import COLLECTORS, Settings


def build_collectors(
    settings: Settings, ranks: RanksFn, job_versions: JobVersionsFn, live_ranks: RanksFn | None = None
) -> list[Collector]:
    """The collectors named in `settings.collectors.enabled`, in that order. A collector whose
    `build` returns None is off (the GPU collector where dcgm-exporter is the GPU source).
    `ranks`: the live ranks /metrics shows; `live_ranks`: all of them (default: `ranks`)."""
    cfg = settings.collectors
    if cfg.procfs_root.rstrip("/") not in ("", "/proc"):
        psutil.PROCFS_PATH = cfg.procfs_root  # psutil reads one procfs for the whole process
    context = BuildContext(settings, ranks, job_versions, live_ranks=live_ranks)
    wanted = set(cfg.enabled)
    for name, module in COLLECTORS.items():
        if name in wanted:
            collector = importlib.import_module(module).build(context)
            if collector is not None:
                context.built[name] = collector
    return [context.built[name] for name in dict.fromkeys(cfg.enabled) if name in context.built]
