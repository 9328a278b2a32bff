"""The exit tracker: it watches every registered rank process from its registration (a pidfd,
its memory cgroup) until it exits, gathers the evidence of why (the kernel's wait status, OOM
kills, XIDs on the GPUs it used, the hooks' report, the watchdog's own remediation), has
`reasons.decide` name the reason, and counts, shows and (unless clean) records it as an exit
incident. The reasons and the trust behind them: `sidecar/exits/reasons.py`."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import Metric

from sidecar.config import Settings
from sidecar.exits import kernel
from sidecar.exits.incidents import ExitIncidents
from sidecar.exits.reasons import CONSEQUENCES, Evidence, decide
from sidecar.exits.rollback import RollbackMemory
from sidecar.host.identity import PidFd
from sidecar.host.procs import is_running
from sidecar.metric import MetricSpec, spec
from sidecar.ranks.model import Rank
from sidecar.ranks.protocol import ExitReport

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
STATUS_WAIT_SECONDS = 5.0  # after the exit, how long to wait for the parent to reap it (the status)
SETTLE_SECONDS = 1.0  # a job's exits are decided together once the youngest is this old
MAX_JOBS_COUNTED = 64  # jobs whose exit counts are kept (the oldest job's are dropped beyond)

METRICS: tuple[MetricSpec, ...] = (
    spec(
        "exits",
        "rank_exits",
        "counter",
        "Rank process exits by reason: finished, watchdog, oom_killed, gpu_error, exception/cuda_oom, "
        "exception/collective_timeout, exception/communication, exception/nonfinite, exception/other, "
        "signal, nonzero_exit, unknown.",
        ["job_id", "reason"],
    ),
    spec(
        "exits",
        "job_failures",
        "counter",
        "Failures of a job's worker group on this node, by the reason of the first rank to exit (the likely "
        "cause: torchrun stops the other workers, which then exit with `signal`). Reasons as "
        "sidecar_rank_exits_total, without finished.",
        ["job_id", "reason"],
    ),
    spec(
        "exits",
        "rank_last_exit_timestamp_seconds",
        "gauge",
        "Unix time of the job's latest rank exit classified on this node, by its reason.",
        ["job_id", "reason"],
    ),
)

# --------------------------------------------------------------- the tracker


@dataclass
class _Watch:
    """One registered rank process, from registration until its exit is decided."""

    rank: Rank
    pidfd: PidFd | None  # the registration's own (identity.py), or one opened here; closed with its last holder
    cgroup: kernel.MemoryCgroup | None
    oom_baseline: int | None
    gpus: set[str] = field(default_factory=set)
    deregistered: str | None = None
    report: ExitReport | None = None
    remediated_by: str | None = None
    exited_at: float | None = None  # monotonic, when the exit was noticed
    exited_wall: float | None = None

    def close(self) -> None:
        self.pidfd = None
        if self.cgroup is not None:
            self.cgroup.close()
            self.cgroup = None


XidSource = Callable[[], dict[str, tuple[int, float]]]  # gpu -> (last xid, unix time)
GpuUse = Callable[[], dict[tuple[str, int], set[str]]]  # (job_id, rank) -> GPUs its processes hold


class ExitTracker:
    """Watches every registered rank process and decides why it exited."""

    def __init__(
        self,
        settings: Settings,
        store,
        xids: XidSource | None = None,
        gpu_use: GpuUse | None = None,
        clock=time.monotonic,
    ):
        self.settings = settings
        self.window = settings.exits.gpu_error_window_seconds
        self.procfs = settings.collectors.procfs_root
        self.incidents = ExitIncidents(store, settings.exits.group_seconds)
        self.xids, self.gpu_use, self.clock = xids, gpu_use, clock
        self._watches: dict[int, _Watch] = {}  # by id(rank): a re-registration is a new Rank
        self.counts: Counter = Counter()  # (job_id, reason)
        self.failures: Counter = Counter()  # (job_id, reason of the first exit)
        self._remediations_counted: list[str] = []  # watchdog incidents already counted as a failure
        self.last_time: dict[tuple[str, str], float] = {}
        self.last: dict[str, Any] | None = None  # the latest decided exit, for /v1/status
        self.recent: list[dict[str, Any]] = []
        self.rollback = RollbackMemory()
        self._kmsg_scan: tuple[int, dict[int, str]] | None = None  # (round, victims)
        self._round = 0  # polls so far

    # ------------------------------------------------------------ inputs

    def watch(self, rank: Rank) -> None:
        """At registration: pin the process (pidfd) and open its memory cgroup."""
        for key, w in list(self._watches.items()):
            if (
                w.rank.key == rank.key
                and w.rank.pid == rank.pid
                and w.rank.pid_start_time == rank.pid_start_time
                and w.exited_at is None
            ):
                del self._watches[key]  # the same process registering again (after a 409 unknown_rank)
                w.rank = rank
                self._watches[id(rank)] = w
                return
        cgroup = kernel.memory_cgroup_of(rank.pid, rank.pid_start_time, self.procfs)
        pidfd = getattr(rank, "pidfd", None)
        if pidfd is None:
            pidfd = kernel.open_pidfd(rank.pid, rank.pid_start_time)
        watch = _Watch(rank, pidfd, cgroup, cgroup.oom_kills() if cgroup else None)
        self._watches[id(rank)] = watch
        limit = self.settings.limits.max_jobs * self.settings.limits.max_ranks_per_job
        if len(self._watches) > limit:  # only ever exceeded by processes that never exit
            oldest = next(iter(self._watches))
            self._watches.pop(oldest).close()

    def deregistered(self, rank: Rank, reason: str, report: ExitReport | None) -> None:
        w = self._watches.get(id(rank))
        if w is None:
            return
        w.deregistered, w.report = reason, report
        if reason == "finished" and report is None:
            self._decide(w)  # it says it is done; whatever it does next is not training

    def remediating(self, rank: Rank, incident_id: str) -> None:
        w = self._watches.get(id(rank))
        if w is not None:
            w.remediated_by = incident_id

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Poll on the event loop: every input (registration, deregistration, remediation) arrives
        there too, so nothing here needs a lock. The reads are small kernel files and a poll(2)."""
        while True:
            try:
                self.poll()
            except Exception:
                log.exception("exit tracking failed")
            await asyncio.sleep(POLL_SECONDS)

    def poll(self) -> None:
        """Notice exits, and decide those whose evidence is in (or will not come). The exits of
        one job are decided together once none of them is younger than SETTLE_SECONDS, causes
        before consequences: when a rank dies its peers fail at once ("Connection closed by
        peer"), and may be noticed in the same round or even first."""
        now = self.clock()
        self._round += 1
        in_use = self.gpu_use() if self.gpu_use is not None and self._watches else {}
        waiting: dict[str, list[_Watch]] = {}
        latest: dict[str, float] = {}  # by job: when its last exit was noticed
        unsettled: set[str] = set()  # jobs with an exit whose status is not in yet
        for w in list(self._watches.values()):
            try:
                if w.exited_at is None:
                    w.gpus |= in_use.get(w.rank.key, set())
                    if self._alive(w):
                        if w.cgroup is not None and w.oom_baseline is None:
                            w.oom_baseline = w.cgroup.oom_kills()
                        continue
                    w.exited_at, w.exited_wall = now, time.time()
                status, _ = self._status(w)
                job_id = w.rank.job_id
                if status is None and now - w.exited_at < STATUS_WAIT_SECONDS:  # not reaped yet
                    unsettled.add(job_id)
                    continue
                waiting.setdefault(job_id, []).append(w)
                latest[job_id] = max(latest.get(job_id, w.exited_at), w.exited_at)
            except Exception:
                log.exception("deciding the exit of rank %s failed", w.rank.label)
                self._forget(w)
        for job_id, exits in waiting.items():
            if job_id in unsettled or now - latest[job_id] < SETTLE_SECONDS:
                continue
            decided = []
            for w in exits:
                try:
                    ev = self.evidence(w)
                    decided.append((w, *decide(ev), ev))
                except Exception:
                    log.exception("deciding the exit of rank %s failed", w.rank.label)
                self._forget(w)
            decided.sort(key=lambda d: (d[1] in CONSEQUENCES, d[0].exited_at, d[0].rank.rank))
            for w, reason, lines, ev in decided:
                self.record(w.rank, reason, lines, ev)

    def _alive(self, w: _Watch) -> bool:
        if w.pidfd is not None:
            return w.pidfd.alive()
        return w.rank.pid_start_time is None or is_running(w.rank.pid, w.rank.pid_start_time)

    def _status(self, w: _Watch) -> tuple[int | None, str | None]:
        if w.pidfd is not None:
            status = kernel.pidfd_exit_status(w.pidfd.fd)
            if status is not None:
                return status, "pidfd"
        status = kernel.zombie_exit_status(w.rank.pid, w.rank.pid_start_time, self.procfs)
        return (status, "zombie") if status is not None else (None, None)

    # ------------------------------------------------------------ deciding

    def evidence(self, w: _Watch) -> Evidence:
        status, source = self._status(w) if w.exited_at is not None else (None, None)
        ev = Evidence(
            deregistered=w.deregistered,
            report=w.report,
            status=status,
            status_source=source,
            remediated_by=w.remediated_by,
        )
        thread = [f for _, name, f in w.rank.events if name == "thread_exception"]
        if thread:
            ev.thread_exception = f"{str(thread[-1].get('type'))[:200]}: {str(thread[-1].get('message'))[:300]}"
        if w.exited_at is None:
            return ev
        if w.cgroup is not None and w.oom_baseline is not None:
            after = w.cgroup.oom_kills()
            if after is not None and after > w.oom_baseline:
                ev.oom_cgroup = f"oom_kill {w.oom_baseline} -> {after} in {w.cgroup.path}"
        if status is None or (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            ev.oom_kernel_log = self._kernel_log_victims().get(w.rank.pid)
        self._xid_evidence(w, ev)
        return ev

    def _kernel_log_victims(self) -> dict[int, str]:
        """The kernel log's OOM victims among the exited processes: one scan of the log per
        round, however many ranks died in it (a node's whole group may be killed at once)."""
        if self._kmsg_scan is None or self._kmsg_scan[0] != self._round:
            exited = [w.rank for w in self._watches.values() if w.exited_at is not None]
            found = kernel.kmsg_oom_victims({r.pid for r in exited}, {r.pid: r.pid_start_time or 0.0 for r in exited})
            self._kmsg_scan = (self._round, found)
        return self._kmsg_scan[1]

    def _xid_evidence(self, w: _Watch, ev: Evidence) -> None:
        if self.xids is None or w.exited_wall is None:
            return
        for gpu, (xid, when) in sorted(self.xids().items()):
            if not xid or not (w.exited_wall - self.window <= when <= w.exited_wall + 1.0):
                continue
            if gpu in w.gpus:
                ev.xid = (gpu, xid, when)
            elif ev.xid_unused_gpu is None:
                ev.xid_unused_gpu = (gpu, xid, when)

    def _decide(self, w: _Watch) -> None:
        ev = self.evidence(w)
        reason, lines = decide(ev)
        self._forget(w)
        self.record(w.rank, reason, lines, ev)

    def _forget(self, w: _Watch) -> None:
        self._watches.pop(id(w.rank), None)
        w.close()

    def record(self, rank: Rank, reason: str, lines: list[str], ev: Evidence) -> dict[str, Any]:
        now = time.time()
        entry = {
            "job_id": rank.job_id,
            "rank": rank.rank,
            "pid": rank.pid,
            "reason": reason,
            "time": now,
            "evidence": lines,
            "step": rank.step,
            "loss": _finite(rank.metrics.get("loss")),
            "step_time_seconds": _finite(rank.metrics.get("step_time_seconds")),
            "restart_count": rank.restart_count,
        }
        if ev.report is not None:
            entry["exception"] = {
                "type": ev.report.type,
                "message": ev.report.message,
                "traceback": list(ev.report.traceback),
                "thread": ev.report.thread,
            }
        hint = self.rollback.hint(rank)
        if hint:
            entry["rollback"] = hint
        if (
            (rank.job_id, reason) not in self.counts
            and len({j for j, _ in self.counts}) >= MAX_JOBS_COUNTED
            and rank.job_id not in {j for j, _ in self.counts}
        ):
            self._drop_oldest_job()
        self.counts[(rank.job_id, reason)] += 1
        self.last_time[(rank.job_id, reason)] = now
        self.last = entry
        self.recent.append(entry)
        del self.recent[:-20]
        rank.exit_reason = reason
        level = logging.INFO if reason == "finished" else logging.WARNING
        log.log(level, "rank %s (pid %d) exit: %s; %s", rank.label, rank.pid, reason, "; ".join(lines) or "-")
        if reason == "watchdog":
            incident = ev.remediated_by  # decide() says "watchdog" only when it is set
            if incident is not None and incident not in self._remediations_counted:
                self._remediations_counted = self._remediations_counted[-255:] + [incident]
                self.failures[(rank.job_id, reason)] += 1
        elif reason != "finished":
            entry["incident"], first = self.incidents.add(entry)
            if first:
                self.failures[(rank.job_id, reason)] += 1
        return entry

    def _drop_oldest_job(self) -> None:
        oldest = min(self.last_time.items(), key=lambda kv: kv[1])[0][0]
        for key in [k for k in self.counts if k[0] == oldest]:
            del self.counts[key]
            self.last_time.pop(key, None)
        for key in [k for k in self.failures if k[0] == oldest]:
            del self.failures[key]

    # ------------------------------------------------------------ reading

    def families(self) -> Iterable[Metric]:
        exits, failures, last = (m.family() for m in METRICS)
        for (job_id, reason), n in sorted(self.counts.items()):
            exits.add_metric([job_id, reason], n)
            last.add_metric([job_id, reason], self.last_time[(job_id, reason)])
        for (job_id, reason), n in sorted(self.failures.items()):
            failures.add_metric([job_id, reason], n)
        return [exits, failures, last]

    def status(self) -> dict[str, Any]:
        brief = ("job_id", "rank", "pid", "restart_count", "reason", "time", "step", "incident")
        return {
            "last": {k: self.last.get(k) for k in brief} | {"evidence": self.last["evidence"][:3]}
            if self.last
            else None,
            "recent": [{k: e.get(k) for k in brief} for e in reversed(self.recent[-5:])],
            "watched": len(self._watches),
        }

    def close(self) -> None:
        for w in list(self._watches.values()):
            w.close()
        self._watches.clear()


def _finite(value: Any) -> Any:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None
