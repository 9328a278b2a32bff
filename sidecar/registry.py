"""The registry of training ranks on this node, keyed by `(job_id, rank)`.

The push API writes into it (registration, steps, phases, events); the watchdog, the
training metrics and `/v1/status` read it. Everything runs on the event loop; the
collectors' executor threads only take snapshots (`list(...)` of a dict is atomic under
the GIL). Jobs, ranks, custom metric names and phase names are bounded so a misbehaving
client cannot grow the registry, or the series count of `/metrics`, without limit.
"""
from __future__ import annotations

import collections
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sidecar import procs
from sidecar.admission import Admission, StepNotIncreasing, UnknownRank
from sidecar.stepcounters import StepCounters
from trainer_hooks.wire import WELL_KNOWN_METRICS, WELL_KNOWN_PHASES

if TYPE_CHECKING:
    from sidecar.config import Settings
    from sidecar.identity import PidFd
    from sidecar.protocol import Deregistration, EventItem, PhaseItem, Push, Registration, StepItem
    from sidecar.stackfiles import StackFile

RankKey = tuple[str, int]

# The well-known metric and phase names are the wire contract's (trainer_hooks/wire.py): any
# other key in a step's metrics is a custom metric, any other phase name counts against limits.


@dataclass
class Rank:
    """What the sidecar knows about one registered rank process."""

    job_id: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    pid: int  # in the sidecar's pid namespace (the host's): what is signalled, watched and shown
    pid_start_time: float | None  # seconds from boot (procs.start_time): with the pid, the process's identity
    restart_count: int = 0
    registered_at: float = field(default_factory=time.monotonic)
    registered_wall: float = field(default_factory=time.time)
    peer_verified: bool = False  # registered over the Unix socket by pid or one of its ancestors
    stack_signal: int | None = None  # the signal the hooks' faulthandler dumps stacks on
    stack_file: StackFile | None = None  # the dump file the sidecar created for it (stackfiles.py)
    versions: dict[str, str] = field(default_factory=dict)
    hooks_version: str | None = None
    kubernetes: dict[str, str] = field(default_factory=dict)  # its pod's namespace, pod, container labels
    claimed_pid: int | None = None  # the pid the rank calls itself (its own pid namespace's); None: `pid`
    owner_uid: int | None = None  # the uid its process runs as (None: unknown, an unverified TCP caller)
    pidfd: PidFd | None = field(default=None, repr=False)  # of the process, where the kernel has pidfds
    # Returned at registration; pushes and deregistrations over TCP must carry it (the Unix
    # socket checks the caller's pid instead), so another local user cannot forge progress.
    session: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    step: int | None = None  # the last step reported
    step_wall: float | None = None  # the rank's wall clock at that step
    last_progress: float = 0.0  # monotonic time the step last advanced (or registration)
    last_progress_wall: float = 0.0  # the same instant on the wall clock
    # Seconds between consecutive step reports, per step: the watchdog's adaptive timeout
    # follows these. An interval that overlapped a declared phase is not recorded.
    step_times: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))
    phase: str | None = None  # the innermost declared phase now running
    phase_started: float | None = None  # monotonic
    phase_timeout: float | None = None  # the budget the rank declared for it, if any
    metrics: dict[str, float] = field(default_factory=dict)  # latest well-known values (may be NaN)
    custom: dict[str, float] = field(default_factory=dict)  # latest custom values
    last_checkpoint_step: int | None = None
    last_checkpoint_time: float | None = None  # wall clock
    # For the rollback hint of an exit incident: recent checkpoint_saved events as (step, path,
    # time) (the path is the rank's text, shown, never opened) and the first step whose loss was
    # not finite, as (step, time); times are the rank's wall clock.
    checkpoints: collections.deque = field(default_factory=lambda: collections.deque(maxlen=16))
    first_nonfinite_loss: tuple[int, float] | None = None
    dropped: int = 0  # the hooks' running count of records they had to drop
    nonfinite: collections.Counter = field(default_factory=collections.Counter)  # by metric key
    counters: StepCounters = field(default_factory=StepCounters)  # steps/samples/tokens, step-time histogram
    records: int = 0  # items accepted since registration
    events: collections.deque = field(default_factory=lambda: collections.deque(maxlen=32))
    gone: bool = False
    gone_reason: str | None = None
    gone_at: float | None = None  # monotonic
    exit_reason: str | None = None  # why its process exited, once decided (sidecar/exits.py)
    # Declared phases as a stack of (name, started, timeout): phases may nest (eval inside
    # a checkpoint-load retry, compile inside eval).
    _phases: list[tuple[str, float, float | None]] = field(default_factory=list, repr=False)
    _phase_since_step: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not self.last_progress:
            self.last_progress = self.registered_at
        if not self.last_progress_wall:
            self.last_progress_wall = self.registered_wall

    @property
    def stack_path(self) -> str | None:
        return self.stack_file.path if self.stack_file is not None else None

    @property
    def key(self) -> RankKey:
        return (self.job_id, self.rank)

    @property
    def label(self) -> str:
        return f"{self.job_id}/{self.rank}"

    @property
    def wire_pid(self) -> int:
        return self.pid if self.claimed_pid is None else self.claimed_pid

    def progress_age(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.last_progress

    # ------------------------------------------------------------ applying items

    def _monotonic_of(self, wall: float, now_mono: float, now_wall: float) -> float:
        """The monotonic instant of a rank's wall-clock time (items arrive batched, up to a
        flush interval late), clamped between registration and now."""
        return min(now_mono, max(self.registered_at, now_mono - (now_wall - wall)))

    def apply_step(self, item: StepItem, now_mono: float, now_wall: float) -> None:
        """One step report, whose step is above the last (Registry.apply_push checked the batch)."""
        interval = None
        if self.step is not None and self.step_wall is not None:
            elapsed = item.time - self.step_wall
            if elapsed >= 0:
                interval = elapsed / (item.step - self.step)
        advanced = 1 if self.step is None else item.step - self.step
        in_phase = self._phase_since_step or bool(self._phases)
        if interval is not None and not in_phase:
            self.step_times.append(interval)
        self._phase_since_step = False
        self.step = item.step
        self.step_wall = item.time
        self.last_progress = max(self.last_progress, self._monotonic_of(item.time, now_mono, now_wall))
        self.last_progress_wall = item.time
        step_time = None
        for name, value in item.metrics.items():
            if not math.isfinite(value):
                self.nonfinite[name] += 1
                if name == "loss" and self.first_nonfinite_loss is None:
                    self.first_nonfinite_loss = (item.step, item.time)
            if name in WELL_KNOWN_METRICS:
                self.metrics[name] = value
            else:
                self.custom[name] = value
        if "step_time_seconds" in item.metrics:
            step_time = item.metrics["step_time_seconds"]
        elif interval is not None:
            step_time = interval
            self.metrics["step_time_seconds"] = interval
        self._derive_rates(item.metrics, step_time)
        self.counters.observe(advanced, item.metrics, step_time)

    def _derive_rates(self, sent: dict[str, float], step_time: float | None) -> None:
        if step_time is None or not math.isfinite(step_time) or step_time <= 0:
            return
        for rate, per_step in (("iterations_per_second", None), ("samples_per_second", "samples"),
                               ("tokens_per_second", "tokens")):
            if rate in sent:
                continue
            if per_step is None:
                self.metrics[rate] = 1.0 / step_time
            elif per_step in sent:
                self.metrics[rate] = sent[per_step] / step_time

    def apply_phase(self, item: PhaseItem, now_mono: float, now_wall: float) -> None:
        at = self._monotonic_of(item.time, now_mono, now_wall)
        if item.action == "start":
            self._phases.append((item.name, at, item.timeout_seconds))
            self._phase_since_step = True
        else:
            # End the innermost phase of that name (and anything opened inside it and never
            # closed); an end without a start is ignored, it may follow a sidecar restart.
            for i in range(len(self._phases) - 1, -1, -1):
                if self._phases[i][0] == item.name:
                    del self._phases[i:]
                    break
            # The end of a phase is progress: the rank is back and the step timer restarts.
            self.last_progress = max(self.last_progress, at)
        if self._phases:
            self.phase, self.phase_started, self.phase_timeout = self._phases[-1]
        else:
            self.phase, self.phase_started, self.phase_timeout = None, None, None

    def apply_event(self, item: EventItem) -> None:
        self.events.append((item.time, item.name, dict(item.fields)))
        if item.name == "checkpoint_saved":
            step = item.fields.get("step")
            if type(step) is int and 0 <= step < 1 << 63:
                self.last_checkpoint_step = step
                path = item.fields.get("path")
                self.checkpoints.append((step, path[:4096] if isinstance(path, str) else None, item.time))
            self.last_checkpoint_time = item.time


class Registry:
    """Ranks by `(job_id, rank)`. Every rule of who may register and how much is its
    `admission` (sidecar/admission.py); `alive(pid, start_time)`, whether a registered process
    still runs, is injected (procs.is_same_process by default)."""

    def __init__(self, settings: Settings, alive: Callable[[int, float | None], bool] = procs.is_same_process):
        self.settings = settings
        self._ranks: dict[RankKey, Rank] = {}
        self._custom_names: dict[str, set[str]] = {}  # per job
        self._phase_names: dict[str, set[str]] = {}  # per job, beyond the well-known ones
        self.registrations_total = 0
        self.admission = Admission(settings, self._ranks, self._custom_names, self._phase_names, alive,
                                   evict=self._evict_gone_job)

    # ------------------------------------------------------------ reading

    def ranks(self) -> list[Rank]:
        return list(self._ranks.values())

    def pod_labels(self) -> dict[tuple[str, str], dict[str, str]]:
        """(job_id, rank as text) -> the rank's Kubernetes labels, for ranks that sent them."""
        return {(r.job_id, str(r.rank)): r.kubernetes for r in self.ranks() if r.kubernetes}

    def get(self, job_id: str, rank: int) -> Rank | None:
        return self._ranks.get((job_id, rank))

    def jobs(self) -> dict[str, list[Rank]]:
        """Ranks grouped by job, ordered by rank."""
        out: dict[str, list[Rank]] = {}
        for r in sorted(self.ranks(), key=lambda r: (r.job_id, r.rank)):
            out.setdefault(r.job_id, []).append(r)
        return out

    def versions_by_job(self) -> dict[str, dict[str, str]]:
        """Per job, the software versions its ranks reported (the latest registration wins)."""
        out: dict[str, dict[str, str]] = {}
        for r in sorted(self.ranks(), key=lambda r: r.registered_at):
            out.setdefault(r.job_id, {}).update(r.versions)
        return out

    def live_pids(self) -> list[tuple[str, int, int]]:
        """(job_id, rank, pid) of every rank not gone: what the process collector watches."""
        return [(r.job_id, r.rank, r.pid) for r in self.ranks() if not r.gone]

    # ------------------------------------------------------------ writing

    def register(self, reg: Registration, *, pid_start_time: float | None, peer_verified: bool,
                 host_pid: int | None = None, owner_uid: int | None = None, pidfd: PidFd | None = None) -> Rank:
        """Record a rank. `reg.pid` is the pid the rank calls itself; `host_pid` its pid here
        (when they differ: a rank in its own pid namespace); `owner_uid` the uid its process
        runs as, which must be the uid of the job's live ranks (JobOwned otherwise)."""
        key = (reg.job_id, reg.rank)
        host = reg.pid if host_pid is None else host_pid
        self.admission.check_registration(reg, host, owner_uid)
        rank = Rank(
            job_id=reg.job_id, rank=reg.rank, local_rank=reg.local_rank, world_size=reg.world_size,
            local_world_size=reg.local_world_size, pid=host,
            pid_start_time=pid_start_time, claimed_pid=None if host_pid in (None, reg.pid) else reg.pid,
            owner_uid=owner_uid, pidfd=pidfd,
            restart_count=reg.restart_count, peer_verified=peer_verified,
            stack_signal=reg.stack_signal, versions=dict(reg.versions),
            hooks_version=reg.hooks_version, kubernetes=dict(reg.kubernetes),
            step_times=collections.deque(maxlen=self.settings.watchdog.window))
        # A rank re-registering after a sidecar restart resumes where it was, inside the phase
        # it declared with the budget it declared.
        rank.step = reg.step
        if reg.phase is not None:
            rank._phases.append((reg.phase, rank.registered_at, reg.phase_timeout_seconds))
            rank.phase, rank.phase_started = reg.phase, rank.registered_at
            rank.phase_timeout = reg.phase_timeout_seconds
        previous = self._ranks.get(key)
        if previous is not None:  # a restarted worker continues its counters (no reset for rate())
            rank.counters = previous.counters
        self._ranks[key] = rank
        self.registrations_total += 1
        return rank

    def lookup(self, job_id: str, rank: int, pid: int) -> Rank:
        """The live registration of `(job_id, rank)` by `pid`, or UnknownRank (the hooks then
        re-register and resend)."""
        r = self._ranks.get((job_id, rank))
        if r is None or r.gone:
            raise UnknownRank(f"rank {job_id}/{rank} is not registered")
        if r.wire_pid != pid:
            raise UnknownRank(f"rank {job_id}/{rank} is registered by pid {r.wire_pid}, not {pid}")
        return r

    def apply_push(self, push: Push, rank: Rank | None = None, now_mono: float | None = None,
                   now_wall: float | None = None) -> int:
        """Apply a push's items in order, all or nothing: the whole batch is checked (steps
        increasing, name limits) before anything changes, so a refused push can be fixed
        and resent, and a resent push that was already applied is refused, not doubled.
        `rank`: the push's rank as the caller already looked it up (else it is looked up here)."""
        from sidecar.protocol import EventItem, PhaseItem, StepItem

        r = self.lookup(push.job_id, push.rank, push.pid) if rank is None else rank
        self._check_push(r, push)
        now_mono = time.monotonic() if now_mono is None else now_mono
        now_wall = time.time() if now_wall is None else now_wall
        r.dropped = max(r.dropped, push.dropped)
        for item in push.items:
            if type(item) is StepItem:
                r.apply_step(item, now_mono, now_wall)
            elif type(item) is PhaseItem:
                r.apply_phase(item, now_mono, now_wall)
            elif type(item) is EventItem:
                r.apply_event(item)
        r.records += len(push.items)
        return len(push.items)

    def _check_push(self, r: Rank, push: Push) -> None:
        from sidecar.protocol import PhaseItem, StepItem

        last = r.step
        custom = self._custom_names.setdefault(r.job_id, set())
        phases = self._phase_names.setdefault(r.job_id, set())
        new_custom: dict[str, int] = {}
        new_phases: dict[str, int] = {}
        for i, item in enumerate(push.items):
            if type(item) is StepItem:
                if last is not None and item.step <= last:
                    raise StepNotIncreasing(f"items[{i}].step: {item.step} is not greater than the "
                                            f"previous step {last} of rank {r.label}")
                last = item.step
                for name in item.metrics:
                    if name not in WELL_KNOWN_METRICS and name not in custom:
                        new_custom.setdefault(name, i)
            elif type(item) is PhaseItem:
                if item.name not in WELL_KNOWN_PHASES and item.name not in phases:
                    new_phases.setdefault(item.name, i)
        self.admission.check_names(r, custom, phases, new_custom, new_phases)
        custom.update(new_custom)
        phases.update(new_phases)

    def deregister(self, dereg: Deregistration, rank: Rank | None = None) -> Rank:
        r = self.lookup(dereg.job_id, dereg.rank, dereg.pid) if rank is None else rank
        self.mark_gone(r.key, dereg.reason or "deregistered")
        return r

    def mark_gone(self, key: RankKey, reason: str) -> None:
        r = self._ranks.get(key)
        if r is not None and not r.gone:
            r.gone, r.gone_reason, r.gone_at = True, reason, time.monotonic()
            r.pidfd = None  # a gone rank is never signalled again: its descriptor goes now, not at retention

    def sweep(self, now: float | None = None) -> int:
        """Drop ranks gone longer than limits.gone_retention_seconds; returns how many."""
        now = time.monotonic() if now is None else now
        keep = self.settings.limits.gone_retention_seconds
        stale = [k for k, r in self._ranks.items() if r.gone and r.gone_at is not None and now - r.gone_at > keep]
        for k in stale:
            del self._ranks[k]
        self._forget_empty_jobs()
        return len(stale)

    # ------------------------------------------------------------ bounds

    def _evict_gone_job(self) -> None:
        """Make room for a new job by dropping the job whose ranks are all gone, oldest first."""
        by_job: dict[str, list[Rank]] = {}
        for r in self._ranks.values():
            by_job.setdefault(r.job_id, []).append(r)
        dead = [(max(r.gone_at or 0.0 for r in rs), job) for job, rs in by_job.items() if all(r.gone for r in rs)]
        if dead:
            _, job = min(dead)
            for k in [k for k in self._ranks if k[0] == job]:
                del self._ranks[k]
            self._forget_empty_jobs()

    def _forget_empty_jobs(self) -> None:
        jobs = {k[0] for k in self._ranks}
        for table in (self._custom_names, self._phase_names):
            for job in [j for j in table if j not in jobs]:
                del table[job]

