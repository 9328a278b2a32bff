"""Why did the rank die: every exit of a registered rank gets one reason from a bounded set,
decided from evidence the sidecar can trust, and is counted, shown and (unless clean) recorded
as an incident.

Reasons (`REASONS`; the `reason` label of `sidecar_rank_exits_total`):

    finished                       a clean exit: status 0, or deregistered as finished
    watchdog                       the sidecar's own remediation killed it
    oom_killed                     the kernel's OOM killer (SIGKILL + the kernel log naming
                                   the pid, or the memory cgroup's oom_kill counter rising)
    gpu_error                      it died within exits.gpu_error_window_seconds of an XID
                                   on a GPU it was seen using
    exception/cuda_oom             its own report: torch.OutOfMemoryError
    exception/collective_timeout   a collective or store timed out (gloo, NCCL, c10d)
    exception/communication        another communication error (a peer closed the connection,
                                   an NCCL error or abort)
    exception/nonfinite            a NaN/Inf guard raised
    exception/other                any other exception
    signal                         killed by a signal neither we nor the OOM killer sent
    nonzero_exit                   a non-zero exit status without an exception report
    unknown                        no evidence at all (no report, status not readable)

Trust: the kernel's facts (wait status through a pidfd, cgroup counters and the kernel log, see
exit_evidence.py) and the sidecar's own actions outrank what a rank says. The exception report
arrives with the rank's deregistration over a verified connection, so a rank can only describe
its own exit, and nothing in it is ever opened or executed: it is classified by type names and
message text only, and kept, clipped, as evidence.
"""
from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from sidecar import exit_evidence as kernel
from sidecar.collectors.base import MetricSpec, spec
from sidecar.exit_incidents import ExitIncidents
from sidecar.identity import PidFd
from sidecar.procs import is_running
from sidecar.rollback import RollbackMemory

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.config import Settings
    from sidecar.protocol import ExitReport
    from sidecar.registry import Rank

log = logging.getLogger(__name__)

EXCEPTION_KINDS = ("cuda_oom", "collective_timeout", "communication", "nonfinite", "other")
REASONS = ("finished", "watchdog", "oom_killed", "gpu_error", *(f"exception/{k}" for k in EXCEPTION_KINDS),
           "signal", "nonzero_exit", "unknown")
POLL_SECONDS = 0.2
STATUS_WAIT_SECONDS = 5.0  # after the exit, how long to wait for the parent to reap it (the status)
SETTLE_SECONDS = 1.0  # a job's exits are decided together once the youngest is this old
# Reasons that usually follow another rank's failure rather than cause one: within a job's
# exits decided together they come after the others (the incident names the first as the cause).
CONSEQUENCES = frozenset({"exception/communication", "signal", "nonzero_exit", "unknown"})
MAX_JOBS_COUNTED = 64  # jobs whose exit counts are kept (the oldest job's are dropped beyond)

METRICS: tuple[MetricSpec, ...] = (
    spec("exits", "rank_exits", "counter",
         "Rank process exits by reason: finished, watchdog, oom_killed, gpu_error, exception/cuda_oom, "
         "exception/collective_timeout, exception/communication, exception/nonfinite, exception/other, "
         "signal, nonzero_exit, unknown.", ["job_id", "reason"]),
    spec("exits", "job_failures", "counter",
         "Failures of a job's worker group on this node, by the reason of the first rank to exit (the likely "
         "cause: torchrun stops the other workers, which then exit with `signal`). Reasons as "
         "sidecar_rank_exits_total, without finished.", ["job_id", "reason"]),
    spec("exits", "rank_last_exit_timestamp_seconds", "gauge",
         "Unix time of the job's latest rank exit classified on this node, by its reason.", ["job_id", "reason"]),
)

# --------------------------------------------------------------- exception classes

_CUDA_OOM_TYPES = {"torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError"}
_COMM_TYPES = {"torch.distributed.DistBackendError", "torch.distributed.DistNetworkError",
               "torch.distributed.DistStoreError", "torch.distributed.DistError"}
