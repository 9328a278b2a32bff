"""The kill-and-resume drill (`sidecar drill --job ID`, the operations guide's kill-and-resume check on a
live job): the sidecar stops one registered rank of the job (SIGSTOP), the watchdog detects the stall,
dumps, kills the worker group and torchrun restarts it; the drill reports how long each took and the
step the job resumed from. The stall's incident is recorded as a drill (sidecar/incidents/drills.py)
and the exits it causes are not counted as failures.

Who may start one is the daemon's business (root on the Unix socket, sidecar/daemon/operations.py);
what is stopped is decided here, from the registry alone: a live rank of the job that a verified
caller registered, signalled through its pidfd, never a pid a client names. A job is refused when the
stall would not end in a restart (no launcher, torchrun's restarts used up, a launcher not said, a
restart trap, observe-only), when it has not trained yet, or when it already has an open stall. A
drill the watchdog does not kill (its time is up, or the stall is not acted on) continues the rank.

A stopped rank is never left behind by the sidecar's own end: the processes of the drills in flight
are written to STOPPED_FILE (diag dir, root's, 0600) while they are stopped; a sidecar that stops
continues them (`close`), and one that starts continues whatever the file names that is still the
same process (its pid and start time, signalled through a pidfd): the previous run was killed or
crashed mid-drill (`continue_left_stopped`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.config import Settings
from sidecar.host import diagfiles, procs
from sidecar.host.signals import Refused, Target, send
from sidecar.incidents.store import Incident, IncidentStore
from sidecar.ranks.errors import RegistryError
from sidecar.ranks.model import Rank
from sidecar.ranks.registry import Registry
from sidecar.watchdog.restarts import no_restart_reason

log = logging.getLogger(__name__)

MIN_TIMEOUT_SECONDS, MAX_TIMEOUT_SECONDS, DEFAULT_TIMEOUT_SECONDS = 10.0, 3600.0, 600.0
FOLLOW_INTERVAL_SECONDS = 0.25
# Outcomes of a stall that kill nothing: the drill ends there and the rank is continued.
NOT_KILLED = frozenset({"observe_only", "suppressed", "unverified", "not_killed_no_restart", "failed", "resumed"})
STOPPED_FILE = ".drills-stopped.json"  # in the diag dir: the processes drills in flight stopped
MAX_STOPPED_FILE_BYTES = 1 << 16


class DrillRefused(RegistryError):
    code, status = "drill_refused", 409


class DrillUnknown(RegistryError):
    code, status = "not_found", 404


@dataclass
class Drill:
    id: str
    job_id: str
    rank: int
    pid: int
    step: int | None  # the rank's step when stopped
    stopped_at: float  # wall clock
    timeout: float
    requested_by: int  # uid
    target: Target = field(repr=False)
    finished: str | None = None  # resumed | timed_out | not_killed (<outcome>) | failed
    finished_at: float | None = None
    task: asyncio.Task | None = field(default=None, repr=False)


def refusal(settings: Settings, ranks: list[Rank], active_jobs: set[str]) -> str | None:
    """Why a drill of the job (its live ranks here) would not end in a restart, or None."""
    if not ranks:
        return "no live rank of the job on this node"
    job_id = ranks[0].job_id
    if not settings.watchdog.enabled:
        return "the watchdog is off here (watchdog.enabled): nothing would detect the stall"
    if settings.watchdog.observe_only:
        return "the watchdog only observes here (watchdog.observe_only): the stall would never be killed"
    if job_id in active_jobs:
        return f"job {job_id} already has an open stall incident"
    for r in ranks:
        if r.observe_only:
            return f"job {job_id} asked to be observed only (observe_only): the stall would never be killed"
        if r.launcher is None:
            return (
                f"rank {r.rank} did not say what restarts it (hooks before protocol 2): nothing known would restart it"
            )
        why = no_restart_reason(r)
        if why is not None:
            return f"nothing would restart the job: {why}"
        if r.restart_safe is False:
            return (
                f"rank {r.rank}'s process group would not come back after a restart (torchrun shares its store "
                "across attempts: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)"
            )
        if not r.peer_verified or r.pid_start_time is None:
            return f"rank {r.rank} was not registered by a verified caller: the watchdog would never signal it"
    return None


class Drills:
    """The drills of this node: started by the daemon, followed until the job trains again."""

    def __init__(
        self, settings: Settings, registry: Registry, store: IncidentStore, active_jobs, wake=None, linked=None
    ):
        self.settings, self.registry, self.store = settings, registry, store
        self.active_jobs = active_jobs  # () -> the jobs with an open stall episode (the watchdog's)
        # (job_id) -> None: this node's job-view report goes now, naming the drill, so that the job's
        # other nodes hear of it before their ranks, waiting for the stopped one, stall
        self.wake = wake
        self.linked = linked  # (job_id) -> whether this node reports the job to its coordinator (the job view)
        self._drills: dict[str, Drill] = {}

    def start(self, job_id: str, rank: int | None, timeout: float, uid: int) -> Drill:
        ranks = sorted((r for r in self.registry.ranks() if r.job_id == job_id and not r.gone), key=lambda r: r.rank)
        if not ranks:
            raise DrillUnknown(f"job_id: no live rank of job {job_id!r} on this node")
        why = refusal(self.settings, ranks, set(self.active_jobs()))
        if why is None and any(r.world_size > r.local_world_size for r in ranks):
            if self.linked is None or not self.linked(job_id):
                why = (
                    f"job {job_id} spans several nodes and this node does not report it to the job's coordinator "
                    "(the job view has not formed here yet, or is off): its other nodes would not hear of the "
                    "drill and would count a real stall; try again once `sidecar status` shows its coordinator"
                )
        if why is not None:
            raise DrillRefused(f"not drilling job {job_id}: {why}")
        chosen = ranks[-1] if rank is None else next((r for r in ranks if r.rank == rank), None)
        if chosen is None:
            raise DrillUnknown(f"rank: {rank} is not a live rank of job {job_id!r} on this node")
        if chosen.step is None:
            raise DrillRefused(f"not drilling job {job_id}: rank {chosen.rank} has not finished its first step")
        drill_id = time.strftime("drill-%Y%m%dT%H%M%SZ-", time.gmtime()) + secrets.token_hex(3)
        try:
            self.store.drills.arm(drill_id, job_id, timeout)
        except ValueError as e:
            raise DrillRefused(f"not drilling job {job_id}: {e}") from None
        target = Target(
            chosen.job_id, chosen.rank, chosen.pid, chosen.pid_start_time, chosen.stack_signal, chosen.stack_file,
            chosen.peer_verified, chosen.pidfd,
        )  # fmt: skip
        if self.wake is not None:
            self.wake(job_id)
        try:
            send(target, signal.SIGSTOP, "process")
        except (Refused, OSError) as e:
            self.store.drills.disarm(drill_id)
            raise DrillRefused(f"not drilling job {job_id}: rank {chosen.rank} cannot be stopped: {e}") from None
        drill = Drill(drill_id, job_id, chosen.rank, chosen.pid, chosen.step, time.time(), timeout, uid, target)
        log.warning(
            "drill %s: rank %s (pid %d) stopped at step %s by uid %d; the watchdog should detect, kill and restart",
            drill_id, chosen.label, chosen.pid, chosen.step, uid,
        )  # fmt: skip
        self._drills[drill_id] = drill
        self._record()
        for old in [k for k, d in self._drills.items() if d.finished is not None][:-16]:
            del self._drills[old]
        drill.task = asyncio.get_running_loop().create_task(self._follow(drill), name=f"drill-{job_id}")
        return drill

    async def _follow(self, drill: Drill) -> None:
        """Until the job trains again, the watchdog leaves the stall alone, or the time is up."""
        try:
            while drill.finished is None:
                await asyncio.sleep(FOLLOW_INTERVAL_SECONDS)
                answer = self.answer(drill.id)
                if answer["training_again_after_seconds"] is not None:
                    self._end(drill, "resumed")
                elif answer["outcome"] in NOT_KILLED:
                    self._end(drill, f"not_killed ({answer['outcome']})")
                elif time.time() - drill.stopped_at > drill.timeout:
                    self._end(drill, "timed_out")
        except asyncio.CancelledError:
            self._end(drill, "failed")
            raise

    def _end(self, drill: Drill, how: str) -> None:
        if drill.finished is not None:
            return
        drill.finished, drill.finished_at = how, time.time()
        self.store.drills.disarm(drill.id)
        if how != "resumed":  # never leave a rank stopped: continue it (refused once it is gone)
            with contextlib.suppress(Refused, OSError):
                send(drill.target, signal.SIGCONT, "process")
        self._record()
        log.warning("drill %s of job %s: %s", drill.id, drill.job_id, how)

    def close(self) -> None:
        """The sidecar stops: every drill in flight ends, its rank continued."""
        for drill in list(self._drills.values()):
            self._end(drill, "failed (the sidecar stopped)")

    def _record(self) -> None:
        """STOPPED_FILE: the processes of the drills in flight, for the next start to continue."""
        stopped = [{"drill": d.id, "pid": d.target.pid, "start_time": d.target.start_time, "boot": boot_id()}
                   for d in self._drills.values() if d.finished is None]  # fmt: skip
        try:
            with diagfiles.opened(self.settings.diagnostics_dir) as root_fd:
                diagfiles.write_atomic(root_fd, STOPPED_FILE, json.dumps(stopped).encode(), 0o600)
        except OSError as e:
            log.error("cannot write %s: %s (a drilled rank would stay stopped if this sidecar died)", STOPPED_FILE, e)

    def incident_of(self, drill: Drill) -> Incident | None:
        return next((i for i in reversed(self.store.recent) if i.drill == drill.id), None)

    def answer(self, drill_id: str) -> dict[str, Any]:
        drill = self._drills.get(drill_id)
        if drill is None:
            raise DrillUnknown(f"drill: no drill {drill_id!r} on this node")
        return figures(drill, self.incident_of(drill))


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def continue_left_stopped(diag_dir: Path | str) -> int:
    """At start: SIGCONT each process the previous run's drills left stopped (STOPPED_FILE, the
    sidecar's own regular file), when it is still the same process (this boot's, with the pid and
    start time, checked after its pidfd is open); returns how many were continued. Then the file
    is emptied. Never raises: a start goes on whatever the file says."""
    try:
        with diagfiles.opened(diag_dir) as root_fd:
            fd = os.open(STOPPED_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=root_fd)
            try:
                st = os.fstat(fd)
                ours = st.st_uid == os.geteuid() and st.st_nlink == 1
                raw = os.read(fd, MAX_STOPPED_FILE_BYTES) if ours else b""
            finally:
                os.close(fd)
        entries = json.loads(raw or b"[]")
    except (OSError, ValueError) as e:
        if not isinstance(e, FileNotFoundError):
            log.warning("cannot read %s: %s", STOPPED_FILE, e)
        return 0
    continued, boot = 0, boot_id()
    for entry in entries if isinstance(entries, list) else []:
        try:
            continued += _continue(entry, boot)
        except Exception as e:  # one odd entry never stops the others, nor the start
            log.warning("drill: cannot continue %r: %s", entry, e)
    try:
        with diagfiles.opened(diag_dir) as root_fd:
            diagfiles.write_atomic(root_fd, STOPPED_FILE, b"[]", 0o600)
    except OSError as e:
        log.error("cannot empty %s: %s", STOPPED_FILE, e)
    return continued


def _continue(entry: Any, boot: str) -> int:
    pid, started = (entry.get("pid"), entry.get("start_time")) if isinstance(entry, dict) else (None, None)
    if type(pid) is not int or not 1 < pid < 1 << 22 or not isinstance(started, (int, float)):
        return 0
    if entry.get("boot") != boot:
        return 0  # another boot's pids and start times say nothing of this one's processes
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return 0  # gone
    try:
        if procs.start_time(pid) != started:
            return 0  # another process has the pid now
        signal.pidfd_send_signal(pidfd, signal.SIGCONT)
        log.warning("drill %s: continued pid %d, left stopped by the previous run", entry.get("drill"), pid)
        return 1
    finally:
        os.close(pidfd)


def _after(at: Any, start: float) -> float | None:
    return round(at - start, 3) if isinstance(at, (int, float)) else None


def figures(drill: Drill, incident: Incident | None) -> dict[str, Any]:
    """What the drill measured so far, in seconds after the rank was stopped."""
    recovery = (incident.recovery if incident is not None else None) or {}
    milestones = recovery.get("milestones") or {}
    return {
        "id": drill.id,
        "job_id": drill.job_id,
        "rank": drill.rank,
        "pid": drill.pid,
        "step_at_stop": drill.step,
        "stopped_at": round(drill.stopped_at, 3),
        "timeout_seconds": drill.timeout,
        "finished": drill.finished,
        "incident": incident.id if incident is not None else None,
        "incident_path": incident.path if incident is not None else None,
        "outcome": incident.outcome if incident is not None else None,
        "blamed_rank": incident.blamed_rank if incident is not None else None,
        "detected_after_seconds": _after(incident.time, drill.stopped_at) if incident is not None else None,
        "kill_sent_after_seconds": _after(incident.event_time("sigterm"), drill.stopped_at) if incident else None,
        "ranks_gone_after_seconds": _after(milestones.get("ranks_gone"), drill.stopped_at),
        "restarted_after_seconds": _after(milestones.get("started"), drill.stopped_at),
        "training_again_after_seconds": _after(milestones.get("first_step"), drill.stopped_at),
        "resumed_from_step": recovery.get("checkpoint_step"),
        "steps_redone": recovery.get("steps_redone"),
    }
