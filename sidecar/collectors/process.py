"""Per-rank process metrics: each registered rank's process together with its descendants
(data-loader workers, compile workers), so a leak or a runaway worker shows on the rank that
owns it. A rank whose process is gone has no series."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

import psutil
from prometheus_client.core import Metric

from sidecar.collectors.base import BuildContext, PartialFailure
from sidecar.collectors.ranktree import RanksFn, tree_pids
from sidecar.metric import spec

NAME = "process"
R = ("job_id", "rank")

CPU_SECONDS = spec(
    NAME,
    "process_cpu_seconds",
    "counter",
    "CPU time (user + system) of the rank and its children, including children they have already reaped.",
    R,
)
RESIDENT_MEMORY = spec(
    NAME,
    "process_resident_memory_bytes",
    "gauge",
    "Resident memory of the rank and its children (shared pages count once per process).",
    R,
)
THREADS = spec(NAME, "process_threads", "gauge", "Threads of the rank and its children.", R)
OPEN_FDS = spec(NAME, "process_open_fds", "gauge", "Open file descriptors of the rank and its children.", R)
CHILDREN = spec(NAME, "process_children", "gauge", "Live descendant processes of the rank.", R)
STATE = spec(
    NAME, "process_state", "gauge", "1 for the state the rank's own process is in.", ["job_id", "rank", "state"]
)

METRICS = (CPU_SECONDS, RESIDENT_MEMORY, THREADS, OPEN_FDS, CHILDREN, STATE)

STATES = ("running", "sleeping", "disk_sleep", "stopped", "zombie", "other")
_STATE_OF = {
    psutil.STATUS_RUNNING: "running",
    psutil.STATUS_SLEEPING: "sleeping",
    psutil.STATUS_IDLE: "sleeping",
    psutil.STATUS_DISK_SLEEP: "disk_sleep",
    psutil.STATUS_STOPPED: "stopped",
    psutil.STATUS_TRACING_STOP: "stopped",
    psutil.STATUS_ZOMBIE: "zombie",
}


@dataclass
class RankProcesses:
    """Sums over a rank's process tree; None where no process of the tree could report it."""

    job_id: str
    rank: int
    state: str
    children: int
    cpu_seconds: float | None = None
    resident_bytes: int | None = None
    threads: int | None = None
    open_fds: int | None = None


N = TypeVar("N", int, float)


def _add(total: N | None, value: N) -> N:
    return value if total is None else total + value


def read_rank(job_id: str, rank: int, procs: list[psutil.Process], problems: list[str]) -> RankProcesses | None:
    """Sum over the rank's process (first) and its descendants; None when the rank's process is gone."""
    root, children = procs[0], procs[1:]
    out = RankProcesses(job_id, rank, "other", len(children))
    for proc in procs:
        try:
            with proc.oneshot():
                if proc is root:
                    out.state = _STATE_OF.get(proc.status(), "other")
                t = proc.cpu_times()
                # children_* hold reaped children: counting them keeps the total from dropping
                # when a worker exits and its parent waits for it.
                out.cpu_seconds = _add(out.cpu_seconds, t.user + t.system + t.children_user + t.children_system)
                out.resident_bytes = _add(out.resident_bytes, proc.memory_info().rss)
                out.threads = _add(out.threads, proc.num_threads())
                out.open_fds = _add(out.open_fds, proc.num_fds())
        except psutil.ZombieProcess:
            if proc is root:
                out.state = "zombie"
            # exited, not yet reaped: nothing left to count
        except psutil.NoSuchProcess:
            if proc is root:
                return None
        except psutil.AccessDenied:
            problems.append(f"rank {job_id}/{rank}: no permission to read pid {proc.pid}")
    return out


class ProcessCollector:
    name = NAME
    metrics = METRICS

    def __init__(self, ranks: RanksFn):
        self.ranks = ranks
        # psutil handles kept across rounds: creating one reads /proc/<pid>/stat. Which pids
        # belong to a rank is decided afresh each round, so a reused pid is never misattributed.
        self._handles: dict[int, psutil.Process] = {}

    def _procs(self, pids: list[int]) -> list[psutil.Process] | None:
        out = []
        for pid in pids:
            proc = self._handles.get(pid)
            if proc is None:
                try:
                    proc = self._handles[pid] = psutil.Process(pid)
                except psutil.NoSuchProcess:
                    if pid == pids[0]:
                        return None
                    continue
            out.append(proc)
        return out

    def collect(self) -> Iterable[Metric]:
        problems: list[str] = []
        readings = []
        seen: set[int] = set()
        for job_id, rank, pid in self.ranks():
            pids = tree_pids(pid)
            procs = self._procs(pids) if pids else None
            if pids is None or procs is None:
                continue
            seen.update(pids)
            reading = read_rank(job_id, rank, procs, problems)
            if reading is not None:
                readings.append(reading)
        for pid in set(self._handles) - seen:
            del self._handles[pid]
        cpu, rss, threads, fds, children, state = (s.family() for s in METRICS)
        for r in readings:
            labels = [r.job_id, str(r.rank)]
            for family, value in (
                (cpu, r.cpu_seconds),
                (rss, r.resident_bytes),
                (threads, r.threads),
                (fds, r.open_fds),
                (children, r.children),
            ):
                if value is not None:
                    family.add_metric(labels, value)
            for s in STATES:
                state.add_metric(labels + [s], 1.0 if s == r.state else 0.0)
        families = [f for f in (cpu, rss, threads, fds, children, state) if f.samples]
        if problems:
            raise PartialFailure("; ".join(problems[:5]), families)
        return families


def build(context: BuildContext) -> ProcessCollector:
    return ProcessCollector(context.ranks)
