"""One stall of one job on this node, from detection until its ranks recover or go: an `Episode`,
and the steps it takes, in the order of its life (how it opens and which way it goes through them:
episode_course.py).

    dump       the ranks' stacks (remediation.py), blame refined, their collective records, the links
    hold       a rank it waits for is busy, not hung: no signal while it is judged
    kill       SIGTERM, the grace, SIGKILL (remediation.py) ... or leave the ranks to the launcher
    end        the outcome, counted and saved; after a kill, the recovery is followed (recovery.py)

The per-rank state machine (machine.py) opens an episode for the first stalled rank of a job, moves its
ranks to REMEDIATING when the episode begins a kill and back to STALLED when one ends without killing,
and closes the episode once its ranks progressed, exited or were replaced.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from sidecar import hang_kinds
from sidecar.collectors.nic import NicCollector, link_facts
from sidecar.config import Settings
from sidecar.host.signals import Target
from sidecar.incidents.store import Incident, IncidentStore, RankSnapshot
from sidecar.jobview.collectives import Finding
from sidecar.jobview.collectives import stale_after as collectives_stale_after
from sidecar.ranks.model import Rank, RankKey
from sidecar.watchdog import pause
from sidecar.watchdog.attribution import judge_collectives, refine_blame
from sidecar.watchdog.coordination import JobView, Probe, adopt, names_here_now
from sidecar.watchdog.goodput import Goodput
from sidecar.watchdog.liveness import Liveness
from sidecar.watchdog.metrics import Counters
from sidecar.watchdog.recovery import Recoveries
from sidecar.watchdog.remediation import Remediator
from sidecar.watchdog.shadow import Shadow
from sidecar.watchdog.states import RankState
from sidecar.watchdog.stormcap import OwnerStormCaps
from sidecar.watchdog.timeouts import Deadline

# The watchdog's log lines keep the one logger name they always had, wherever their code lives.
log = logging.getLogger("sidecar.watchdog.machine")


@dataclass
class Track:
    """A rank as the watchdog follows it (machine.py), with the episode it is part of."""

    rank: Rank
    state: RankState
    since: float  # watchdog clock of the last transition
    episode: Episode | None = None
    probe: Probe | None = None  # its stack, looked at since it turned suspect (cleared on progress)
    exited_wall: float | None = None  # wall clock: its process exited without a clean finish
    # (its own last progress, its phase, its timeout) when it turned stalled: its progress horizon
    # moving alone (its hooks fell silent: it may have stepped unseen) does not bring it back
    stalled_on: tuple[float, str | None, float] | None = None

    def snapshot(self, d: Deadline) -> RankSnapshot:
        """The rank as an incident records it, by its deadline now."""
        r = self.rank
        return RankSnapshot(
            rank=r.rank,
            local_rank=r.local_rank,
            pid=r.pid,
            state=self.state.value,
            step=r.step,
            phase=r.phase,
            last_progress_age_seconds=round(d.age, 3),
            timeout_seconds=round(d.timeout, 3),
            stack_file=r.stack_path,
        )


class Watch(Protocol):
    """What an episode asks of the watchdog that runs it (machine.py's `Watchdog`)."""

    settings: Settings
    node: str
    clock: Callable[[], float]
    store: IncidentStore
    remediator: Remediator
    storm_cap: OwnerStormCaps
    counters: Counters
    liveness: Liveness
    shadow: Shadow
    replaced: dict[RankKey, Track]  # exited, then replaced: reported once more (probes.reported)
    goodput: Goodput
    recoveries: Recoveries
    job_view: JobView | None
    on_left_to_launcher: Callable[[Rank, str, str], None] | None
    parts: dict[str, Incident]  # job_id -> the incident of its last episode in a job incident

    def deadline(self, rank: Rank, now: float | None = None) -> Deadline: ...

    def track(self, key: RankKey) -> Track | None: ...

    def tracks_of(self, job_id: str) -> list[Track]: ...

    def begin_kill(self, episode: Episode, now: float) -> None: ...

    def stalled_again(self, episode: Episode, outcome: str) -> None: ...

    async def await_probe(self, job_id: str) -> None: ...

    def probes_from(self, incident: Incident) -> None: ...


@dataclass
class Episode:
    """One stall of one job on this node, from detection until its ranks recover or go."""

    dog: Watch = field(repr=False, compare=False)
    job_id: str
    incident: Incident
    keys: list[RankKey]
    task: asyncio.Task | None = None
    outcome: str = "pending"
    suppressed: bool = False
    stacks_done: bool = False  # this node's stacks of the stall are dumped (the job view waits for it)
    holding: bool = False  # a rank of the job here is busy, not hung: no kill while it is judged
    # what `open` decided, for `start` (episode_course.py)
    why: str = field(default="", repr=False)
    observe_only: bool = field(default=False, repr=False)
    verified: bool = field(default=True, repr=False)
    spare: bool = field(default=False, repr=False)  # nothing would restart its ranks: not killed
    full: str | None = field(default=None, repr=False)  # the storm cap it reached

    # ------------------------------------------------------------ dump: stacks, records, links

    async def dump(self, targets: list[Target], signal_ranks: bool = True) -> Finding | None:
        """The ranks' stacks (after a probe of the same ranks still running), the blame they refine,
        and the collective records with the local judgement they give."""
        await self.dog.await_probe(self.job_id)
        await self.dog.remediator.collect_stacks(self.incident, targets, signal_ranks=signal_ranks)
        refine_blame(self.incident)
        return await self.collectives()

    async def collectives(self) -> Finding | None:
        """The episode's ranks' collective records into its incident, with the local judgement
        they give, and the Flight Recorder dumps the ranks sent since they stopped progressing."""
        dog, incident, now = self.dog, self.incident, self.dog.clock()
        ranks = [t.rank for key in self.keys if (t := dog.track(key)) is not None]
        stale_after = collectives_stale_after(dog.settings.hooks_flush_interval_seconds)
        finding = judge_collectives(incident, ranks, dog.node, now, stale_after)
        dumps = {
            r.rank: r.fr_dump for r in ranks
            if r.fr_dump is not None and r.fr_dump_at is not None and r.fr_dump_at >= r.last_progress
        }  # fmt: skip
        if dumps:  # up to a few MiB of pickles: written off the event loop
            await asyncio.get_running_loop().run_in_executor(None, dog.store.save_fr_dumps, incident, dumps)
        return finding

    async def attach_links(self) -> None:
        """A stuck collective is the network's or the backend's: the incident keeps what this node's
        NICs and InfiniBand ports say (read off the event loop)."""
        incident, collectors = self.incident, self.dog.settings.collectors
        if incident.hang_kind != "collective_stuck":
            return
        try:
            collector = NicCollector(collectors.sysfs_root, collectors.nic_exclude, collectors.max_nics)
            incident.links = await asyncio.get_running_loop().run_in_executor(None, link_facts, collector)
        except Exception as e:  # a missing sysfs: the record says so, the remediation goes on
            incident.notes.append(f"this node's links could not be read: {type(e).__name__}: {e}")

    # ------------------------------------------------------------ hold: busy, not hung

    def _mine(self) -> list[Track]:
        """The episode's ranks still tracked as its own."""
        return [t for key in self.keys if (t := self.dog.track(key)) is not None and t.episode is self]

    def _hold_begins(self, busy_ranks: list[int | None], note: str | None = None) -> None:
        """The one place a stall is held before any signal: a rank it waits for is busy, not hung (a rank
        here: `hold`; the culprit on another node: `leave_to_launcher`). Marked once, on the record first."""
        self.holding = True
        self.incident.event("held_busy", busy_ranks=busy_ranks)
        if note is not None:
            self.incident.notes.append(note)
        self.dog.store.save(self.incident)

    async def hold(self) -> bool:
        """Before a kill: while a rank of the job here shows life the watchdog has not finished
        judging (`Liveness.alive`: busy at its last check, being checked, or its CPU time growing),
        the stalled ranks may only be waiting for it (a barrier while rank 0 works alone). Hold until
        it is judged hung (at the latest watchdog.ceiling_seconds after its progress) or the job
        progresses again. True: the stall ended by itself, nothing is killed."""
        dog, incident, interval = self.dog, self.incident, self.dog.settings.watchdog.check_interval_seconds
        held_at: float | None = None
        while True:
            now = dog.clock()
            mine = self._mine()
            if not any(t.state in (RankState.STALLED, RankState.REMEDIATING) for t in mine):
                if held_at is not None:
                    incident.event("resumed_by_itself", held_seconds=round(now - held_at, 3))
                    incident.notes.append(
                        f"not killed: the job progressed again {now - held_at:.1f}s into the hold for its busy rank(s)"
                    )
                    log.warning("job %s: progressing again after %.1fs; not killed", self.job_id, now - held_at)
                return True
            alive = [t for t in mine if t.state is RankState.SUSPECT and dog.liveness.alive(t.rank.key, now)]
            dog.liveness.annotate(incident, [t.rank for t in alive], note=False)  # checks that found them busy
            if not alive:
                self.holding = False
                if held_at is not None:
                    incident.event("hold_ended", held_seconds=round(now - held_at, 3))
                return False
            if held_at is None:
                held_at = now
                busy = ", ".join(str(t.rank.rank) for t in alive)
                waiting = ", ".join(str(t.rank.rank) for t in mine if t.state is RankState.STALLED)
                found = all(dog.liveness.found_busy(t.rank.key) for t in alive)  # or its stack is still looked at
                how = "busy, not hung (CPU time growing, stack moving)" if found else "being judged (CPU time growing)"
                self._hold_begins(
                    [t.rank.rank for t in alive],
                    f"held: rank(s) {busy} {how} while rank(s) {waiting} waited; "
                    f"judged again every check, stalled anyway at watchdog.ceiling_seconds",
                )
                log.warning("job %s: rank(s) %s stalled, rank(s) %s %s: no kill while they are judged (stalled anyway "
                            "at watchdog.ceiling_seconds, %gs)", self.job_id, waiting, busy, how,
                            dog.settings.watchdog.ceiling_seconds)  # fmt: skip
            await asyncio.sleep(interval)

    # ------------------------------------------------------------ kill, or leave to the launcher

    async def kill(self, targets: list[Target]) -> str:
        """SIGTERM, the grace, SIGKILL of the episode's ranks still being remediated."""
        dog, incident = self.dog, self.incident
        dog.begin_kill(self, dog.clock())
        dog.store.save(incident)  # the stacks are on disk before any signal
        term = await dog.remediator.sigterm(incident, targets)
        dog.store.save(incident)
        return "failed" if term is None else await dog.remediator.kill_survivors_after_grace(incident, term)

    async def leave_to_launcher(self, targets: list[Target]) -> str:
        """The culprit is on another node: its node kills its group, torchrun's agents then stop
        the others for the re-rendezvous. Wait for that; kill here only past the grace, which does
        not count down while the culprit is busy (its node holds the stall: `_hold_begins`)."""
        dog, incident, grace = self.dog, self.incident, self.dog.settings.job_view.launcher_grace_seconds
        incident.event("left_to_launcher", grace_seconds=grace)
        for key in self.keys:
            t = dog.track(key)
            if t is not None and dog.on_left_to_launcher is not None:
                dog.on_left_to_launcher(t.rank, incident.job_incident or incident.id, incident.blamed)
        dog.store.save(incident)
        deadline = dog.clock() + grace
        interval = dog.settings.watchdog.check_interval_seconds
        while True:
            waiting = [t for t in self._mine() if t.state in (RankState.SUSPECT, RankState.STALLED)]
            if not waiting:
                mine = self._mine()  # a restart replaces them (GONE, new tracks): these stepped again themselves
                if mine and all(t.state is RankState.HEALTHY for t in mine):
                    incident.event("resumed_by_itself")
                    incident.notes.append(
                        "not killed: the job progressed again once its busy rank was done"
                        if self.holding
                        else "not killed: the ranks here stepped again before anyone killed them"
                    )
                    return "resumed"
                incident.event("restarted_by_launcher")
                return "left_to_launcher"
            verdict = dog.job_view.verdict(self.job_id) if dog.job_view is not None else None
            if names_here_now(dog, self.job_id, verdict, targets):
                adopt(incident, verdict, dog.node)
                incident.notes.append(
                    "the job's verdict came to name a rank here while its ranks were left to the launcher: killed here"
                )
                return await self.kill(targets)
            # bounded by the ceiling since this node's own ranks progressed: the word of another node
            # (whoever holds the job's key) may delay its own job's recovery, never forever
            below_ceiling = max(dog.deadline(t.rank).age for t in waiting) < dog.settings.watchdog.ceiling_seconds
            # the rank they wait on works (busy), or the job is paused (the tail of a pause): no one acts
            c = verdict.culprit if verdict is not None else None
            if c is not None and (c.busy or pause.verdict_paused(verdict)) and below_ceiling:
                if not self.holding:  # its node holds it (and so does this one): a pause, not a hang
                    self._hold_begins([c.rank])
                deadline = dog.clock() + grace  # the grace counts from when it is no longer busy
            elif dog.clock() >= deadline:
                break
            await asyncio.sleep(interval)
        left = {t.rank.rank for t in waiting}
        incident.notes.append(
            f"ranks {', '.join(map(str, sorted(left)))} still stalled {grace:g}s after the culprit's node was left to "
            "act (job_view.launcher_grace_seconds): killed here"
        )
        return await self.kill([t for t in targets if t.rank in left])

    # ------------------------------------------------------------ end

    def end(self, outcome: str) -> None:
        """A remediation's end: finished, the next attempt followed once the ranks are gone, and the
        ranks it did not kill back to STALLED."""
        dog = self.dog
        self.finish(outcome)
        if outcome in ("killed", "left_to_launcher"):  # the ranks are gone: follow the next attempt
            ranks = [t.rank for key in self.keys if (t := dog.track(key)) is not None]
            steps = [s.step for s in self.incident.ranks if s.step is not None]
            times = sorted(x for r in ranks for x in r.step_times)
            step_time = times[len(times) // 2] if times else None
            dog.recoveries.start(self.incident, ranks, max(steps) if steps else None, step_time)
        if outcome != "killed":
            dog.stalled_again(self, outcome)

    def finish(self, outcome: str) -> None:
        """The outcome, on the record and counted, with the verdict that judged the stall."""
        dog, incident = self.dog, self.incident
        self.outcome = outcome
        incident.outcome = outcome
        latest = dog.job_view.verdict(self.job_id) if dog.job_view is not None else None
        c, known = (latest.culprit if latest is not None else None), incident.culprit or {}
        if (
            c is not None
            and latest is not None
            and latest.job_incident == incident.job_incident
            and ((c.rank, c.node) == (known.get("rank"), known.get("node")) and c.kind != incident.hang_kind)
        ):  # the same culprit, its kind made specific since this node adopted it
            incident.hang_kind, incident.blame_reason, known["kind"] = c.kind, c.reason, c.kind
        dog.store.save(incident)
        if incident.drill is not None:
            dog.counters.drills[(self.job_id, outcome)] += 1
        else:
            dog.counters.remediations[(self.job_id, outcome)] += 1
            kind = hang_kinds.metric_label(incident.hang_kind or hang_kinds.OLDEST_PROGRESS.name)
            dog.counters.verdicts[(self.job_id, kind, incident.evidence or "progress")] += 1
        if incident.job_incident is not None:
            dog.parts[self.job_id] = incident
        if dog.job_view is not None:
            dog.job_view.wake(self.job_id)
