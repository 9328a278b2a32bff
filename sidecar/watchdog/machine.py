"""The progress watchdog: one explicit state machine per registered rank.

Every `check_interval_seconds` the watchdog reads the registry and moves each rank between
states (sidecar/watchdog/states.py). Progress means the step counter advancing (or a declared phase
ending); how long a rank may go without it depends on what it is doing (the policy:
sidecar/watchdog/timeouts.py).

A rank is SUSPECT past `suspect_ratio` of its timeout and STALLED past all of it. The first
STALLED rank of a job opens an episode (sidecar/watchdog/episode.py): one rank blamed, an incident,
and (unless it is in observe-only mode or the storm cap is reached) the job's local worker group
remediated, as its own task while the watchdog keeps ticking. Process liveness is a separate
signal: a rank whose process is gone is GONE, never remediated (torchrun handles crashes).

With the job view (sidecar/watchdog/coordination.py) a stall is the job's: a suspect rank's stacks
are probed (sidecar/watchdog/probes.py), the incident takes the job's verdict, and only the
culprit's node kills; the others leave their waiting ranks to torchrun for
job_view.launcher_grace_seconds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Collection, Iterable

from prometheus_client.core import Metric

from sidecar.config import Settings
from sidecar.host import procs
from sidecar.host.procs import is_running
from sidecar.incidents.store import Incident, IncidentStore
from sidecar.jobview.report import NodeReport
from sidecar.problems import Kind, Problem
from sidecar.ranks.model import Rank, RankKey
from sidecar.ranks.registry import Registry
from sidecar.watchdog.coordination import JobView, open_verdict
from sidecar.watchdog.episode import Episode, Track
from sidecar.watchdog.episode_course import open_episode, start_episode
from sidecar.watchdog.goodput import Goodput
from sidecar.watchdog.liveness import Liveness
from sidecar.watchdog.metrics import METRICS, Counters
from sidecar.watchdog.probes import Probes, node_report
from sidecar.watchdog.recovery import Recoveries
from sidecar.watchdog.remediation import Remediator
from sidecar.watchdog.shadow import Shadow
from sidecar.watchdog.states import ALLOWED, WATCHING, IllegalTransition, RankState
from sidecar.watchdog.stormcap import OwnerStormCaps
from sidecar.watchdog.timeouts import Deadline, Timeouts
from trainer_hooks.wire import KEEPALIVE_SECONDS

log = logging.getLogger(__name__)


ACCOUNT_EVERY_SECONDS = 1.0  # goodput and recoveries are read this often (not every tick)
LIVENESS_CHECKS_PER_TICK = 64  # ranks whose process is checked per tick, in turn (bounds a tick's cost)
MIN_TICK_SECONDS = 0.01  # the shortest sleep between two ticks
DUE_SLACK_SECONDS = 0.002  # a tick woken for a threshold lands just past it, not a hair before
EARLY_TICK_COST_RATIO = 10.0  # an early tick comes no sooner than 10x the last tick's cost: <= 10% of the loop


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
        self.counters = Counters()
        self._tracks: dict[RankKey, Track] = {}
        self.replaced: dict[RankKey, Track] = {}  # exited, then replaced: reported once more (probes.reported)
        self._loaders: dict[RankKey, tuple[Rank, float, bool]] = {}  # _loader_stuck: (rank, read at, stuck)
        self._episodes: dict[str, Episode] = {}
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
        self.probes = Probes(self)  # stack probes of suspect ranks (probes.py)
        self._probes = self.probes.running  # job_id -> its running stack probe
        self.liveness = Liveness(settings, self.probes.wanted.add)  # busy, not hung (liveness.py)
        self.shadow = Shadow(settings, self.timeouts)  # would-be kills, false alarms, learning (shadow.py)
        self.parts: dict[str, Incident] = {}  # job_id -> the incident of its last episode in a job incident
        self.goodput = Goodput()  # each job's wall time by state (goodput.py)
        self.recoveries = Recoveries(self._save_soon)  # where each recovery's time goes (recovery.py)
        self._accounted_at = -1e9
        self._saves: set[asyncio.Task] = set()

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
            self.replaced.pop(key, None)
            self.timeouts.forget(key)
            self.liveness.forget(key)
        if forgotten:
            self.timeouts.keep_jobs({job_id for job_id, _ in present})
        self.probes.start()
        if now - self._accounted_at >= ACCOUNT_EVERY_SECONDS:
            self._accounted_at = now
            jobs = self.registry.jobs()
            self.goodput.tick(jobs)
            self.recoveries.tick(jobs)
        self._open_episodes(now)
        self._close_episodes()
        self.remediator.unkillable.check(self.store.save)  # processes that outlived SIGKILL: gone yet?

    def _track(self, rank: Rank, now: float) -> Track:
        track = self._tracks.get(rank.key)
        if track is not None and track.rank is rank:
            return track
        if track is not None:
            old = track.rank  # its exit, if it went before a tick saw it, is its evidence still
            why = (old.gone_reason or "deregistered") if old.gone else "replaced by a new registration"
            self._transition(track, RankState.GONE, now, why)
            if track.exited_wall is not None:
                self.replaced[rank.key] = track
        # A registration that carries a step is a rank re-registering (the sidecar restarted):
        # it is watched as healthy, with a fresh timer, never as a stall.
        state = RankState.HEALTHY if rank.step is not None else RankState.STARTING
        track = Track(rank, state, now)
        self._tracks[rank.key] = track
        if self.job_view is not None:  # news for the job's coordinator: an incident it holds may close
            self.job_view.wake(rank.job_id)
        log.info("watching rank %s (pid %d) as %s", rank.label, rank.pid, state.value)
        return track

    def _evaluate(self, track: Track, now: float, check_liveness: bool = True) -> None:
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
        if wanted in (RankState.HEALTHY, RankState.STARTING) and track.state in (RankState.SUSPECT, RankState.STALLED):
            if procs.state(rank.pid, rank.pid_start_time) in ("T", "t", "F"):  # stopped: no late push makes it healthy
                wanted = track.state
        if wanted is RankState.STARTING and track.state is RankState.HEALTHY:
            wanted = RankState.HEALTHY  # a started rank never goes back to starting
        if track.state is RankState.STALLED and track.stalled_on == (rank.last_progress, rank.phase, d.timeout):
            wanted = RankState.STALLED  # nothing new from it, nor a new budget: still stalled
        if wanted in (RankState.SUSPECT, RankState.STALLED) and wanted is not track.state and not check_liveness:
            if self._exited(track, now):  # a dead process is never taken for a hung one
                return
        if wanted is not track.state:
            self._transition(track, wanted, now, f"{d.age:.1f}s without progress, timeout {d.timeout:.1f}s ({d.basis})")

    def _exited(self, track: Track, now: float) -> bool:
        if _process_alive(track.rank):
            return False
        self.registry.mark_gone(track.rank.key, "process exited")
        self._transition(track, RankState.GONE, now, "process exited")
        return True

    def _transition(self, track: Track, new: RankState, now: float, reason: str) -> None:
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
            self.probes.wanted.add(track.rank.job_id)
        elif new in (RankState.HEALTHY, RankState.STARTING):
            track.probe = None  # progress again: what its stack showed no longer holds
            track.rank.drop_fr_dump()
        elif new is RankState.GONE and reason in ("process exited", "exception"):
            track.exited_wall = track.rank.exited_wall()
        if self.job_view is not None:
            self.job_view.wake(track.rank.job_id)
        level = logging.WARNING if new in (RankState.STALLED, RankState.REMEDIATING) else logging.INFO
        log.log(level, "rank %s (pid %d): %s -> %s: %s", track.rank.label, track.rank.pid, old.value, new.value, reason)

    def _resumed(self, track: Track, new: RankState) -> None:
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
        now = self.clock() if now is None else now
        return self.timeouts.deadline(rank, now, self._left_behind(rank), self._loader_stuck(rank, now))

    def _loader_stuck(self, rank: Rank, now: float) -> bool:
        """A rank in a data_load phase (inferred by its hooks, or declared) whose DataLoader worker is
        stopped or in D: the wait cannot end, so the phase's budget does not hold it (dataloader_stuck,
        not a pause). Read at most once a second per rank: deadlines are asked many times a tick."""
        if rank.phase != "data_load" or not rank.peer_verified:
            self._loaders.pop(rank.key, None)
            return False
        seen = self._loaders.get(rank.key)
        if seen is None or seen[0] is not rank or now - seen[1] >= 1.0:
            ours = procs.state(rank.pid, rank.pid_start_time) is not None  # still the rank's own process
            seen = self._loaders[rank.key] = (rank, now, ours and bool(procs.child_states(rank.pid) & procs.HALTED))
        return seen[2]

    def _left_behind(self, rank: Rank) -> bool:
        """The job view's open verdict names this rank of this node as the one its peers wait for,
        from the collective record (rank_late): Timeouts.progress_horizon adds no push gap."""
        verdict = open_verdict(self.job_view, rank.job_id)
        culprit = verdict.culprit if verdict is not None else None
        return (
            culprit is not None
            and culprit.kind == "rank_late"
            and not culprit.busy
            and culprit.rank == rank.rank
            and culprit.node == self.node
        )

    # ------------------------------------------------------------ episodes

    def _open_episodes(self, now: float) -> None:
        stalled_jobs = sorted(
            {t.rank.job_id for t in self._tracks.values() if t.state is RankState.STALLED and t.episode is None}
        )
        for job_id in stalled_jobs:
            if job_id in self._episodes:
                continue  # already being handled; its incident covers this rank too
            members = [t for t in self._tracks.values() if t.rank.job_id == job_id and t.state in WATCHING]
            members.sort(key=lambda t: t.rank.rank)
            episode = open_episode(self, job_id, members, now)  # blame and the incident (episode_course.py)
            self._episodes[job_id] = episode
            for t in members:
                t.episode = episode
            start_episode(episode, members, now)

    def begin_kill(self, episode: Episode, now: float) -> None:
        """An episode's kill begins: its ranks still watched go REMEDIATING (the exit tracker told)."""
        for key in episode.keys:
            t = self._tracks.get(key)
            if t is None or t.episode is not episode or t.state not in WATCHING:
                continue
            self._transition(t, RankState.REMEDIATING, now, f"its job {episode.job_id} stalled")
            if self.on_remediating is not None:
                self.on_remediating(t.rank, episode.incident.id)

    def stalled_again(self, episode: Episode, outcome: str) -> None:
        """A remediation ended without killing: its ranks still being remediated are STALLED again."""
        now = self.clock()
        for key in episode.keys:
            t = self._tracks.get(key)
            if t is not None and t.episode is episode and t.state is RankState.REMEDIATING:
                self._transition(t, RankState.STALLED, now, f"remediation {outcome}")

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

    def track(self, key: RankKey) -> Track | None:
        return self._tracks.get(key)

    def tracks_of(self, job_id: str) -> list[Track]:
        return [t for t in self._tracks.values() if t.rank.job_id == job_id]

    async def await_probe(self, job_id: str) -> None:
        await self.probes.wait(job_id)

    def probes_from(self, incident: Incident) -> None:
        self.probes.record(incident)

    def _save_soon(self, incident: Incident) -> None:
        """Write an incident again off the event loop (a recovery's milestones), and tell the job's
        coordinator at once (its story's stages for this node), not at the next report."""
        task = asyncio.get_running_loop().create_task(self.store.save_async(incident))
        self._saves.add(task)
        task.add_done_callback(self._saves.discard)
        if self.job_view is not None and incident.job_incident is not None:
            self.job_view.wake(incident.job_id)

    def node_report(self, job_id: str) -> NodeReport | None:
        """This node's picture of the job for its coordinator (None: no rank of it here)."""
        return node_report(self, job_id, self._episodes.get(job_id))

    # ------------------------------------------------------------ reading

    def families(self, only: Collection[RankKey] | None = None) -> Iterable[Metric]:
        """The watchdog's families; per-rank series only of the ranks in `only` (None: all)."""
        state, timeout, stalls, remediations, transitions, last, observe, waiting, enq, done, age, verdicts, drills = (
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
        for (job_id, outcome), n in sorted(self.counters.drills.items()):
            drills.add_metric([job_id, outcome], n)
        for (old, new), n in sorted(self.counters.transitions.items()):
            transitions.add_metric([old, new], n)
        if self.counters.last_incident is not None:
            last.add_metric([], self.counters.last_incident)
        observe.add_metric([], 1.0 if self.settings.watchdog.observe_only else 0.0)
        return [
            state, timeout, stalls, remediations, transitions, last, observe, waiting, enq, done, age, verdicts, drills,
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
            **self.counters.stall_outcomes(),  # stalls since start and what became of them
        }

    def rank_state(self, rank: Rank) -> str:
        if rank.gone:  # it said goodbye (or its exit was seen): gone now, not at the next tick
            return RankState.GONE.value
        track = self._tracks.get(rank.key)
        if track is not None and track.rank is rank:
            return track.state.value
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
