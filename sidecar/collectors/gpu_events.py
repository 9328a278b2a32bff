"""What the exit tracker needs of the GPUs to tell a rank that died of a GPU error (`gpu_error`):
the latest XID of each GPU, and which GPUs each rank's processes hold. The gpu collector gives
both as part of its metrics; where dcgm-exporter is the cluster's GPU source
(`collectors.gpu_source: dcgm`) that collector is off, and `GpuEvents` gives them alone: the same
XID event thread (`xid.py`) on its own NVML session, and each round only NVML's list of compute
processes per GPU, no metrics (dcgm-exporter exports those; docs/dcgm.md says why not read its
XID gauge instead).

`rank_gpus` (below) maps processes to ranks for both, so the two modes attribute GPUs alike, and
both feed the GPU side of the node verdict (`gpu_fitness.py`) from the same process lists. The
ranks handed to both are the verified ones (the daemon passes registry.verified_live_pids): an
unverified registration's pid is only a claim and stands for no GPU use."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from sidecar.collectors.gpu_fitness import GpuFitness
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


def memory_by_pid(processes: Iterable[tuple[str, list[tuple[int, int]]]]) -> dict[int, dict[str, int]]:
    """pid -> {gpu: used bytes}, from (gpu, [(pid, used bytes)]) per GPU."""
    out: dict[int, dict[str, int]] = {}
    for gpu, procs in processes:
        for pid, used in procs:
            per_gpu = out.setdefault(pid, {})
            per_gpu[gpu] = per_gpu.get(gpu, 0) + used
    return out


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

    def __init__(self, nvml_module: str, ranks: RanksFn, xid_events: bool = True, fitness: GpuFitness | None = None):
        self.session = NvmlSession(nvml_module)
        self.ranks = ranks
        self.xid_events = xid_events
        self.xid: XidWatcher | None = None
        self.rank_gpus: RankGpus = {}
        self.fitness = fitness or GpuFitness()
        self._memory_by_pid: dict[int, dict[str, int]] = {}

    def gpu_memory(self) -> dict[int, dict[str, int]]:
        """pid -> {gpu: bytes} of every compute process NVML listed last round."""
        return self._memory_by_pid

    def last_xids(self) -> dict[str, tuple[int, float]]:
        """gpu -> (latest XID, Unix time) since the sidecar started."""
        return self.xid.snapshot()[1] if self.xid is not None else {}

    def refresh(self) -> None:
        if not self.session.start():
            self.fitness.unavailable(self.session.broken or self.session.absent or "not initialized")
            self._memory_by_pid = {}
            return
        if self.xid_events and self.xid is None:
            self.xid = start_xid_watcher(self.session)
        per_gpu, lost = [], []
        for index in range(self.session.count):
            try:
                per_gpu.append((str(index), self.session.processes(index)))
            except GpuLost as e:
                lost.append(str(index))
                log.debug("%s", e)  # the XID thread and dcgm-exporter report the lost GPU
        owners = owners_of(per_gpu, self.ranks)
        self.rank_gpus = rank_gpus(per_gpu, owners)
        self._memory_by_pid = memory_by_pid(per_gpu)
        self.fitness.observe(self.session.count, lost, per_gpu, owners)

    def close(self) -> None:
        if self.xid is not None:
            self.xid.stop()
        self.session.close()


def build(settings: Settings, ranks: RanksFn) -> GpuEvents | None:
    """The XID source (and the GPU side of the node verdict) of the dcgm GPU source; None where
    the gpu collector gives them itself (the `sidecar` source), where no GPU collector is
    wanted, or where neither XID events nor expected_gpus ask for NVML."""
    cfg = settings.collectors
    if cfg.gpu_source != "dcgm" or "gpu" not in cfg.enabled or not (cfg.xid_events or cfg.expected_gpus):
        return None
    return GpuEvents(cfg.nvml_module, ranks, xid_events=cfg.xid_events, fitness=GpuFitness.for_settings(cfg))
