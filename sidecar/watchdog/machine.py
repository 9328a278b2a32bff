"""The progress watchdog: one explicit state machine per registered rank.

Every `check_interval_seconds` the watchdog reads the registry and moves each rank between
states. Progress means the step counter advancing (or a declared phase ending); how long a
rank may go without it depends on what it is doing (the policy: sidecar/watchdog/timeouts.py).

A rank is SUSPECT past `suspect_ratio` of its timeout and STALLED past all of it. The first
STALLED rank of a job opens an incident: the watchdog blames one rank, and (unless it is in
observe-only mode or the storm cap is reached) hands the job's local worker group to
remediation, which runs as its own task while the watchdog keeps ticking. Process liveness
is a separate signal: a rank whose process is gone is GONE, never remediated (torchrun
handles crashes).

    STARTING --first step--> HEALTHY <--progress--> SUSPECT --timeout--> STALLED
        any watched state --remediation starts--> REMEDIATING --process exits--> GONE
        any state --process gone / deregistered / replaced--> GONE
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from prometheus_client.core import Metric

from sidecar.config import Settings
from sidecar.host.procs import is_running
from sidecar.host.signals import Target
from sidecar.incidents.store import Incident, IncidentStore, RankSnapshot
from sidecar.metric import MetricSpec, spec
from sidecar.problems import Kind, Problem
from sidecar.ranks.model import Rank, RankKey
from sidecar.ranks.registry import Registry
from sidecar.watchdog.attribution import blame, refine_blame
from sidecar.watchdog.remediation import Remediator
from sidecar.watchdog.restarts import NOT_KILLED_NO_RESTART, no_restart_note, no_restart_reasons
from sidecar.watchdog.stormcap import OwnerStormCaps
from sidecar.watchdog.timeouts import Deadline, Timeouts

log = logging.getLogger(__name__)


LIVENESS_CHECKS_PER_TICK = 64  # ranks whose process is checked per tick, in turn (bounds a tick's cost)


class RankState(enum.Enum):
    STARTING = "starting"  # registered, no step yet
    HEALTHY = "healthy"  # progressing within its timeout
    SUSPECT = "suspect"  # past suspect_ratio of its timeout
    STALLED = "stalled"  # past its timeout
    REMEDIATING = "remediating"  # its worker group is being dumped and killed
    GONE = "gone"  # exited, deregistered or replaced by a new registration


S = RankState
WATCHING = frozenset({S.STARTING, S.HEALTHY, S.SUSPECT, S.STALLED})
# The only transitions there are. Progress may bring a suspect or stalled rank back (a rank
# re-registered without a step goes back to STARTING); a failed remediation leaves its
# ranks STALLED; GONE is final (a new registration is a new rank).
ALLOWED: dict[RankState, frozenset[RankState]] = {
    S.STARTING: frozenset({S.HEALTHY, S.SUSPECT, S.STALLED, S.REMEDIATING, S.GONE}),
    S.HEALTHY: frozenset({S.SUSPECT, S.STALLED, S.REMEDIATING, S.GONE}),
    S.SUSPECT: frozenset({S.STARTING, S.HEALTHY, S.STALLED, S.REMEDIATING, S.GONE}),
    S.STALLED: frozenset({S.STARTING, S.HEALTHY, S.SUSPECT, S.REMEDIATING, S.GONE}),
    S.REMEDIATING: frozenset({S.STALLED, S.GONE}),
    S.GONE: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A transition outside ALLOWED: a bug in the watchdog, never a rank's doing."""


