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

With the job view (sidecar/watchdog/coordination.py) a stall is the job's: a suspect rank's stacks
are probed, the incident takes the job's verdict, and only the culprit's node kills; the others
leave their waiting ranks to torchrun for job_view.launcher_grace_seconds.

    STARTING --first step--> HEALTHY <--progress--> SUSPECT --timeout--> STALLED
        any watched state --remediation starts--> REMEDIATING --process exits--> GONE
        any state --process gone / deregistered / replaced--> GONE
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from prometheus_client.core import Metric

from sidecar.collectors.nic import NicCollector, link_facts
from sidecar.config import Settings
from sidecar.host.procs import is_running
from sidecar.host.signals import Target
from sidecar.incidents.store import Incident, IncidentStore, RankSnapshot
from sidecar.jobview import stragglers
from sidecar.jobview.collectives import Finding
from sidecar.jobview.collectives import stale_after as collectives_stale_after
from sidecar.jobview.report import NodeReport, RankView
from sidecar.metric import MetricSpec, spec
from sidecar.problems import Kind, Problem
from sidecar.ranks.model import Rank, RankKey
from sidecar.ranks.registry import Registry
from sidecar.watchdog.attribution import blame, judge_collectives, refine_blame
from sidecar.watchdog.coordination import (
    JobView,
    Probe,
    adopt,
    everyone_dumped,
    has_culprit,
    local_culprit,
    part_of,
    rank_view,
    recovery_news,
)
from sidecar.watchdog.goodput import Goodput
from sidecar.watchdog.liveness import Liveness
from sidecar.watchdog.recovery import Recoveries
from sidecar.watchdog.remediation import Remediator
from sidecar.watchdog.restarts import NOT_KILLED_NO_RESTART, no_restart_note, no_restart_reasons
from sidecar.watchdog.shadow import Shadow
from sidecar.watchdog.stackdumps import main_frames, stack_top
from sidecar.watchdog.stormcap import OwnerStormCaps
from sidecar.watchdog.timeouts import Deadline, Timeouts
from trainer_hooks.wire import KEEPALIVE_SECONDS

log = logging.getLogger(__name__)


ACCOUNT_EVERY_SECONDS = 1.0  # goodput and recoveries are read this often (not every tick)
LIVENESS_CHECKS_PER_TICK = 64  # ranks whose process is checked per tick, in turn (bounds a tick's cost)
MIN_TICK_SECONDS = 0.01  # the shortest sleep between two ticks
DUE_SLACK_SECONDS = 0.002  # a tick woken for a threshold lands just past it, not a hair before
EARLY_TICK_COST_RATIO = 10.0  # an early tick comes no sooner than 10x the last tick's cost: <= 10% of the loop


class RankState(enum.Enum):
    STARTING = "starting"  # registered, no step yet
    HEALTHY = "healthy"  # progressing within its timeout
    SUSPECT = "suspect"  # past suspect_ratio of its timeout
    STALLED = "stalled"  # past its timeout
    REMEDIATING = "remediating"  # its worker group is being dumped and killed
    GONE = "gone"  # exited, deregistered or replaced by a new registration


WATCHING = frozenset({RankState.STARTING, RankState.HEALTHY, RankState.SUSPECT, RankState.STALLED})
# The only transitions there are. Progress may bring a suspect or stalled rank back (a rank
# re-registered without a step goes back to STARTING); a failed remediation leaves its
# ranks STALLED; GONE is final (a new registration is a new rank).
ALLOWED: dict[RankState, frozenset[RankState]] = {
    RankState.STARTING: frozenset(
        {RankState.HEALTHY, RankState.SUSPECT, RankState.STALLED, RankState.REMEDIATING, RankState.GONE}
    ),
    RankState.HEALTHY: frozenset({RankState.SUSPECT, RankState.STALLED, RankState.REMEDIATING, RankState.GONE}),
    RankState.SUSPECT: frozenset(
        {RankState.STARTING, RankState.HEALTHY, RankState.STALLED, RankState.REMEDIATING, RankState.GONE}
    ),
    RankState.STALLED: frozenset(
        {RankState.STARTING, RankState.HEALTHY, RankState.SUSPECT, RankState.REMEDIATING, RankState.GONE}
    ),
    RankState.REMEDIATING: frozenset({RankState.STALLED, RankState.GONE}),
    RankState.GONE: frozenset(),
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
        "unverified (registered by unverified callers: never signalled), not_killed_no_restart (nothing would "
        "restart the ranks: no launcher, or torchrun's restarts used up; stacks dumped, no signal to end them; "
        "remediation.kill_without_restart), left_to_launcher (the culprit was on another node: torchrun stopped "
        "this node's waiting ranks), resumed (a rank of the job was busy, not hung: the stall was held and the "
        "job progressed again, nothing killed), failed (no rank could be signalled, or remediation itself failed).",
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
    spec(
        "watchdog",
        "rank_waiting_in_collective",
        "gauge",
        "1 when the rank's latest stack (probed once it turned suspect) shows its main thread waiting for its "
        "peers in a collective, 0 when it runs its own code; absent while the rank is healthy or not probed. "
        "With the rank's step, what names the rank that holds a job up (alerts: JobHungOnRank).",
        ["job_id", "rank"],
    ),
    spec(
        "watchdog",
        "rank_collective_enqueued_seq",
        "gauge",
        "The sequence number of the last collective the rank enqueued on the process group, from its Flight "
        "Recorder (sent by the hooks at least every flush interval). A member below its group's highest is late to "
        "the collective the others wait in (alerts: JobHungOnRank).",
        ["job_id", "rank", "pg"],
    ),
    spec(
        "watchdog",
        "rank_collective_completed_seq",
        "gauge",
        "The sequence number of the last collective the rank saw complete on the process group (Flight Recorder). "
        "Below enqueued: the rank waits in a collective.",
        ["job_id", "rank", "pg"],
    ),
    spec(
        "watchdog",
        "rank_collective_record_age_seconds",
        "gauge",
        "Seconds since the rank's collective record last arrived; a live rank's hooks send it at least every "
        "flush interval, so a record that keeps ageing says its process stopped.",
        ["job_id", "rank"],
    ),
    spec(
        "watchdog",
        "stall_verdicts",
        "counter",
        "Stalls by what held the job up (kind: rank_late, collective_stuck, collective_mismatch, rank_running, "
        "oldest_progress, node_lost, first_exit) and the evidence that judged it (collectives: the Flight "
        "Recorder; stacks: the ranks' Python stacks; progress: steps and exits alone). A collective_mismatch is a "
        "desync in the program that a restart repeats.",
        ["job_id", "kind", "evidence"],
    ),
)


