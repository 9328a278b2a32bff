"""The registry of training ranks on this node, keyed by `(job_id, rank)`.

The push API writes into it (registration, steps, phases, events); the watchdog, the
training metrics and `/v1/status` read it. Everything runs on the event loop; the
collectors' executor threads only take snapshots (`list(...)` of a dict is atomic under
the GIL). Jobs, ranks, custom metric names and phase names are bounded so a misbehaving
client cannot grow the registry, or the series count of `/metrics`, without limit.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable

from sidecar.config import Settings
from sidecar.host import procs
from sidecar.host.identity import PidFd
from sidecar.ranks import slurmjob
from sidecar.ranks.admission import Admission, JobNames
from sidecar.ranks.errors import StepNotIncreasing, UnknownRank
from sidecar.ranks.model import Rank, RankKey
from sidecar.ranks.ownership import JobOwners, Ownership
from sidecar.ranks.protocol import Deregistration, EventItem, PhaseItem, Push, Registration, StepItem
from trainer_hooks.wire import WELL_KNOWN_METRICS, WELL_KNOWN_PHASES


class Registry:
    """Ranks by `(job_id, rank)`. Every rule of who may register and how much is its
    `admission` (sidecar/ranks/admission.py); `alive(pid, start_time)`, whether a registered process
    still runs, is injected (procs.is_same_process by default)."""

    def __init__(self, settings: Settings, alive: Callable[[int, float | None], bool] = procs.is_same_process):
        self.settings = settings
        self._ranks: dict[RankKey, Rank] = {}
        self._names: dict[str, JobNames] = {}  # per job: its custom metric and phase names
        self.registrations_total = 0
        limits = settings.limits
        self.owners = JobOwners(limits.job_reservation_seconds, limits.max_jobs_per_user, limits.max_jobs)
        self.admission = Admission(settings, self, alive)

    # ------------------------------------------------------------ reading

    def ranks(self) -> list[Rank]:
        return list(self._ranks.values())

    def series_labels(self) -> dict[tuple[str, str], dict[str, str]]:
        """(job_id, rank as text) -> the labels its series carry: its pod's (podlabels.py) and, while
        metrics.slurm_labels, its Slurm job's (slurmjob.py); ranks with none are left out."""
        slurm = self.settings.metrics.slurm_labels
        out = {}
        for r in self.ranks():
            labels = {**r.kubernetes, **slurmjob.labels(r)} if slurm else r.kubernetes
            if labels:
                out[(r.job_id, str(r.rank))] = labels
        return out

    def get(self, job_id: str, rank: int) -> Rank | None:
        return self._ranks.get((job_id, rank))

    def job_ids(self) -> set[str]:
        return {k[0] for k in self._ranks}

    def names(self, job_id: str) -> JobNames | None:
        """The custom metric and phase names the job has used (None: none yet)."""
        return self._names.get(job_id)

    def reservation(self, job_id: str) -> Ownership | None:
        """The job's owner while its job_id is reserved (ownership.py), else None."""
        entry = self.owners.owner(job_id)
        return entry if entry is not None and entry.until is not None else None

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

    def verified_live_pids(self) -> list[tuple[str, int, int]]:
        """(job_id, rank, pid) of every rank not gone whose process the sidecar verified (the
        Unix socket's peer, or the process found holding its TCP connection): the only ranks
        whose pid may stand for facts about the node (which processes hold its GPUs, the node
        verdict). An unverified registration names whatever pid it likes (docs/security.md)."""
        return [(r.job_id, r.rank, r.pid) for r in self.ranks() if not r.gone and r.peer_verified]

    # ------------------------------------------------------------ writing

    def register(
        self,
        reg: Registration,
        *,
        pid_start_time: float | None,
        peer_verified: bool,
        host_pid: int | None = None,
        owner_uid: int | None = None,
        pidfd: PidFd | None = None,
    ) -> Rank:
        """Record a rank. `reg.pid` is the pid the rank calls itself; `host_pid` its pid here
        (when they differ: a rank in its own pid namespace); `owner_uid` the uid its process
        runs as, which must be the uid of the job's live ranks (JobOwned otherwise)."""
        key = (reg.job_id, reg.rank)
        host = reg.pid if host_pid is None else host_pid
        self.admission.check_registration(reg, host, owner_uid)
        self._forget_previous_owner(reg.job_id, owner_uid)
        if reg.phase is not None and reg.phase not in WELL_KNOWN_PHASES:
            self._add_names(reg.job_id, owner_uid, (), (reg.phase,))
        rank = Rank(
            job_id=reg.job_id,
            rank=reg.rank,
            local_rank=reg.local_rank,
            world_size=reg.world_size,
            local_world_size=reg.local_world_size,
            pid=host,
            pid_start_time=pid_start_time,
            claimed_pid=None if host_pid in (None, reg.pid) else reg.pid,
            owner_uid=owner_uid,
            pidfd=pidfd,
            restart_count=reg.restart_count,
            peer_verified=peer_verified,
            stack_signal=reg.stack_signal,
            versions=dict(reg.versions),
            pushes_promised=_promises_pushes(reg.versions),
            hooks_version=reg.hooks_version,
            kubernetes=dict(reg.kubernetes),
            slurm=None if reg.slurm is None else dict(reg.slurm),
            launcher=reg.launcher,
            restart_safe=reg.restart_safe,
            observe_only=reg.observe_only and self.settings.watchdog.allow_job_observe_only,
            step_times=collections.deque(maxlen=self.settings.watchdog.window),
        )
        # A rank re-registering after a sidecar restart resumes where it was, inside the phase
        # it declared with the budget it declared.
        rank.step = reg.step
        if reg.phase is not None:
            rank._phases.append((reg.phase, rank.registered_at, reg.phase_timeout_seconds))
            rank.phase, rank.phase_started = reg.phase, rank.registered_at
            rank.phase_timeout = reg.phase_timeout_seconds
        previous = self._ranks.get(key)
        if previous is not None:  # a restarted worker of the same owner continues its counters (no reset for rate())
            rank.counters = previous.counters
            if (previous.pid, previous.pid_start_time) == (rank.pid, rank.pid_start_time) and not previous.gone:
                # the same process again (a push this sidecar did not answer in time): what it saved stays
                rank.checkpoints = previous.checkpoints
                rank.last_checkpoint_step = previous.last_checkpoint_step
                rank.last_checkpoint_time = previous.last_checkpoint_time
            previous.pidfd = None  # replaced: never signalled again, its descriptor goes now
        self._ranks[key] = rank
        self.owners.claimed(reg.job_id, owner_uid)
        self.registrations_total += 1
        return rank

    def _forget_previous_owner(self, job_id: str, owner_uid: int | None) -> None:
        """A job_id passing to another uid (admission allowed it: the job had no live rank and
        no reservation of another uid): what the registry kept of the previous owner's job, its
        gone ranks (with their step counters) and its name tables, goes."""
        names = self._names.get(job_id)
        if names is not None and names.owner_uid != owner_uid:
            del self._names[job_id]
        for key in [k for k, r in self._ranks.items() if k[0] == job_id and r.owner_uid != owner_uid]:
            del self._ranks[key]

    def lookup(self, job_id: str, rank: int, pid: int) -> Rank:
        """The live registration of `(job_id, rank)` by `pid`, or UnknownRank (the hooks then
        re-register and resend)."""
        r = self._ranks.get((job_id, rank))
        if r is None or r.gone:
            raise UnknownRank(f"rank {job_id}/{rank} is not registered")
        if r.wire_pid != pid:
            raise UnknownRank(f"rank {job_id}/{rank} is registered by pid {r.wire_pid}, not {pid}")
        return r

    def apply_push(
        self, push: Push, rank: Rank | None = None, now_mono: float | None = None, now_wall: float | None = None
    ) -> int:
        """Apply a push's items in order, all or nothing: the whole batch is checked (steps
        increasing, name limits) before anything changes, so a refused push can be fixed
        and resent, and a resent push that was already applied is refused, not doubled.
        `rank`: the push's rank as the caller already looked it up (else it is looked up here)."""
        r = self.lookup(push.job_id, push.rank, push.pid) if rank is None else rank
        self._check_push(r, push)
        now_mono = time.monotonic() if now_mono is None else now_mono
        now_wall = time.time() if now_wall is None else now_wall
        r.dropped = max(r.dropped, push.dropped)
        if r.pushes_promised:
            r.contact_at = now_mono  # every push carries every step its hooks recorded before it
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
        last = r.step
        names = self._names.get(r.job_id) or JobNames()
        new_custom: dict[str, int | None] = {}
        new_phases: dict[str, int | None] = {}
        for i, item in enumerate(push.items):
            if type(item) is StepItem:
                if last is not None and item.step <= last:
                    raise StepNotIncreasing(
                        f"items[{i}].step: {item.step} is not greater than the previous step {last} of rank {r.label}"
                    )
                last = item.step
                for name in item.metrics:
                    if name not in WELL_KNOWN_METRICS and name not in names.custom:
                        new_custom.setdefault(name, i)
            elif type(item) is PhaseItem:
                if item.name not in WELL_KNOWN_PHASES and item.name not in names.phases:
                    new_phases.setdefault(item.name, i)
        self.admission.check_names(r.job_id, r.owner_uid, new_custom, new_phases)
        self._add_names(r.job_id, r.owner_uid, new_custom, new_phases)

    def _add_names(self, job_id: str, owner_uid: int | None, custom: Iterable[str], phases: Iterable[str]) -> None:
        names = self._names.setdefault(job_id, JobNames(owner_uid))
        names.custom.update(custom)
        names.phases.update(phases)

    def deregister(self, dereg: Deregistration, rank: Rank | None = None) -> Rank:
        r = self.lookup(dereg.job_id, dereg.rank, dereg.pid) if rank is None else rank
        if dereg.exit is not None and not r.gone:
            r.exit_time = dereg.exit.time
        self.mark_gone(r.key, dereg.reason or "deregistered")
        return r

    def mark_gone(self, key: RankKey, reason: str) -> None:
        r = self._ranks.get(key)
        if r is not None and not r.gone:
            r.gone, r.gone_reason, r.gone_at = True, reason, time.monotonic()
            r.pidfd = None  # a gone rank is never signalled again: its descriptor goes now, not at retention
            r.drop_fr_dump()  # its dump went into its incident, if it had one
            if not any(o.job_id == r.job_id and not o.gone for o in self._ranks.values()):
                self.owners.released(r.job_id, r.owner_uid)  # its owner keeps the job_id a while

    def sweep(self, now: float | None = None) -> int:
        """Drop ranks gone longer than limits.gone_retention_seconds; returns how many."""
        now = time.monotonic() if now is None else now
        keep = self.settings.limits.gone_retention_seconds
        stale = [k for k, r in self._ranks.items() if r.gone and r.gone_at is not None and now - r.gone_at > keep]
        for k in stale:
            del self._ranks[k]
        self._forget_empty_jobs()
        self.owners.expire()
        return len(stale)

    # ------------------------------------------------------------ bounds

    def evict_gone_job(self) -> None:
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
        jobs = self.job_ids()
        for job in [j for j in self._names if j not in jobs]:
            del self._names[job]


def _promises_pushes(versions: dict[str, str]) -> bool:
    """Hooks of wire protocol 6 or later push at least every max(flush interval, KEEPALIVE_SECONDS)
    and send the first step after a pause at once (the watchdog's progress horizon relies on it)."""
    said = versions.get("hooks_protocol", "")
    return said.isdigit() and int(said) >= 6