METRICS: tuple[MetricSpec, ...] = (
    spec(
        "watchdog",
        "rank_state",
        "gauge",
        "1 for the rank's current watchdog state, 0 for the others "
        "(starting, healthy, suspect, stalled, remediating, gone).",
        ["job_id", "rank", "state"],
    ),
    spec(
        "watchdog",
        "watchdog_timeout_seconds",
        "gauge",
        "The rank's effective progress timeout now (start-up, declared phase or adaptive step timeout).",
        ["job_id", "rank"],
    ),
    spec("watchdog", "watchdog_stalls", "counter", "Stalls detected (one per incident), per job.", ["job_id"]),
    spec(
        "watchdog",
        "watchdog_remediations",
        "counter",
        "Remediations by outcome: killed, unkillable (a process alive after SIGKILL and "
        "remediation.kill_wait_seconds: the node is unfit until it goes), suppressed (storm cap), observe_only, "
        "not_killed_no_restart (nothing would restart the ranks: no launcher, or torchrun's restarts used up; "
        "stacks dumped, no signal to end them; remediation.kill_without_restart), failed (no rank could be "
        "signalled, or remediation itself failed).",
        ["job_id", "outcome"],
    ),
    spec("watchdog", "watchdog_transitions", "counter", "Rank state transitions.", ["from_state", "to_state"]),
    spec(
        "watchdog",
        "watchdog_last_incident_timestamp_seconds",
        "gauge",
        "Unix time of the latest incident (absent before the first).",
    ),
    spec("watchdog", "watchdog_observe_only", "gauge", "1 when the watchdog only detects and reports, never signals."),
)


@dataclass
class _Track:
    rank: Rank
    state: RankState
    since: float  # watchdog clock of the last transition
    episode: _Episode | None = None


@dataclass
class _Episode:
    """One stall of one job on this node, from detection until its ranks recover or go."""

    job_id: str
    incident: Incident
    keys: list[RankKey]
    task: asyncio.Task | None = None
    outcome: str = "pending"
    suppressed: bool = False


@dataclass
class _Counters:
    transitions: Counter = field(default_factory=Counter)  # (from, to)
    stalls: Counter = field(default_factory=Counter)  # job_id
    remediations: Counter = field(default_factory=Counter)  # (job_id, outcome)
    last_incident: float | None = None


