"""What the exit tracker needs of the GPUs to tell a rank that died of a GPU error (`gpu_error`):
the latest XID of each GPU, and which GPUs each rank's processes hold. The gpu collector gives
both as part of its metrics; where dcgm-exporter is the cluster's GPU source
(`collectors.gpu_source: dcgm`) that collector is off, and `GpuEvents` gives them alone: the same
XID event thread (`xid.py`) on its own NVML session, and each round only NVML's list of compute
processes per GPU, no metrics (dcgm-exporter exports those; docs/dcgm.md says why not read its
XID gauge instead).

`rank_gpus` (below) maps processes to ranks for both, so the two modes attribute GPUs alike."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from sidecar.collectors.nvml import GpuLost, NvmlSession
from sidecar.collectors.ranktree import RanksFn, pid_owners
from sidecar.collectors.xid import XidWatcher
from sidecar.config import Settings

log = logging.getLogger(__name__)

RankGpus = dict[tuple[str, int], set[str]]  # (job_id, rank) -> the GPUs its processes hold


def start_xid_watcher(session: NvmlSession) -> XidWatcher | None:
    """An XID event thread for every GPU that has a handle; None when the session closed."""
    handles = {}
    for index in range(session.count):
        try:
            handles[str(index)] = session.handle(index)
        except GpuLost:
            pass
    if session.nv is None:
        return None
    watcher = XidWatcher(session.nv, handles)
    watcher.start()
    return watcher


def owners_of(processes: list[tuple[str, list[tuple[int, int]]]], ranks: RanksFn) -> dict[int, tuple[str, int]]:
    """pid -> (job_id, rank) of every rank's process tree; not walked when no GPU has a process."""
    return pid_owners(ranks()) if any(procs for _, procs in processes) else {}


def rank_gpus(processes: Iterable[tuple[str, list[tuple[int, int]]]], owners: dict[int, tuple[str, int]]) -> RankGpus:
    """From (gpu, [(pid, used bytes)]) per GPU and `owners_of`: the GPUs each rank's tree holds."""
    out: RankGpus = {}
    for gpu, procs in processes:
        for pid, _ in procs:
            owner = owners.get(pid)
            if owner is not None:
                out.setdefault(owner, set()).add(gpu)
    return out


class GpuEvents:
    """XIDs and the ranks' GPUs without GPU metrics. `refresh` blocks on NVML: run it off the
    event loop, once a collector interval."""

    def __init__(self, nvml_module: str, ranks: RanksFn):
        self.session = NvmlSession(nvml_module)
        self.ranks = ranks
        self.xid: XidWatcher | None = None
        self.rank_gpus: RankGpus = {}

    def last_xids(self) -> dict[str, tuple[int, float]]:
        """gpu -> (latest XID, Unix time) since the sidecar started."""
        return self.xid.snapshot()[1] if self.xid is not None else {}

    def refresh(self) -> None:
        if not self.session.start():
            return
        if self.xid is None:
            self.xid = start_xid_watcher(self.session)
        per_gpu = []
        for index in range(self.session.count):
            try:
                per_gpu.append((str(index), self.session.processes(index)))
            except GpuLost as e:
                log.debug("%s", e)  # the XID thread and dcgm-exporter report the lost GPU
        self.rank_gpus = rank_gpus(per_gpu, owners_of(per_gpu, self.ranks))

    def close(self) -> None:
        if self.xid is not None:
            self.xid.stop()
        self.session.close()


def build(settings: Settings, ranks: RanksFn) -> GpuEvents | None:
    """The XID source of the dcgm GPU source; None where the gpu collector gives XIDs itself
    (the `sidecar` source), where XID events are off, or where no GPU collector is wanted."""
    cfg = settings.collectors
    if cfg.gpu_source != "dcgm" or not cfg.xid_events or "gpu" not in cfg.enabled:
        return None
    return GpuEvents(cfg.nvml_module, ranks)