@dataclass
class _Track:
    rank: Rank
    state: RankState
    since: float  # watchdog clock of the last transition
    episode: _Episode | None = None
    probe: Probe | None = None  # its stack, looked at since it turned suspect (cleared on progress)
    exited_wall: float | None = None  # wall clock: its process exited without a clean finish
    # (its own last progress, its phase, its timeout) when it turned stalled: its progress horizon
    # moving alone (its hooks fell silent: it may have stepped unseen) does not bring it back
    stalled_on: tuple[float, str | None, float] | None = None


@dataclass
class _Episode:
    """One stall of one job on this node, from detection until its ranks recover or go."""

    job_id: str
    incident: Incident
    keys: list[RankKey]
    task: asyncio.Task | None = None
    outcome: str = "pending"
    suppressed: bool = False
    stacks_done: bool = False  # this node's stacks of the stall are dumped (the job view waits for it)
    holding: bool = False  # a rank of the job here is busy, not hung: no kill while it is judged


@dataclass
class _Counters:
    transitions: Counter = field(default_factory=Counter)  # (from, to)
    stalls: Counter = field(default_factory=Counter)  # job_id
    remediations: Counter = field(default_factory=Counter)  # (job_id, outcome)
    verdicts: Counter = field(default_factory=Counter)  # (job_id, kind, evidence)
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
        # the hooks push at least every max(flush interval, KEEPALIVE_SECONDS); half a second for the way
        self.timeouts = Timeouts(settings.watchdog, max(settings.hooks_flush_interval_seconds, KEEPALIVE_SECONDS) + 0.5)
        self._liveness_cursor = 0
        self._next_due = math.inf  # clock time at which a watched rank next crosses a threshold
        # Told of each rank its remediation is about to signal (the exit tracker: its exit is then
        # the watchdog's doing, not a failure of its own).
        self.on_remediating: Callable[[Rank, str], None] | None = None
        # Told of each rank left to its launcher because the job's culprit is elsewhere (the exit
        # tracker: its exit is a consequence of that job incident).
        self.on_left_to_launcher: Callable[[Rank, str, str], None] | None = None
        self.job_view: JobView | None = None  # this node's reporter of the job view, when it is on
        self.node = settings.node_name
        self._probe_wanted: set[str] = set()  # jobs with a suspect or stalled rank not probed yet
        self._probes: dict[str, asyncio.Task] = {}  # job_id -> its running stack probe
        self.liveness = Liveness(settings, self._probe_wanted.add)  # busy, not hung (liveness.py)
        self.shadow = Shadow(settings, self.timeouts)  # would-be kills, false alarms, learning (shadow.py)
        self._parts: dict[str, Incident] = {}
        self.goodput = Goodput()  # each job's wall time by state (goodput.py)
        self.recoveries = Recoveries(self._save_soon)  # where each recovery's time goes (recovery.py)
        self._accounted_at = -1e9
        self._saves: set[asyncio.Task] = set()  # job_id -> the incident of its last episode in a job incident

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Tick forever. A failing tick is logged and the next one runs: the watchdog must
        outlive any bug in one evaluation."""
        if not self.settings.watchdog.enabled:
            return
        interval = self.settings.watchdog.check_interval_seconds
        try:
            while True:
                started = time.perf_counter()
                try:
                    self.tick()
                except Exception:
                    log.exception("watchdog tick failed")
                await asyncio.sleep(self.next_tick_in(interval, time.perf_counter() - started))
        finally:
            await self.close()

    def next_tick_in(self, interval: float, tick_seconds: float = 0.0) -> float:
        """Seconds to the next tick: `interval`, or sooner when a rank's timeout (or its suspect
        threshold) runs out before then, so that a stall is seen when it is one and not up to an
        interval later. Only a rank about to cross one wakes the loop early; one that keeps
        stepping is far from both. An early tick waits at least EARLY_TICK_COST_RATIO times
        what the last tick took (`tick_seconds`): ranks whose thresholds fall one after another
        (many ranks, or a user registering them on purpose) cannot make ticks take the loop."""
        due = self._next_due - self.clock() + DUE_SLACK_SECONDS
        return min(interval, max(MIN_TICK_SECONDS, EARLY_TICK_COST_RATIO * tick_seconds, due))

    async def close(self) -> None:
        tasks = [e.task for e in self._episodes.values() if e.task and not e.task.done()]
        tasks += [t for t in self._probes.values() if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def tick(self) -> None:
        """One evaluation of every rank, then incidents for newly stalled jobs. Liveness is what
        costs (a pidfd poll, or /proc reads without pidfds): a tick checks it for at most
        LIVENESS_CHECKS_PER_TICK ranks in turn, plus every rank about to change to a worse state
        and every rank being remediated."""
        now = self.clock()
        self._next_due = math.inf
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
        for key in (forgotten := [k for k in self._tracks if k not in present]):
            del self._tracks[key]  # the registry forgot it (retention): so do we
            self.timeouts.forget(key)
            self.liveness.forget(key)
        if forgotten:
            self.timeouts.keep_jobs({job_id for job_id, _ in present})
        self._start_probes()
        if now - self._accounted_at >= ACCOUNT_EVERY_SECONDS:
            self._accounted_at = now
            jobs = self.registry.jobs()
            self.goodput.tick(jobs)
            self.recoveries.tick(jobs)
        self._open_episodes(now)
        self._close_episodes()
        self.remediator.unkillable.check(self.store.save)  # processes that outlived SIGKILL: gone yet?

    def _track(self, rank: Rank, now: float) -> _Track:
        track = self._tracks.get(rank.key)
        if track is not None and track.rank is rank:
            return track
        if track is not None:
            self._transition(track, RankState.GONE, now, "replaced by a new registration")
        # A registration that carries a step is a rank re-registering (the sidecar restarted):
        # it is watched as healthy, with a fresh timer, never as a stall.
        state = RankState.HEALTHY if rank.step is not None else RankState.STARTING
        track = _Track(rank, state, now)
        self._tracks[rank.key] = track
        log.info("watching rank %s (pid %d) as %s", rank.label, rank.pid, state.value)
        return track

    def _evaluate(self, track: _Track, now: float, check_liveness: bool = True) -> None:
        rank = track.rank
        if track.state is RankState.GONE:
            return
        if rank.gone:
            self._transition(track, RankState.GONE, now, rank.gone_reason or "deregistered")
            return
        if (check_liveness or track.state is RankState.REMEDIATING) and self._exited(track, now):
            return
        if track.state is RankState.REMEDIATING:
            return
        d = self.deadline(rank, now)
        suspect_at = self.settings.watchdog.suspect_ratio * d.timeout
        if d.age >= d.timeout:
            wanted = RankState.STALLED
        elif d.age >= suspect_at:
            wanted = RankState.SUSPECT
            self._next_due = min(self._next_due, now + d.timeout - d.age)
        else:
            wanted = RankState.STARTING if rank.step is None else RankState.HEALTHY
            self._next_due = min(self._next_due, now + suspect_at - d.age)
        if (held := self.liveness.hold(rank, track.probe, d, suspect_at, now)) is not None:  # busy, not hung
            wanted, self._next_due = RankState.SUSPECT, min(self._next_due, held)
        if wanted is RankState.STARTING and track.state is RankState.HEALTHY:
            wanted = RankState.HEALTHY  # a started rank never goes back to starting
        if track.state is RankState.STALLED and track.stalled_on == (rank.last_progress, rank.phase, d.timeout):
            wanted = RankState.STALLED  # nothing new from it, nor a new budget: still stalled
        if wanted in (RankState.SUSPECT, RankState.STALLED) and wanted is not track.state and not check_liveness:
            if self._exited(track, now):  # a dead process is never taken for a hung one
                return
        if wanted is not track.state:
            self._transition(track, wanted, now, f"{d.age:.1f}s without progress, timeout {d.timeout:.1f}s ({d.basis})")

    def _exited(self, track: _Track, now: float) -> bool:
        if _process_alive(track.rank):
            return False
        self.registry.mark_gone(track.rank.key, "process exited")
        self._transition(track, RankState.GONE, now, "process exited")
        return True

    def _transition(self, track: _Track, new: RankState, now: float, reason: str) -> None:
        """The one place a rank changes state: checked against ALLOWED, logged, counted."""
        old = track.state
        if new is old:
            return
        if new not in ALLOWED[old]:
            raise IllegalTransition(f"rank {track.rank.label}: {old.value} -> {new.value} ({reason})")
        track.state, track.since, track.stalled_on = new, now, None
        self.counters.transitions[(old.value, new.value)] += 1
        if new is RankState.STALLED:
            r = track.rank
            track.stalled_on = (r.last_progress, r.phase, self.deadline(r, now).timeout)
            self.shadow.stalled(r)
        elif (old is RankState.STALLED and new is not RankState.REMEDIATING) or new is RankState.GONE:
            self._resumed(track, new)
        if new in (RankState.SUSPECT, RankState.STALLED):
            self._want_collectives(track.rank.job_id)
        if new in (RankState.SUSPECT, RankState.STALLED) and track.probe is None:
            self._probe_wanted.add(track.rank.job_id)
        elif new in (RankState.HEALTHY, RankState.STARTING):
            track.probe = None  # progress again: what its stack showed no longer holds
            track.rank.drop_fr_dump()
        elif new is RankState.GONE and reason in ("process exited", "exception"):
            track.exited_wall = time.time()
        if self.job_view is not None:
            self.job_view.wake(track.rank.job_id)
        level = logging.WARNING if new in (RankState.STALLED, RankState.REMEDIATING) else logging.INFO
        log.log(level, "rank %s (pid %d): %s -> %s: %s", track.rank.label, track.rank.pid, old.value, new.value, reason)

    def _resumed(self, track: _Track, new: RankState) -> None:
        """A rank left STALLED, or went: gone, or (its progress back, not being killed) a false alarm."""
        if new is RankState.GONE:
            self.shadow.forget(track.rank.key)
            self.liveness.forget(track.rank.key)
            return
        episode = track.episode or self._episodes.get(track.rank.job_id)
        killing = episode is not None and episode.outcome == "pending" and not episode.holding
        note = self.shadow.resumed(track.rank, killing=killing)
        if note is not None and episode is not None:
            episode.incident.notes.append(note)
            if episode.task is None or episode.task.done():
                self._save_soon(episode.incident)

    def _want_collectives(self, job_id: str) -> None:
        """A rank of the job turned suspect or stalled: every local rank of the job sends a fresh
        collective record, and its whole Flight Recorder dump for the incident, with its next push
        (asked in the push's answer; a stopped rank cannot answer, which is evidence too)."""
        for t in self._tracks.values():
            if t.rank.job_id == job_id and t.state is not RankState.GONE:
                t.rank.wants.update(("collectives", "fr_dump"))
                t.rank.fr_dump_asked = True

    def deadline(self, rank: Rank, now: float | None = None) -> Deadline:
        return self.timeouts.deadline(rank, self.clock() if now is None else now)

    # ------------------------------------------------------------ incidents

    def _open_episodes(self, now: float) -> None:
        stalled_jobs = sorted(
            {t.rank.job_id for t in self._tracks.values() if t.state is RankState.STALLED and t.episode is None}
        )
        for job_id in stalled_jobs:
            if job_id in self._episodes:
                continue  # already being handled; its incident covers this rank too
            self._start_episode(job_id, now)

    def _start_episode(self, job_id: str, now: float) -> None:
        members = [t for t in self._tracks.values() if t.rank.job_id == job_id and t.state in WATCHING]
        members.sort(key=lambda t: t.rank.rank)
        blamed, why = blame([t.rank for t in members], {t.rank.key for t in members if t.state is RankState.STALLED})
        stalled_deadline = self.deadline(blamed, now) if blamed is not None else None
        observe_only = self.shadow.observing(t.rank for t in members)  # the node's mode, or the job's own
        # A kill that nothing restarts turns the hang into a failed job: by default, don't.
        no_restart = [] if observe_only else no_restart_reasons(t.rank for t in members)
        spare = bool(no_restart) and not self.settings.remediation.kill_without_restart
        owner = members[0].rank.owner_uid if members else None
        # Ranks no verified caller registered are never signalled, so their stall spends no slot
        # of the storm cap (a slot another job's real hang may need) and gets no remediation.
        verified = any(t.rank.peer_verified for t in members)
        full = None if observe_only or spare or not verified else self.storm_cap.allow(owner)
        suppressed = full is not None
        incident = self.store.open(
            job_id,
            blamed_rank=blamed.rank if blamed else None,
            blame_reason=why,
            timeout_seconds=stalled_deadline.timeout if stalled_deadline else None,
            observe_only=observe_only,
            ranks=[self._snapshot(t, now) for t in members],
        )
        self.liveness.annotate(incident, [t.rank for t in members])  # the checks that found a rank busy
        episode = _Episode(job_id, incident, [t.rank.key for t in members], suppressed=suppressed)
        self._episodes[job_id] = episode
        for t in members:
            t.episode = episode
        self.counters.stalls[job_id] += 1
        self.counters.last_incident = incident.time
        self.goodput.stalled(job_id, incident.time)
        targets = [target_of(t.rank) for t in members]
        if no_restart:
            incident.notes.append(no_restart_note(no_restart, killing=not spare))
        if observe_only and self.shadow.observed(job_id, [t.rank for t in members], verified):
            incident.notes.append("observe-only: a would-be kill (sidecar_watchdog_would_kill_total)")
        if observe_only or suppressed or not verified or spare:
            episode.outcome = (
                "observe_only"
                if observe_only
                else "suppressed"
                if suppressed
                else "unverified"
                if not verified
                else NOT_KILLED_NO_RESTART
            )
            if suppressed:
                incident.notes.append(f"storm cap: {full} reached; not killing")
            elif not verified and not observe_only:
                incident.notes.append(
                    "no rank of this job was registered by a verified caller: never signalled, no py-spy, "
                    "no storm-cap slot spent"
                )
            log.error(
                "job %s stalled (%s); %s",
                job_id,
                incident.summary,
                "observe-only mode: not killing"
                if observe_only
                else "storm cap reached: not killing"
                if suppressed
                else "registered by unverified callers: not killing"
                if not verified
                else "nothing would restart its ranks: not killing",
            )
            episode.task = asyncio.get_running_loop().create_task(
                self._observe(episode, targets), name=f"observe-{job_id}"
            )
            return
        if self._coordinated(job_id):
            log.error("job %s stalled: %s; asking the job's coordinator who holds it up", job_id, why)
            episode.task = asyncio.get_running_loop().create_task(
                self._coordinate(episode, targets), name=f"coordinate-{job_id}"
            )
            return
        log.error("job %s stalled: %s; remediating %d local rank(s)", job_id, why, len(members))
        if not any(self.liveness.alive(t.rank.key, now) for t in members):
            self._begin_kill(episode, now)  # else the task holds first (_hold_while_alive)
        episode.task = asyncio.get_running_loop().create_task(
            self._remediate(episode, targets), name=f"remediate-{job_id}"
        )

    def _coordinated(self, job_id: str) -> bool:
        """The job's coordinator is known and answers: the stall is handled as the job's."""
        jv = self.job_view
        return jv is not None and jv.coordinator(job_id) is not None and jv.reachable(job_id)

    def _begin_kill(self, episode: _Episode, now: float) -> None:
        for key in episode.keys:
            t = self._tracks.get(key)
            if t is None or t.episode is not episode or t.state not in WATCHING:
                continue
            self._transition(t, RankState.REMEDIATING, now, f"its job {episode.job_id} stalled")
            if self.on_remediating is not None:
                self.on_remediating(t.rank, episode.incident.id)

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
            await self._await_probe(episode.job_id)
            await self.remediator.collect_stacks(incident, targets)
            refine_blame(incident)
            await self._collectives(episode)
            await self._attach_links(incident)
            outcome = "resumed" if await self._hold_while_alive(episode) else await self._kill(episode, targets)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # remediation bugs must not take the watchdog down
            log.exception("remediation of job %s failed", episode.job_id)
            episode.incident.notes.append(f"remediation error: {type(e).__name__}: {e}")
            outcome = "failed"
        self._end_remediation(episode, outcome)

    async def _collectives(self, episode: _Episode) -> Finding | None:
        """The episode's ranks' collective records into its incident, with the local judgement
        they give, and the Flight Recorder dumps the ranks sent since they stopped progressing."""
        incident, now = episode.incident, self.clock()
        ranks = [t.rank for key in episode.keys if (t := self._tracks.get(key)) is not None]
        stale_after = collectives_stale_after(self.settings.hooks_flush_interval_seconds)
        finding = judge_collectives(incident, ranks, self.node, now, stale_after)
        dumps = {
            r.rank: r.fr_dump for r in ranks
            if r.fr_dump is not None and r.fr_dump_at is not None and r.fr_dump_at >= r.last_progress
        }  # fmt: skip
        if dumps:  # up to a few MiB of pickles: written off the event loop
            await asyncio.get_running_loop().run_in_executor(None, self.store.save_fr_dumps, incident, dumps)
        return finding

    async def _attach_links(self, incident: Incident) -> None:
        """A stuck collective is the network's or the backend's: the incident keeps what this node's
        NICs and InfiniBand ports say (read off the event loop)."""
        if incident.hang_kind != "collective_stuck":
            return
        try:
            collector = NicCollector(
                self.settings.collectors.sysfs_root, self.settings.collectors.nic_exclude,
                self.settings.collectors.max_nics,
            )  # fmt: skip
            incident.links = await asyncio.get_running_loop().run_in_executor(None, link_facts, collector)
        except Exception as e:  # a missing sysfs: the record says so, the remediation goes on
            incident.notes.append(f"this node's links could not be read: {type(e).__name__}: {e}")

    async def _kill(self, episode: _Episode, targets: list[Target]) -> str:
        """SIGTERM, the grace, SIGKILL of the episode's ranks still being remediated."""
        incident = episode.incident
        self._begin_kill(episode, self.clock())
        self.store.save(incident)  # the stacks are on disk before any signal
        term = await self.remediator.sigterm(incident, targets)
        self.store.save(incident)
        return "failed" if term is None else await self.remediator.kill_survivors_after_grace(incident, term)

    async def _coordinate(self, episode: _Episode, targets: list[Target]) -> None:
        """A stall the job's other nodes share (module docstring of coordination.py): dump, take
        the verdict, then kill if the culprit is here, else leave the ranks to torchrun."""
        job_id, incident, jv = episode.job_id, episode.incident, self.job_view
        assert jv is not None  # only coordinated episodes come here
        wait = self.settings.job_view.verdict_wait_seconds
        try:
            await self._await_probe(job_id)
            await self.remediator.collect_stacks(incident, targets)
            refine_blame(incident)
            finding = await self._collectives(episode)
            self._probes_from(incident)
            episode.stacks_done = True
            self.store.save(incident)
            jv.wake(job_id)
            verdict = await jv.wait_for(job_id, has_culprit, wait)
            adopt(incident, verdict, self.node)
            await self._attach_links(incident)
            here = local_culprit(verdict, self.node, {t.rank for t in targets})
            if here is None:
                late_here = finding is not None and finding.culprit is not None
                running = [s.rank for s in incident.ranks if s.in_collective is False]
                here = late_here or bool(running) or not jv.reachable(job_id)
                incident.notes.append(
                    f"no culprit from the job's coordinator within job_view.verdict_wait_seconds ({wait:g}s); "
                    + (
                        "this node's collective records show a local rank late to its peers' collective"
                        if late_here
                        else "this node's own stacks show a rank not waiting for its peers"
                        if running
                        else "the coordinator does not answer"
                        if here
                        else "every local rank waits in a collective"
                    )  # fmt: skip
                )
            self.store.save(incident)
            if here and await self._hold_while_alive(episode):
                outcome = "resumed"
            elif here:
                dumped = await jv.wait_for(job_id, everyone_dumped, wait)
                if not everyone_dumped(dumped):
                    missing = dumped.not_dumped if dumped is not None else []
                    incident.notes.append(
                        f"killing before every node had dumped its stacks (waited {wait:g}s"
                        + (f"; missing: {', '.join(missing[:8])}" if missing else "")
                        + ")"
                    )
                outcome = await self._kill(episode, targets)
            else:
                outcome = await self._leave_to_launcher(episode, targets)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # coordination bugs must not take the watchdog down
            log.exception("remediation of job %s failed", job_id)
            incident.notes.append(f"remediation error: {type(e).__name__}: {e}")
            outcome = "failed"
        self._end_remediation(episode, outcome)

    async def _hold_while_alive(self, episode: _Episode) -> bool:
        """Before a kill: while a rank of the job here shows life the watchdog has not finished
        judging (`Liveness.alive`: busy at its last check, being checked, or its CPU time growing),
        the stalled ranks may only be waiting for it (a barrier while rank 0 works alone). Hold until
        it is judged hung (at the latest watchdog.ceiling_seconds after its progress) or the job
        progresses again. True: the stall ended by itself, nothing is killed."""
        incident, interval = episode.incident, self.settings.watchdog.check_interval_seconds
        held_at: float | None = None
        while True:
            now = self.clock()
            mine = [t for key in episode.keys if (t := self._tracks.get(key)) is not None and t.episode is episode]
            if not any(t.state in (RankState.STALLED, RankState.REMEDIATING) for t in mine):
                if held_at is not None:
                    incident.event("resumed_by_itself", held_seconds=round(now - held_at, 3))
                    incident.notes.append(
                        f"not killed: the job progressed again {now - held_at:.1f}s into the hold for its busy rank(s)"
                    )
                    log.warning("job %s: progressing again after %.1fs; not killed", episode.job_id, now - held_at)
                return True
            alive = [t for t in mine if t.state is RankState.SUSPECT and self.liveness.alive(t.rank.key, now)]
            if not alive:
                episode.holding = False
                if held_at is not None:
                    incident.event("hold_ended", held_seconds=round(now - held_at, 3))
                return False
            if held_at is None:
                held_at, episode.holding = now, True
                busy = ", ".join(str(t.rank.rank) for t in alive)
                waiting = ", ".join(str(t.rank.rank) for t in mine if t.state is RankState.STALLED)
                incident.event("held_busy", busy_ranks=[t.rank.rank for t in alive])
                incident.notes.append(
                    f"held: rank(s) {busy} busy (CPU time growing, stack moving) while rank(s) {waiting} waited; "
                    f"judged again every check, stalled anyway at watchdog.ceiling_seconds"
                )
                self.store.save(incident)
                log.warning(
                    "job %s: rank(s) %s stalled, rank(s) %s busy, not hung: no kill while the busy rank(s) are "
                    "judged (stalled anyway at watchdog.ceiling_seconds, %gs)",
                    episode.job_id, waiting, busy, self.settings.watchdog.ceiling_seconds,
                )  # fmt: skip
            await asyncio.sleep(interval)

    async def _leave_to_launcher(self, episode: _Episode, targets: list[Target]) -> str:
        """The culprit is on another node: its node kills its group, torchrun's agents then stop
        the others for the re-rendezvous. Wait for that; kill here only past the grace."""
        incident, grace = episode.incident, self.settings.job_view.launcher_grace_seconds
        incident.event("left_to_launcher", grace_seconds=grace)
        for key in episode.keys:
            t = self._tracks.get(key)
            if t is not None and self.on_left_to_launcher is not None:
                self.on_left_to_launcher(t.rank, incident.job_incident or incident.id, incident.blamed)
        self.store.save(incident)
        deadline = self.clock() + grace
        interval = self.settings.watchdog.check_interval_seconds
        while True:
            waiting = [
                t for key in episode.keys if (t := self._tracks.get(key)) is not None and t.episode is episode
                and t.state in (RankState.SUSPECT, RankState.STALLED)
            ]  # fmt: skip
            if not waiting:
                mine = [t for key in episode.keys if (t := self._tracks.get(key)) is not None and t.episode is episode]
                if episode.holding and mine and all(t.state is RankState.HEALTHY for t in mine):
                    incident.event("resumed_by_itself")
                    incident.notes.append("not killed: the job progressed again once its busy rank was done")
                    return "resumed"
                incident.event("restarted_by_launcher")
                return "left_to_launcher"
            verdict = self.job_view.verdict(episode.job_id) if self.job_view is not None else None
            # bounded by the ceiling since this node's own ranks progressed: the word of another node
            # (whoever holds the job's key) may delay its own job's recovery, never forever
            below_ceiling = max(self.deadline(t.rank).age for t in waiting) < self.settings.watchdog.ceiling_seconds
            if verdict is not None and verdict.culprit is not None and verdict.culprit.busy and below_ceiling:
                if not episode.holding:
                    episode.holding = True  # its node holds it (and so does this one): a pause, not a hang
                    incident.event("held_busy", busy_ranks=[verdict.culprit.rank])
                    self.store.save(incident)
                deadline = self.clock() + grace  # the grace counts from when it is no longer busy
            elif self.clock() >= deadline:
                break
            await asyncio.sleep(interval)
        left = {t.rank.rank for t in waiting}
        incident.notes.append(
            f"ranks {', '.join(map(str, sorted(left)))} still stalled {grace:g}s after the culprit's node was left to "
            "act (job_view.launcher_grace_seconds): killed here"
        )
        return await self._kill(episode, [t for t in targets if t.rank in left])

    def _end_remediation(self, episode: _Episode, outcome: str) -> None:
        self._finish(episode, outcome)
        if outcome in ("killed", "left_to_launcher"):  # the ranks are gone: follow the next attempt
            ranks = [t.rank for key in episode.keys if (t := self._tracks.get(key)) is not None]
            steps = [s.step for s in episode.incident.ranks if s.step is not None]
            times = sorted(x for r in ranks for x in r.step_times)
            step_time = times[len(times) // 2] if times else None
            self.recoveries.start(episode.incident, ranks, max(steps) if steps else None, step_time)
        if outcome != "killed":
            now = self.clock()
            for key in episode.keys:
                t = self._tracks.get(key)
                if t is not None and t.episode is episode and t.state is RankState.REMEDIATING:
                    self._transition(t, RankState.STALLED, now, f"remediation {outcome}")

    async def _observe(self, episode: _Episode, targets: list[Target]) -> None:
        """Stalls left alive: stacks, the incident (with the job's verdict, when the job view has one),
        the count; no signal that ends a process. Observe-only and storm-capped stalls get py-spy's
        stacks only (it reads memory and never signals); a stall nothing would restart also gets the
        ranks' own dump signal."""
        try:
            await self._await_probe(episode.job_id)
            spared = episode.outcome == NOT_KILLED_NO_RESTART
            await self.remediator.collect_stacks(episode.incident, targets, signal_ranks=spared)
            refine_blame(episode.incident)
            await self._collectives(episode)
            self._probes_from(episode.incident)
            episode.stacks_done = True
            if self._coordinated(episode.job_id):
                assert self.job_view is not None
                self.job_view.wake(episode.job_id)
                wait = self.settings.job_view.verdict_wait_seconds
                adopt(episode.incident, await self.job_view.wait_for(episode.job_id, has_culprit, wait), self.node)
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
        incident = episode.incident
        kind = incident.hang_kind or ("rank_running" if incident.evidence == "stacks" else "oldest_progress")
        self.counters.verdicts[(episode.job_id, kind, incident.evidence or "progress")] += 1
        if episode.incident.job_incident is not None:
            self._parts[episode.job_id] = episode.incident
        if self.job_view is not None:
            self.job_view.wake(episode.job_id)

    def _save_soon(self, incident: Incident) -> None:
        """Write an incident again off the event loop (a recovery's milestones)."""
        task = asyncio.get_running_loop().create_task(self.store.save_async(incident))
        self._saves.add(task)
        task.add_done_callback(self._saves.discard)

    # ------------------------------------------------------------ stack probes

    def _start_probes(self) -> None:
        """One probe per job at a time: the stacks of its suspect and stalled ranks not probed yet
        and not being remediated (an episode dumps its own), and of those the liveness check wants
        another look at (also while their job's episode holds for them)."""
        for job_id in sorted(self._probe_wanted):
            running = self._probes.get(job_id)
            if running is not None and not running.done():
                continue
            self._probe_wanted.discard(job_id)
            tracks = [
                t for t in self._tracks.values() if t.rank.job_id == job_id
                and (t.probe is None or self.liveness.wants_probe(t.rank.key))
                and t.state in (RankState.SUSPECT, RankState.STALLED)
                and (t.episode is None or self.liveness.wants_probe(t.rank.key))
            ]  # fmt: skip
            if tracks:
                self._probes[job_id] = asyncio.get_running_loop().create_task(
                    self._probe(job_id, tracks), name=f"probe-{job_id}"
                )

    async def _probe(self, job_id: str, tracks: list[_Track]) -> None:
        """Whether each suspect rank waits in a collective, and its innermost frame: the stack
        dump the hooks write on their signal (no py-spy: a probe must be cheap). Not saved as an
        incident; what it shows is exported and reported to the job's coordinator."""
        now = self.clock()
        scratch = Incident(
            id="probe", time=time.time(), job_id=job_id, node=self.node, blamed_rank=None, blame_reason="",
            timeout_seconds=None, observe_only=True, ranks=[self._snapshot(t, now) for t in tracks],
        )  # fmt: skip
        try:
            # Observe-only never signals: py-spy's non-blocking read instead of the hooks' dump.
            observe = self.shadow.observing(t.rank for t in tracks)
            targets = [target_of(t.rank) for t in tracks]
            await self.remediator.collect_stacks(
                scratch, targets, signal_ranks=not observe, use_py_spy=observe, continue_stopped=False
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("probing the stacks of job %s failed", job_id)
            return
        self._probes_from(scratch, tracks)
        if self.job_view is not None:
            self.job_view.wake(job_id)

    def _probes_from(self, incident: Incident, tracks: list[_Track] | None = None) -> None:
        """What a dump of the incident's ranks showed, as each rank's probe."""
        by_rank = {s.rank: s for s in incident.ranks}
        now = self.clock()
        for t in (
            tracks if tracks is not None else [t for t in self._tracks.values() if t.rank.job_id == incident.job_id]
        ):
            snap = by_rank.get(t.rank.rank)
            if snap is None or (snap.in_collective is None and t.probe is not None):
                continue
            text = "\n".join(snap.stack_head) if snap.stack_head else (snap.py_spy or "")
            t.probe = Probe(snap.in_collective, stack_top(text), now, main_frames(text))

    async def _await_probe(self, job_id: str) -> None:
        """An episode's own dumps wait for a probe of the same ranks still running."""
        running = self._probes.get(job_id)
        if running is not None and not running.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(running)

    # ------------------------------------------------------------ the job view

    def node_report(self, job_id: str) -> NodeReport | None:
        """This node's picture of the job for its coordinator (None: no rank of it here)."""
        tracks = [t for t in self._tracks.values() if t.rank.job_id == job_id]
        if not tracks:
            return None
        now, wall = self.clock(), time.time()
        recent = self.settings.job_view.lost_after_seconds
        ranks: list[RankView] = []
        lateness: list[stragglers.RankEntries] = []
        for t in sorted(tracks, key=lambda t: t.rank.rank):
            r = t.rank
            exited = t.exited_wall if t.exited_wall is not None and wall - t.exited_wall <= recent else None
            if t.state is RankState.GONE and exited is None:
                continue
            age = now - r.last_progress
            busy = t.state is RankState.SUSPECT and self.liveness.alive(r.key, now)
            view = rank_view(r.rank, r.local_rank, t.state.value, r.step, r.phase, age, t.probe, exited, busy)
            if r.collectives is not None and t.state is not RankState.GONE:
                view.collectives, view.collectives_age = r.collectives, round(r.collectives_age(now) or 0.0, 3)
                entries = stragglers.entries_of(r.rank, r.collectives)  # the reporter sends those that moved
                if entries is not None:
                    lateness.append(entries)
            ranks.append(view)
        verdict = self.job_view.verdict(job_id) if self.job_view is not None else None
        current = verdict.job_incident if verdict is not None and not verdict.closed else None
        episode = self._episodes.get(job_id)
        report = NodeReport(
            job_id=job_id, node=self.node, world_size=max(t.rank.world_size for t in tracks), time=wall,
            ranks=ranks, job_incident=current, lateness=lateness,
        )  # fmt: skip
        if episode is not None and episode.stacks_done and current is not None:
            report.dumped = current
        recorded = episode.incident if episode is not None else self._parts.get(job_id)
        within = 3 * self.settings.job_view.report_interval_seconds  # its recovery's stages, after the close too
        if (
            recorded is not None
            and recorded.job_incident is not None
            and (
                episode is not None
                or recorded.job_incident == current
                or recovery_news(recorded, current, wall, within)
            )
        ):
            report.job_incident = recorded.job_incident
            report.part = part_of(recorded, recorded.outcome)
            if episode is None:
                report.dumped = recorded.job_incident
        return report

    def _close_episodes(self) -> None:
        """An episode ends when its task is done and none of its ranks is stalled or being
        remediated any more (they progressed, exited, or were replaced)."""
        for job_id, episode in list(self._episodes.items()):
            if episode.task is not None and not episode.task.done():
                continue
            active = [
                t
                for t in self._tracks.values()
                if t.episode is episode and t.state in (RankState.STALLED, RankState.REMEDIATING)
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
        state, timeout, stalls, remediations, transitions, last, observe, waiting, enq, done, age, verdicts = (
            m.family() for m in METRICS
        )
        now = self.clock()
        tracks = list(self._tracks.values())
        if only is not None:
            tracks = [t for t in tracks if t.rank.key in only]
        for t in sorted(tracks, key=lambda t: t.rank.key):
            labels = [t.rank.job_id, str(t.rank.rank)]
            for s in RankState:
                state.add_metric(labels + [s.value], 1.0 if s is t.state else 0.0)
            if t.state is not RankState.GONE:
                timeout.add_metric(labels, self.deadline(t.rank, now).timeout)
                if t.probe is not None and t.probe.waiting is not None:
                    waiting.add_metric(labels, 1.0 if t.probe.waiting else 0.0)
                record = t.rank.collectives
                if record is not None:
                    age.add_metric(labels, t.rank.collectives_age(now) or 0.0)
                    for g in record.groups:
                        enq.add_metric(labels + [g.pg], g.enqueued)
                        done.add_metric(labels + [g.pg], g.completed)
        for job_id, n in sorted(self.counters.stalls.items()):
            stalls.add_metric([job_id], n)
        for (job_id, outcome), n in sorted(self.counters.remediations.items()):
            remediations.add_metric([job_id, outcome], n)
        for (job_id, kind, evidence), n in sorted(self.counters.verdicts.items()):
            verdicts.add_metric([job_id, kind, evidence], n)
        for (old, new), n in sorted(self.counters.transitions.items()):
            transitions.add_metric([old, new], n)
        if self.counters.last_incident is not None:
            last.add_metric([], self.counters.last_incident)
        observe.add_metric([], 1.0 if self.settings.watchdog.observe_only else 0.0)
        return [
            state, timeout, stalls, remediations, transitions, last, observe, waiting, enq, done, age, verdicts,
            *self.goodput.families(), *self.recoveries.families(), *self.shadow.families(),
        ]  # fmt: skip

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
            "shadow": self.shadow.status(),  # per job: would-be kills, false alarms, what they taught (shadow.py)
        }

    def rank_state(self, rank: Rank) -> str:
        track = self._tracks.get(rank.key)
        if track is not None and track.rank is rank:
            return track.state.value
        if rank.gone:
            return RankState.GONE.value
        return (RankState.HEALTHY if rank.step is not None else RankState.STARTING).value

    def timeout_for(self, rank: Rank) -> float | None:
        if rank.gone or self.rank_state(rank) == RankState.GONE.value:
            return None
        return self.deadline(rank).timeout

    def problems(self) -> list[Problem]:
        out = []
        for t in sorted(self._tracks.values(), key=lambda t: t.rank.key):
            if t.state in (RankState.SUSPECT, RankState.STALLED, RankState.REMEDIATING):
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