class Watchdog:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        clock=time.monotonic,
        remediator: Remediator | None = None,
        store: IncidentStore | None = None,
    ):
        self.settings = settings
        self.registry = registry
        self.clock = clock
        self.store = store or IncidentStore.for_settings(settings)
        self.remediator = remediator or Remediator(settings.remediation)
        rem = settings.remediation
        self.storm_cap = OwnerStormCaps(
            rem.max_per_window, max(rem.max_per_window, rem.max_per_window_node), rem.window_seconds, clock
        )
        self.counters = _Counters()
        self._tracks: dict[RankKey, _Track] = {}
        self._episodes: dict[str, _Episode] = {}
        self.timeouts = Timeouts(settings.watchdog)
        self._liveness_cursor = 0
        # Told of each rank its remediation is about to signal (the exit tracker: its exit is then
        # the watchdog's doing, not a failure of its own).
        self.on_remediating: Callable[[Rank, str], None] | None = None

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Tick forever. A failing tick is logged and the next one runs: the watchdog must
        outlive any bug in one evaluation."""
        if not self.settings.watchdog.enabled:
            return
        interval = self.settings.watchdog.check_interval_seconds
        try:
            while True:
                try:
                    self.tick()
                except Exception:
                    log.exception("watchdog tick failed")
                await asyncio.sleep(interval)
        finally:
            await self.close()

    async def close(self) -> None:
        tasks = [e.task for e in self._episodes.values() if e.task and not e.task.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def tick(self) -> None:
        """One evaluation of every rank, then incidents for newly stalled jobs. Liveness is what
        costs (a pidfd poll, or /proc reads without pidfds): a tick checks it for at most
        LIVENESS_CHECKS_PER_TICK ranks in turn, plus every rank about to change to a worse state
        and every rank being remediated."""
        now = self.clock()
        present = set()
        ranks = self.registry.ranks()
        n, per_tick = len(ranks), LIVENESS_CHECKS_PER_TICK
        start = self._liveness_cursor % n if n else 0
        self._liveness_cursor = start + per_tick
        for i, rank in enumerate(ranks):
            present.add(rank.key)
            try:
                self._evaluate(self._track(rank, now), now, n <= per_tick or (i - start) % n < per_tick)
            except Exception:  # one rank's bad data must not blind the watchdog to the others
                log.exception("evaluating rank %s failed", rank.label)
        for key in [k for k in self._tracks if k not in present]:
            del self._tracks[key]  # the registry forgot it (retention): so do we
            self.timeouts.forget(key)
        self._open_episodes(now)
        self._close_episodes()
        self.remediator.unkillable.check(self.store.save)  # processes that outlived SIGKILL: gone yet?

    def _track(self, rank: Rank, now: float) -> _Track:
        track = self._tracks.get(rank.key)
        if track is not None and track.rank is rank:
            return track
        if track is not None:
            self._transition(track, S.GONE, now, "replaced by a new registration")
        # A registration that carries a step is a rank re-registering (the sidecar restarted):
        # it is watched as healthy, with a fresh timer, never as a stall.
        state = S.HEALTHY if rank.step is not None else S.STARTING
        track = _Track(rank, state, now)
        self._tracks[rank.key] = track
        log.info("watching rank %s (pid %d) as %s", rank.label, rank.pid, state.value)
        return track

    def _evaluate(self, track: _Track, now: float, check_liveness: bool = True) -> None:
        rank = track.rank
        if track.state is S.GONE:
            return
        if rank.gone:
            self._transition(track, S.GONE, now, rank.gone_reason or "deregistered")
            return
        if (check_liveness or track.state is S.REMEDIATING) and self._exited(track, now):
            return
        if track.state is S.REMEDIATING:
            return
        d = self.deadline(rank, now)
        if d.age >= d.timeout:
            wanted = S.STALLED
        elif d.age >= self.settings.watchdog.suspect_ratio * d.timeout:
            wanted = S.SUSPECT
        else:
            wanted = S.STARTING if rank.step is None else S.HEALTHY
        if wanted is S.STARTING and track.state is S.HEALTHY:
            wanted = S.HEALTHY  # a started rank never goes back to starting
        if wanted in (S.SUSPECT, S.STALLED) and wanted is not track.state and not check_liveness:
            if self._exited(track, now):  # a dead process is never taken for a hung one
                return
        if wanted is not track.state:
            self._transition(track, wanted, now, f"{d.age:.1f}s without progress, timeout {d.timeout:.1f}s ({d.basis})")

    def _exited(self, track: _Track, now: float) -> bool:
        if _process_alive(track.rank):
            return False
        self.registry.mark_gone(track.rank.key, "process exited")
        self._transition(track, S.GONE, now, "process exited")
        return True

    def _transition(self, track: _Track, new: RankState, now: float, reason: str) -> None:
        """The one place a rank changes state: checked against ALLOWED, logged, counted."""
        old = track.state
        if new is old:
            return
        if new not in ALLOWED[old]:
            raise IllegalTransition(f"rank {track.rank.label}: {old.value} -> {new.value} ({reason})")
        track.state, track.since = new, now
        self.counters.transitions[(old.value, new.value)] += 1
        level = logging.WARNING if new in (S.STALLED, S.REMEDIATING) else logging.INFO
        log.log(level, "rank %s (pid %d): %s -> %s: %s", track.rank.label, track.rank.pid, old.value, new.value, reason)

    def deadline(self, rank: Rank, now: float | None = None) -> Deadline:
        return self.timeouts.deadline(rank, self.clock() if now is None else now)

    # ------------------------------------------------------------ incidents

    def _open_episodes(self, now: float) -> None:
        stalled_jobs = sorted(
            {t.rank.job_id for t in self._tracks.values() if t.state is S.STALLED and t.episode is None}
        )
        for job_id in stalled_jobs:
            if job_id in self._episodes:
                continue  # already being handled; its incident covers this rank too
            self._start_episode(job_id, now)

    def _start_episode(self, job_id: str, now: float) -> None:
        members = [t for t in self._tracks.values() if t.rank.job_id == job_id and t.state in WATCHING]
        members.sort(key=lambda t: t.rank.rank)
        blamed, why = blame([t.rank for t in members], {t.rank.key for t in members if t.state is S.STALLED})
        stalled_deadline = self.deadline(blamed, now) if blamed is not None else None
        observe_only = self.settings.watchdog.observe_only
        # A kill that nothing restarts turns the hang into a failed job: by default, don't.
        no_restart = [] if observe_only else no_restart_reasons(t.rank for t in members)
        spare = bool(no_restart) and not self.settings.remediation.kill_without_restart
        owner = members[0].rank.owner_uid if members else None
        full = None if observe_only or spare else self.storm_cap.allow(owner)
        suppressed = full is not None
        incident = self.store.open(
            job_id,
            blamed_rank=blamed.rank if blamed else None,
            blame_reason=why,
            timeout_seconds=stalled_deadline.timeout if stalled_deadline else None,
            observe_only=observe_only,
            ranks=[self._snapshot(t, now) for t in members],
        )
        episode = _Episode(job_id, incident, [t.rank.key for t in members], suppressed=suppressed)
        self._episodes[job_id] = episode
        for t in members:
            t.episode = episode
        self.counters.stalls[job_id] += 1
        self.counters.last_incident = incident.time
        targets = [target_of(t.rank) for t in members]
        if no_restart:
            incident.notes.append(no_restart_note(no_restart, killing=not spare))
        if observe_only or suppressed or spare:
            episode.outcome = "observe_only" if observe_only else "suppressed" if suppressed else NOT_KILLED_NO_RESTART
            if suppressed:
                incident.notes.append(f"storm cap: {full} reached; not killing")
            log.error(
                "job %s stalled (%s); %s",
                job_id,
                incident.summary,
                "observe-only mode: not killing"
                if observe_only
                else (
                    "storm cap reached: not killing" if suppressed else "nothing would restart its ranks: not killing"
                ),
            )
            episode.task = asyncio.get_running_loop().create_task(
                self._observe(episode, targets), name=f"observe-{job_id}"
            )
            return
        log.error("job %s stalled: %s; remediating %d local rank(s)", job_id, why, len(members))
        for t in members:
            self._transition(t, S.REMEDIATING, now, f"its job {job_id} stalled")
            if self.on_remediating is not None:
                self.on_remediating(t.rank, incident.id)
        episode.task = asyncio.get_running_loop().create_task(
            self._remediate(episode, targets), name=f"remediate-{job_id}"
        )

    def _snapshot(self, track: _Track, now: float) -> RankSnapshot:
        r = track.rank
        d = self.deadline(r, now)
        return RankSnapshot(
            rank=r.rank,
            local_rank=r.local_rank,
            pid=r.pid,
            state=track.state.value,
            step=r.step,
            phase=r.phase,
            last_progress_age_seconds=round(d.age, 3),
            timeout_seconds=round(d.timeout, 3),
            stack_file=r.stack_path,
        )

    async def _remediate(self, episode: _Episode, targets: list[Target]) -> None:
        incident = episode.incident
        try:
            await self.remediator.collect_stacks(incident, targets)
            refine_blame(incident)
            self.store.save(incident)  # the stacks are on disk before any signal
            term = await self.remediator.sigterm(incident, targets)
            self.store.save(incident)
            outcome = "failed" if term is None else await self.remediator.finish(incident, term)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # remediation bugs must not take the watchdog down
            log.exception("remediation of job %s failed", episode.job_id)
            episode.incident.notes.append(f"remediation error: {type(e).__name__}: {e}")
            outcome = "failed"
        self._finish(episode, outcome)
        if outcome != "killed":
            now = self.clock()
            for key in episode.keys:
                t = self._tracks.get(key)
                if t is not None and t.episode is episode and t.state is S.REMEDIATING:
                    self._transition(t, S.STALLED, now, f"remediation {outcome}")

    async def _observe(self, episode: _Episode, targets: list[Target]) -> None:
        """Stalls left alive: stacks, the incident, the count; no signal that ends a process.
        Observe-only and storm-capped stalls get py-spy's stacks only (it reads memory and never
        signals); a stall nothing would restart also gets the ranks' own dump signal."""
        try:
            spared = episode.outcome == NOT_KILLED_NO_RESTART
            await self.remediator.collect_stacks(episode.incident, targets, signal_ranks=spared)
            refine_blame(episode.incident)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("collecting stacks of job %s failed", episode.job_id)
        self._finish(episode, episode.outcome)

    def _finish(self, episode: _Episode, outcome: str) -> None:
        episode.outcome = outcome
        episode.incident.outcome = outcome
        self.store.save(episode.incident)
        self.counters.remediations[(episode.job_id, outcome)] += 1

    def _close_episodes(self) -> None:
        """An episode ends when its task is done and none of its ranks is stalled or being
        remediated any more (they progressed, exited, or were replaced)."""
        for job_id, episode in list(self._episodes.items()):
            if episode.task is not None and not episode.task.done():
                continue
            active = [
                t for t in self._tracks.values() if t.episode is episode and t.state in (S.STALLED, S.REMEDIATING)
            ]
            if active:
                continue
            for t in self._tracks.values():
                if t.episode is episode:
                    t.episode = None
            del self._episodes[job_id]

    # ------------------------------------------------------------ reading

    def families(self, only: Collection[RankKey] | None = None) -> Iterable[Metric]:
        """The watchdog's families; per-rank series only of the ranks in `only` (None: all)."""
        state, timeout, stalls, remediations, transitions, last, observe = (m.family() for m in METRICS)
        now = self.clock()
        tracks = list(self._tracks.values())
        if only is not None:
            tracks = [t for t in tracks if t.rank.key in only]
        for t in sorted(tracks, key=lambda t: t.rank.key):
            labels = [t.rank.job_id, str(t.rank.rank)]
            for s in RankState:
                state.add_metric(labels + [s.value], 1.0 if s is t.state else 0.0)
            if t.state is not S.GONE:
                timeout.add_metric(labels, self.deadline(t.rank, now).timeout)
        for job_id, n in sorted(self.counters.stalls.items()):
            stalls.add_metric([job_id], n)
        for (job_id, outcome), n in sorted(self.counters.remediations.items()):
            remediations.add_metric([job_id, outcome], n)
        for (old, new), n in sorted(self.counters.transitions.items()):
            transitions.add_metric([old, new], n)
        if self.counters.last_incident is not None:
            last.add_metric([], self.counters.last_incident)
        observe.add_metric([], 1.0 if self.settings.watchdog.observe_only else 0.0)
        return [state, timeout, stalls, remediations, transitions, last, observe]

    def status(self) -> dict:
        rem = self.settings.remediation
        return {
            "enabled": self.settings.watchdog.enabled,
            "observe_only": self.settings.watchdog.observe_only,
            "remediations_in_window": self.storm_cap.in_window(),
            "max_per_window": rem.max_per_window,
            "window_seconds": rem.window_seconds,
            "active": [
                {"job_id": e.job_id, "incident": e.incident.id, "outcome": e.outcome} for e in self._episodes.values()
            ],
        }

    def rank_state(self, rank: Rank) -> str:
        track = self._tracks.get(rank.key)
        if track is not None and track.rank is rank:
            return track.state.value
        if rank.gone:
            return S.GONE.value
        return (S.HEALTHY if rank.step is not None else S.STARTING).value

    def timeout_for(self, rank: Rank) -> float | None:
        if rank.gone or self.rank_state(rank) == S.GONE.value:
            return None
        return self.deadline(rank).timeout

    def problems(self) -> list[Problem]:
        out = []
        for t in sorted(self._tracks.values(), key=lambda t: t.rank.key):
            if t.state in (S.SUSPECT, S.STALLED, S.REMEDIATING):
                d = self.deadline(t.rank)
                out.append(
                    Problem(
                        Kind.RANK,
                        f"rank {t.rank.label} is {t.state.value}: no progress for {d.age:.0f}s "
                        f"(timeout {d.timeout:.0f}s, {d.basis})",
                        t.rank.job_id,
                        t.rank.rank,
                    )
                )
        for e in self._episodes.values():
            if e.suppressed:
                out.append(
                    Problem(
                        Kind.STORM_CAP,
                        f"job {e.job_id}: remediation suppressed by the storm cap "
                        f"({self.settings.remediation.max_per_window} per "
                        f"{self.settings.remediation.window_seconds:.0f}s)",
                        e.job_id,
                    )
                )
        return out

    def incidents(self, limit: int = 5) -> list[dict]:
        return self.store.latest(limit)


def _process_alive(rank: Rank) -> bool:
    """Whether the registered process still runs. A rank whose start time could not be read
    when it registered (another pid namespace) is taken as alive: it is watched, and
    remediation's safety check will refuse to signal it."""
    if rank.pid_start_time is None:
        return True
    if rank.pidfd is not None:  # a poll, no /proc read
        return rank.pidfd.alive()
    return is_running(rank.pid, rank.pid_start_time)


def target_of(rank: Rank) -> Target:
    """The signal target of a registered rank, with the identity it registered with."""
    return Target(
        rank.job_id,
        rank.rank,
        rank.pid,
        rank.pid_start_time,
        rank.stack_signal,
        rank.stack_file,
        rank.peer_verified,
        rank.pidfd,
    )
