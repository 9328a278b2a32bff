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
from typing import Any

from prometheus_client.core import Metric

from sidecar.config import Settings
from sidecar.exits import kernel
from sidecar.exits.incidents import ExitIncidents
from sidecar.exits.metrics import METRICS
from sidecar.exits.reasons import CONSEQUENCES, Evidence, decide
from sidecar.exits.rollback import RollbackMemory
from sidecar.exits.watches import Watch as _Watch
from sidecar.exits.watches import WatchedProcess as _Process
from sidecar.host.procs import is_running
from sidecar.ranks.model import Rank, RankKey
from sidecar.ranks.protocol import ExitReport
from sidecar.safetext import printable
from trainer_hooks.wire import CRASH_LOOP_EXIT, THREAD_EXCEPTION_EVENT

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
STATUS_WAIT_SECONDS = 5.0  # after the exit, how long to wait for the parent to reap it (the status)
SETTLE_SECONDS = 1.0  # a job's exits are decided together once the youngest is this old
JOB_VIEW_WAIT_SECONDS = 5.0  # the default wait for the job view (the daemon sets it from the settings)
MAX_JOBS_COUNTED = 64  # jobs whose exit counts are kept (the oldest job's are dropped beyond)

# --------------------------------------------------------------- the tracker

DECIDE_CHUNK = 64  # exits decided between two returns to the event loop
# (job_id, global rank) -> (the job incident the exit is a consequence of, what holds the job up,
# whether the job view may still tell): the job view's answer (sidecar/jobview/), wired by the daemon.
JobIncidentOf = Callable[[str, int], tuple[str | None, str | None, bool]]
ROOT_UID = 0


XidSource = Callable[[], dict[str, tuple[int, float]]]  # gpu -> (last xid, unix time)
GpuUse = Callable[[], dict[tuple[str, int], set[str]]]  # (job_id, rank) -> GPUs its processes hold