_CUDA_OOM_TEXT = re.compile(r"CUDA out of memory|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED", re.I)
# What torch 2.13 raises: gloo "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting
# 3000ms for recv operation to complete" (a RuntimeError), NCCL's watchdog "Watchdog caught
# collective operation timeout: WorkNCCL(...) ran for ... milliseconds before timing out", the
# c10d store's DistStoreError "wait timeout after ...", monitored barriers.
_COLLECTIVE_TIMEOUT_TEXT = re.compile(r"Timed out waiting \d+ms for (recv|send) operation|collective operation "
                                      r"timeout|timed out in monitoredBarrier", re.I)
_TIMEOUT_TEXT = re.compile(r"timed? ?out|timeout", re.I)
_COMM_TEXT = re.compile(r"Connection (closed|reset) by peer|NCCL (error|communicator)|ncclSystemError|"
                        r"ncclInternalError|ncclRemoteError|ncclUnhandledCudaError|ProcessGroupNCCL|"
                        r"ProcessGroupGloo|communicator was aborted|gloo/transport|c10d", re.I)
_NONFINITE_TEXT = re.compile(r"non-?finite|\b(nan|inf)\b|returned nan values", re.I)


def exception_kind(report: ExitReport) -> str:
    """One of EXCEPTION_KINDS from the report's type names and the first line of its message."""
    types = set(report.types) | {report.type}
    text = report.message
    if types & _CUDA_OOM_TYPES or _CUDA_OOM_TEXT.search(text):
        return "cuda_oom"
    comm = bool(types & _COMM_TYPES) or bool(_COMM_TEXT.search(text))
    if _COLLECTIVE_TIMEOUT_TEXT.search(text) or (comm and _TIMEOUT_TEXT.search(text)):
        return "collective_timeout"
    if comm:
        return "communication"
    if any("nonfinite" in t.lower().replace("_", "") for t in types) or _NONFINITE_TEXT.search(text):
        return "nonfinite"
    return "other"


# --------------------------------------------------------------- evidence and decision

@dataclass
class Evidence:
    """Everything known about one exit when it is decided."""

    deregistered: str | None = None  # the reason the rank gave when it deregistered
    report: ExitReport | None = None  # its exception, from its hooks
    status: int | None = None  # wait status, from the kernel
    status_source: str | None = None  # "pidfd" | "zombie"
    remediated_by: str | None = None  # the watchdog incident whose remediation signalled it
    oom_cgroup: str | None = None  # "oom_kill 0 -> 1 in /sys/fs/cgroup/memory/..." when it rose
    oom_kernel_log: str | None = None  # the kernel's "Killed process <pid>" line
    xid: tuple[str, int, float] | None = None  # (gpu, xid, unix time) on a GPU the rank used
    xid_unused_gpu: tuple[str, int, float] | None = None  # an XID in the window on another GPU
    thread_exception: str | None = None  # "Type: message" of the latest thread that died of one