class ExitTracker:
    """Watches every registered rank process and decides why it exited.

    Cost bounds (docs/security.md, "Bounded cost"): the processes of many keys share one pidfd
    and one cgroup descriptor; watches of retired ranks (deregistered or replaced, process still
    running) are bounded per owner uid by limits.max_ranks_per_user (root: none) and on the node
    by limits.max_ranks, dropping the owner's own oldest, never another user's; exits are
    decided DECIDE_CHUNK at a time between returns to the event loop, the kernel log is read in
    the executor, and each exit incident touched in a round is written once, off the loop."""

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
        self._watches: dict[int, _Watch] = {}  # by id(rank), oldest first: a re-registration is a new Rank
        self._by_key: dict[RankKey, list[_Watch]] = {}
        self._processes: dict[tuple[int, float | None], _Process] = {}
        self._retired: Counter = Counter()  # owner uid -> its retired watches
        self.dropped = 0  # retired watches dropped to stay within the bounds
        self.counts: Counter = Counter()  # (job_id, reason, role)
        self.job_incident_of: JobIncidentOf | None = None  # the job view's answer, when it is on
        self.job_view_wait = JOB_VIEW_WAIT_SECONDS  # how long an exit may wait for the job view's verdict
        self.crash_loop_of: Callable[[str], dict[str, Any] | None] | None = None  # a job ended on purpose
        self.failures: Counter = Counter()  # (job_id, reason of the first exit)
        self._remediations_counted: list[str] = []  # watchdog incidents already counted as a failure
        self.last_time: dict[tuple[str, str], float] = {}
        self.last: dict[str, Any] | None = None  # the latest decided exit, for /v1/status
        self.recent: list[dict[str, Any]] = []
        self.rollback = RollbackMemory()
        self._kmsg_victims: dict[int, str] = {}  # this round's kernel-log OOM victims
        self._round = 0  # polls so far

    # ------------------------------------------------------------ inputs

    def watch(self, rank: Rank) -> None:
        """At registration: pin the process (pidfd) and open its memory cgroup, once per process."""
        for w in list(self._by_key.get(rank.key, [])):
            if w.exited_at is not None or w.replaced:
                continue
            if (w.rank.pid, w.rank.pid_start_time) == (rank.pid, rank.pid_start_time):
                # The same process registering again (after a 409 unknown_rank, or after it had
                # deregistered): the same watch, live again.
                if w.deregistered is not None:
                    self._uncount_retired(w)
                    w.deregistered, w.report = None, None
                del self._watches[id(w.rank)]
                w.rank = rank
                self._watches[id(rank)] = w
                return
            self._retire(w, replaced=True)
        ident = (rank.pid, rank.pid_start_time)
        process = self._processes.get(ident)
        if process is None:
            cgroup = kernel.memory_cgroup_of(rank.pid, rank.pid_start_time, self.procfs)
            pidfd = getattr(rank, "pidfd", None)
            if pidfd is None:
                pidfd = kernel.open_pidfd(rank.pid, rank.pid_start_time)
            process = _Process(rank.pid, rank.pid_start_time, pidfd, cgroup, cgroup.oom_kills() if cgroup else None)
            self._processes[ident] = process
        process.watches += 1
        w = _Watch(rank, process)
        self._watches[id(rank)] = w
        self._by_key.setdefault(rank.key, []).append(w)

    def deregistered(self, rank: Rank, reason: str, report: ExitReport | None) -> None:
        w = self._watches.get(id(rank))
        if w is None:
            return
        w.report = report
        if w.deregistered is None:
            w.deregistered = reason
            if not w.replaced:
                self._count_retired(w)
        if reason == "finished" and report is None:
            self._decide(w)  # it says it is done; whatever it does next is not training

    def remediating(self, rank: Rank, incident_id: str) -> None:
        w = self._watches.get(id(rank))
        if w is not None:
            w.remediated_by = incident_id

    def left_to_launcher(self, rank: Rank, job_incident: str, culprit: str) -> None:
        """The watchdog left this rank to torchrun: its job's culprit is elsewhere, so however it
        exits next, that is a consequence of the job incident, unless it steps again first (the
        stall ended by itself: a later exit is its own)."""
        w = self._watches.get(id(rank))
        if w is not None:
            w.consequence_of, w.left_at_progress = (job_incident, culprit), rank.last_progress

    def _left(self, w: _Watch) -> tuple[str, str] | None:
        """Its mark of being left to the launcher, while it has not stepped since."""
        return w.consequence_of if w.rank.last_progress == w.left_at_progress else None

    def _consequence(self, w: _Watch) -> tuple[str, str] | None:
        if (left := self._left(w)) is not None:
            return left
        if self.job_incident_of is None:
            return None
        job_incident, culprit, _ = self.job_incident_of(w.rank.job_id, w.rank.rank)
        return (job_incident, culprit or "another rank") if job_incident is not None else None

    def _job_view_deciding(self, exits: list[_Watch], now: float) -> bool:
        """The job view may still name what made these exits happen (bounded: job_view_wait)."""
        if self.job_incident_of is None or any(self._left(w) is not None for w in exits):
            return False
        if now - min(w.exited_at or now for w in exits) >= self.job_view_wait:
            return False
        return self.job_incident_of(exits[0].rank.job_id, exits[0].rank.rank)[2]

    def _retire(self, w: _Watch, replaced: bool) -> None:
        if w.retired:
            w.replaced = w.replaced or replaced
            return
        w.replaced = replaced
        self._count_retired(w)

    def _count_retired(self, w: _Watch) -> None:
        """One more retired watch of its owner: past the owner's bound, the owner's oldest goes;
        past the node's, the oldest of whoever holds the most."""
        owner = w.rank.owner_uid
        self._retired[owner] += 1
        limits = self.settings.limits
        if owner != ROOT_UID and self._retired[owner] > limits.max_ranks_per_user:
            self._drop_oldest_retired(owner)
        if sum(self._retired.values()) > limits.max_ranks:
            self._drop_oldest_retired(max(self._retired, key=lambda uid: self._retired[uid]))

    def _uncount_retired(self, w: _Watch) -> None:
        owner = w.rank.owner_uid
        self._retired[owner] -= 1
        if self._retired[owner] <= 0:
            del self._retired[owner]

    def _drop_oldest_retired(self, owner: int | None) -> None:
        victim = next(
            (w for w in self._watches.values() if w.retired and w.exited_at is None and w.rank.owner_uid == owner),
            None,
        )
        if victim is not None:
            self.dropped += 1
            log.debug("no longer watching the exit of rank %s (pid %d): bound", victim.rank.label, victim.rank.pid)
            self._forget(victim)

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Poll on the event loop: every input (registration, deregistration, remediation) arrives
        there too, so nothing here needs a lock."""
        while True:
            try:
                await self.poll()
            except Exception:
                log.exception("exit tracking failed")
            await asyncio.sleep(POLL_SECONDS)

    async def poll(self) -> None:
        """Notice exits, and decide those whose evidence is in (or will not come). The exits of
        one job are decided together once none of them is younger than SETTLE_SECONDS, causes
        before consequences: when a rank dies its peers fail at once ("Connection closed by
        peer"), and may be noticed in the same round or even first. A round returns to the
        event loop every DECIDE_CHUNK watches, reads the kernel log in the executor and writes
        each exit incident it touched once, in the executor."""
        now = self.clock()
        self._round += 1
        in_use = self.gpu_use() if self.gpu_use is not None and self._watches else {}
        waiting: dict[str, list[_Watch]] = {}
        latest: dict[str, float] = {}  # by job: when its last exit was noticed
        unsettled: set[str] = set()  # jobs with an exit whose status is not in yet
        for i, w in enumerate(list(self._watches.values())):
            if i and i % (DECIDE_CHUNK * 16) == 0:
                await asyncio.sleep(0)
            if self._watches.get(id(w.rank)) is not w:
                continue  # forgotten meanwhile
            try:
                if w.exited_at is None:
                    w.gpus |= in_use.get(w.rank.key, set())
                    if self._alive(w.process):
                        if w.process.cgroup is not None and w.process.oom_baseline is None:
                            w.process.oom_baseline = w.process.cgroup.oom_kills()
                        continue
                    w.exited_at, w.exited_wall = now, time.time()
                status, _ = self._status(w.process)
                job_id = w.rank.job_id
                if status is None and now - w.exited_at < STATUS_WAIT_SECONDS:  # not reaped yet
                    unsettled.add(job_id)
                    continue
                waiting.setdefault(job_id, []).append(w)
                latest[job_id] = max(latest.get(job_id, w.exited_at), w.exited_at)
            except Exception:
                log.exception("deciding the exit of rank %s failed", w.rank.label)
                self._forget(w)
        ready = [
            exits
            for job_id, exits in waiting.items()
            if job_id not in unsettled
            and now - latest[job_id] >= SETTLE_SECONDS
            and not self._job_view_deciding(exits, now)
        ]
        if not ready:
            return
        await self._read_kernel_log([w for exits in ready for w in exits])
        xids = self.xids() if self.xids is not None else {}
        # jobs whose exits carry a rollback hint: the job's ranks here, to learn their checkpoints first
        hinted = {w.rank.job_id for exits in ready for w in exits if w.rank.first_nonfinite_loss is not None}
        peers: dict[str, list[Rank]] = {}
        for w in self._watches.values() if hinted else ():
            if w.rank.job_id in hinted:
                peers.setdefault(w.rank.job_id, []).append(w.rank)
        touched = 0
        for exits in ready:
            decided = []
            for w in exits:
                touched += 1
                if touched % DECIDE_CHUNK == 0:
                    await asyncio.sleep(0)
                if self._watches.get(id(w.rank)) is not w:
                    continue  # decided or dropped while the round waited
                try:
                    ev = self.evidence(w, xids)
                    decided.append((w, *decide(ev), ev))
                except Exception:
                    log.exception("deciding the exit of rank %s failed", w.rank.label)
                self._forget(w)
            decided.sort(key=lambda d: (d[1] in CONSEQUENCES, d[0].exited_at, d[0].rank.rank))
            # every checkpoint the job's ranks here reported (the deciding ones among them), before a hint
            # is given: the rank whose loss went bad may have died before it reported its peers' newest save
            for r in peers.get(exits[0].rank.job_id, ()):
                self.rollback.learn(r)
            for w, reason, lines, ev in decided:
                self.record(w.rank, reason, lines, ev, consequence=self._consequence(w))
        await self.incidents.flush()

    def _alive(self, p: _Process) -> bool:
        if p.checked[0] != self._round:
            if p.pidfd is not None:
                alive = p.pidfd.alive()
            else:
                alive = p.start_time is None or is_running(p.pid, p.start_time)
            p.checked = (self._round, alive)
        return p.checked[1]

    def _status(self, p: _Process) -> tuple[int | None, str | None]:
        if p.status[0] == self._round:
            return p.status[1]
        found: tuple[int | None, str | None] = (None, None)
        if p.pidfd is not None:
            status = kernel.pidfd_exit_status(p.pidfd.fd)
            if status is not None:
                found = (status, "pidfd")
        if found[0] is None:
            status = kernel.zombie_exit_status(p.pid, p.start_time, self.procfs)
            if status is not None:
                found = (status, "zombie")
        p.status = (self._round, found)
        return found

    async def _read_kernel_log(self, exits: list[_Watch]) -> None:
        """The kernel log's OOM victims among this round's exits: one scan of the log (bounded,
        in the executor), however many ranks died (a node's whole group may be killed at once).
        Only exits killed by SIGKILL, or without a status, can be the OOM killer's."""
        self._kmsg_victims = {}
        wanted: dict[int, float] = {}
        for w in exits:
            status, _ = self._status(w.process)
            if status is None or (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
                wanted[w.rank.pid] = w.rank.pid_start_time or 0.0
        if wanted:
            loop = asyncio.get_running_loop()
            self._kmsg_victims = await loop.run_in_executor(None, kernel.kmsg_oom_victims, set(wanted), wanted)

    # ------------------------------------------------------------ deciding

    def evidence(self, w: _Watch, xids: dict[str, tuple[int, float]] | None = None) -> Evidence:
        status, source = self._status(w.process) if w.exited_at is not None else (None, None)
        ev = Evidence(
            deregistered=w.deregistered,
            report=w.report,
            status=status,
            status_source=source,
            remediated_by=w.remediated_by,
        )
        thread = w.rank.last_event(THREAD_EXCEPTION_EVENT)
        if thread is not None:
            # The rank's own words, kept as text: escaped here, so no record, log line or
            # `sidecar status` shows them raw.
            ev.thread_exception = printable(f"{str(thread.get('type'))[:200]}: {str(thread.get('message'))[:300]}")
        if w.exited_at is None:
            return ev
        cgroup, baseline = w.process.cgroup, w.process.oom_baseline
        if cgroup is not None and baseline is not None:
            after = cgroup.oom_kills()
            if after is not None and after > baseline:
                ev.oom_cgroup = f"oom_kill {baseline} -> {after} in {printable(cgroup.path)}"  # a name the user chose
        if status is None or (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            ev.oom_kernel_log = self._kmsg_victims.get(w.rank.pid)
        if xids is None:
            xids = self.xids() if self.xids is not None else {}
        self._xid_evidence(w, ev, xids)
        return ev

    def _xid_evidence(self, w: _Watch, ev: Evidence, xids: dict[str, tuple[int, float]]) -> None:
        if w.exited_wall is None:
            return
        for gpu, (xid, when) in sorted(xids.items()):
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
        self.incidents.flush_soon()

    def _forget(self, w: _Watch) -> None:
        if self._watches.pop(id(w.rank), None) is None:
            return
        same_key = self._by_key.get(w.rank.key, [])
        if w in same_key:
            same_key.remove(w)
        if not same_key:
            self._by_key.pop(w.rank.key, None)
        if w.retired:
            self._uncount_retired(w)
        p = w.process
        p.watches -= 1
        if p.watches <= 0:
            self._processes.pop((p.pid, p.start_time), None)
            p.close()

    def record(
        self, rank: Rank, reason: str, lines: list[str], ev: Evidence, consequence: tuple[str, str] | None = None
    ) -> dict[str, Any]:
        """Count, show and (unless clean) file one decided exit. `consequence`: (job incident,
        culprit) when another node's hang or loss made this rank exit: counted with role
        `consequence`, filed under the job incident, never a failure of this node's own."""
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
            "role": "consequence" if consequence is not None else "cause",
        }
        if consequence is not None:
            entry["job_incident"], entry["consequence_of"] = consequence
        ended = self.crash_loop_of(rank.job_id) if self.crash_loop_of is not None else None
        if ended is not None and ev.status is not None and os.WIFEXITED(ev.status):
            if os.WEXITSTATUS(ev.status) == CRASH_LOOP_EXIT:  # it did as its sidecar told it (jobview/crashloop.py)
                entry["crash_loop"] = ended
                lines.append(f"the sidecar ended the job: {ended['reason']} (job incident {ended['job_incident']})")
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
            (rank.job_id, reason, entry["role"]) not in self.counts
            and len({k[0] for k in self.counts}) >= MAX_JOBS_COUNTED
            and rank.job_id not in {k[0] for k in self.counts}
        ):
            self._drop_oldest_job()
        self.counts[(rank.job_id, reason, entry["role"])] += 1
        self.last_time[(rank.job_id, reason)] = now
        self.last = entry
        self.recent.append(entry)
        del self.recent[:-20]
        rank.exit_reason = reason
        level = logging.INFO if reason == "finished" else logging.WARNING
        log.log(level, "rank %s (pid %d) exit: %s; %s", rank.label, rank.pid, reason, "; ".join(lines) or "-")
        # A drill's kill (`sidecar drill`), or any exit while its job is drilled: not a failure.
        drills = getattr(self.incidents.store, "drills", None)
        drill = drills is not None and (
            drills.is_drill_incident(ev.remediated_by) or drills.armed(rank.job_id) is not None
        )
        if drill:
            entry["drill"] = True
        if reason == "watchdog":
            incident = ev.remediated_by  # decide() says "watchdog" only when it is set
            counted = incident in self._remediations_counted
            if incident is not None and not counted and consequence is None and not drill:
                self._remediations_counted = self._remediations_counted[-255:] + [incident]
                self.failures[(rank.job_id, reason)] += 1
        elif reason != "finished":
            entry["incident"], first = self.incidents.add(entry)
            if first and consequence is None and not drill:
                self.failures[(rank.job_id, reason)] += 1
        return entry

    def _drop_oldest_job(self) -> None:
        oldest = min(self.last_time.items(), key=lambda kv: kv[1])[0][0]
        for key in [k for k in self.counts if k[0] == oldest]:
            del self.counts[key]
        for key in [k for k in self.last_time if k[0] == oldest]:
            del self.last_time[key]
        for key in [k for k in self.failures if k[0] == oldest]:
            del self.failures[key]

    # ------------------------------------------------------------ reading

    def families(self) -> Iterable[Metric]:
        exits, failures, last = (m.family() for m in METRICS)
        for (job_id, reason, role), n in sorted(self.counts.items()):
            exits.add_metric([job_id, reason, role], n)
        for (job_id, reason), when in sorted(self.last_time.items()):
            last.add_metric([job_id, reason], when)
        for (job_id, reason), n in sorted(self.failures.items()):
            failures.add_metric([job_id, reason], n)
        return [exits, failures, last]

    def status(self) -> dict[str, Any]:
        brief = ("job_id", "rank", "pid", "restart_count", "reason", "role", "time", "step", "incident", "job_incident")
        return {
            "last": {k: self.last.get(k) for k in brief} | {"evidence": self.last["evidence"][:3]}
            if self.last
            else None,
            "recent": [{k: e.get(k) for k in brief} for e in reversed(self.recent[-5:])],
            "watched": len(self._watches),
        }

    def close(self) -> None:
        for p in self._processes.values():
            p.close()
        self._processes.clear()
        self._watches.clear()
        self._by_key.clear()
        self._retired.clear()


def _finite(value: Any) -> Any:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None