def decide(ev: Evidence) -> tuple[str, list[str]]:
    """(reason, evidence lines for people)."""
    lines = []
    status = ev.status
    if status is not None:
        lines.append(f"kernel ({ev.status_source}): {kernel.describe_status(status)}")
    if ev.deregistered:
        lines.append(f"the rank deregistered ({ev.deregistered})")
    if ev.report is not None:
        lines.append(f"the rank's hooks reported {ev.report.type}: {ev.report.message}"
                     + (f" (thread {ev.report.thread})" if ev.report.thread else ""))
    if ev.thread_exception:
        lines.append(f"a thread of the rank died earlier of {ev.thread_exception}")
    if ev.oom_kernel_log:
        lines.append(f"kernel log: {ev.oom_kernel_log}")
    if ev.oom_cgroup:
        lines.append(f"memory cgroup: {ev.oom_cgroup}")
    for xid in (ev.xid, ev.xid_unused_gpu):
        if xid is not None:
            used = "it used" if xid is ev.xid else "it was not seen using"
            lines.append(f"XID {xid[1]} on gpu {xid[0]} ({used}) at "
                         f"{time.strftime('%H:%M:%S', time.gmtime(xid[2]))} UTC")
    signalled = killed = False
    if status is not None and kernel.os.WIFSIGNALED(status):
        signalled, killed = True, kernel.os.WTERMSIG(status) == kernel.signal.SIGKILL
    if ev.remediated_by:
        lines.insert(0, f"the sidecar's remediation (incident {ev.remediated_by}) signalled it")
        return "watchdog", lines
    if status is not None and kernel.os.WIFEXITED(status) and kernel.os.WEXITSTATUS(status) == 0:
        return "finished", lines
    if status is None and ev.deregistered in ("finished", "exit") and ev.report is None:
        return "finished", lines  # no status to say otherwise; "exit": its interpreter shut down
    if (killed or status is None) and ev.oom_kernel_log:
        return "oom_killed", lines
    if killed and ev.oom_cgroup:
        return "oom_killed", lines
    if ev.xid is not None:
        return "gpu_error", lines
    if ev.report is not None:
        return f"exception/{exception_kind(ev.report)}", lines
    if signalled:
        return "signal", lines
    if status is not None:
        return "nonzero_exit", lines
    lines.append("no exit status (kernel without PIDFD_INFO_EXIT, or another pid namespace) and no report")
    return "unknown", lines


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

    def __init__(self, settings: Settings, store, xids: XidSource | None = None,
                 gpu_use: GpuUse | None = None, clock=time.monotonic):
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
            if w.rank.key == rank.key and w.rank.pid == rank.pid and w.rank.pid_start_time == rank.pid_start_time \
                    and w.exited_at is None:
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
        ev = Evidence(deregistered=w.deregistered, report=w.report, status=status, status_source=source,
                      remediated_by=w.remediated_by)
        thread = [f for _, name, f in w.rank.events if name == "thread_exception"]
        if thread:
            ev.thread_exception = f"{str(thread[-1].get('type'))[:200]}: {str(thread[-1].get('message'))[:300]}"
        if w.exited_at is None:
            return ev
        if w.cgroup is not None and w.oom_baseline is not None:
            after = w.cgroup.oom_kills()
            if after is not None and after > w.oom_baseline:
                ev.oom_cgroup = f"oom_kill {w.oom_baseline} -> {after} in {w.cgroup.path}"
        if status is None or (kernel.os.WIFSIGNALED(status) and kernel.os.WTERMSIG(status) == 9):
            ev.oom_kernel_log = self._kernel_log_victims().get(w.rank.pid)
        self._xid_evidence(w, ev)
        return ev

    def _kernel_log_victims(self) -> dict[int, str]:
        """The kernel log's OOM victims among the exited processes: one scan of the log per
        round, however many ranks died in it (a node's whole group may be killed at once)."""
        if self._kmsg_scan is None or self._kmsg_scan[0] != self._round:
            exited = [w.rank for w in self._watches.values() if w.exited_at is not None]
            found = kernel.kmsg_oom_victims({r.pid for r in exited},
                                            {r.pid: r.pid_start_time or 0.0 for r in exited})
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
        entry = {"job_id": rank.job_id, "rank": rank.rank, "pid": rank.pid, "reason": reason, "time": now,
                 "evidence": lines, "step": rank.step, "loss": _finite(rank.metrics.get("loss")),
                 "step_time_seconds": _finite(rank.metrics.get("step_time_seconds")),
                 "restart_count": rank.restart_count}
        if ev.report is not None:
            entry["exception"] = {"type": ev.report.type, "message": ev.report.message,
                                  "traceback": list(ev.report.traceback), "thread": ev.report.thread}
        hint = self.rollback.hint(rank)
        if hint:
            entry["rollback"] = hint
        if (rank.job_id, reason) not in self.counts and len({j for j, _ in self.counts}) >= MAX_JOBS_COUNTED \
                and rank.job_id not in {j for j, _ in self.counts}:
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
        return {"last": {k: self.last.get(k) for k in brief} | {"evidence": self.last["evidence"][:3]}
                if self.last else None,
                "recent": [{k: e.get(k) for k in brief} for e in reversed(self.recent[-5:])],
                "watched": len(self._watches)}

    def close(self) -> None:
        for w in list(self._watches.values()):
            w.close()
        self._watches.clear()


def _finite(value: Any) -> Any:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None
