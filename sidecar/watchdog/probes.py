"""What the watchdog looks at before a stall is one, and what it tells the job's coordinator.

`Probes`: one stack probe per job at a time of its suspect and stalled ranks (the hooks' dump, py-spy's
non-blocking read in observe-only mode): whether each waits in a collective, its innermost frame, its
main thread's frames (`Probe`, coordination.py), which the liveness check and the job view read.
`node_report`: this node's picture of a job for its coordinator (sidecar/jobview/), with its part of a
job incident once the stall's episode (episode.py) recorded one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from sidecar.incidents.store import Incident
from sidecar.jobview import stragglers
from sidecar.jobview.report import NodeReport, RankView
from sidecar.watchdog.coordination import Probe, part_of, rank_view, recovery_news
from sidecar.watchdog.episode import Episode, Track, Watch
from sidecar.watchdog.remediation import target_of
from sidecar.watchdog.stackdumps import main_frames, stack_top
from sidecar.watchdog.states import RankState

# The watchdog's log lines keep the one logger name they always had, wherever their code lives.
log = logging.getLogger("sidecar.watchdog.machine")


class Probes:
    def __init__(self, dog: Watch):
        self.dog = dog
        self.wanted: set[str] = set()  # jobs with a suspect or stalled rank not probed yet
        self.running: dict[str, asyncio.Task] = {}  # job_id -> its running stack probe

    def start(self) -> None:
        """One probe per job at a time: the stacks of its suspect and stalled ranks not probed yet
        and not being remediated (an episode dumps its own), and of those the liveness check wants
        another look at (also while their job's episode holds for them)."""
        liveness = self.dog.liveness
        for job_id in sorted(self.wanted):
            running = self.running.get(job_id)
            if running is not None and not running.done():
                continue
            self.wanted.discard(job_id)
            tracks = [
                t for t in self.dog.tracks_of(job_id)
                if (t.probe is None or liveness.wants_probe(t.rank.key))
                and t.state in (RankState.SUSPECT, RankState.STALLED)
                and (t.episode is None or liveness.wants_probe(t.rank.key))
            ]  # fmt: skip
            if tracks:
                self.running[job_id] = asyncio.get_running_loop().create_task(
                    self._probe(job_id, tracks), name=f"probe-{job_id}"
                )

    async def _probe(self, job_id: str, tracks: list[Track]) -> None:
        """Whether each suspect rank waits in a collective, and its innermost frame: the stack
        dump the hooks write on their signal (no py-spy: a probe must be cheap). Not saved as an
        incident; what it shows is exported and reported to the job's coordinator."""
        dog = self.dog
        now = dog.clock()
        scratch = Incident(
            id="probe", time=time.time(), job_id=job_id, node=dog.node, blamed_rank=None, blame_reason="",
            timeout_seconds=None, observe_only=True, ranks=[t.snapshot(dog.deadline(t.rank, now)) for t in tracks],
        )  # fmt: skip
        try:
            # Observe-only never signals: py-spy's non-blocking read instead of the hooks' dump.
            observe = dog.shadow.observing(t.rank for t in tracks)
            targets = [target_of(t.rank) for t in tracks]
            await dog.remediator.collect_stacks(
                scratch, targets, signal_ranks=not observe, use_py_spy=observe, continue_stopped=False
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("probing the stacks of job %s failed", job_id)
            return
        self.record(scratch, tracks)
        if dog.job_view is not None:
            dog.job_view.wake(job_id)

    def record(self, incident: Incident, tracks: list[Track] | None = None) -> None:
        """What a dump of the incident's ranks showed, as each rank's probe."""
        by_rank = {s.rank: s for s in incident.ranks}
        now = self.dog.clock()
        for t in tracks if tracks is not None else self.dog.tracks_of(incident.job_id):
            snap = by_rank.get(t.rank.rank)
            if snap is None or (snap.in_collective is None and t.probe is not None):
                continue
            text = "\n".join(snap.stack_head) if snap.stack_head else (snap.py_spy or "")
            t.probe = Probe(snap.in_collective, stack_top(text), now, main_frames(text))

    async def wait(self, job_id: str) -> None:
        """An episode's own dumps wait for a probe of the same ranks still running."""
        running = self.running.get(job_id)
        if running is not None and not running.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(running)


def reported(dog: Watch, job_id: str, wall: float) -> list[Track]:
    """The job's ranks as its coordinator is told of them: a rank that exited and whose restart
    registered before any report carried the exit (a loaded node: a restart resumed from a snapshot
    registered 0.3 s after the crash) is its exit in the next report, once, if its restart has not
    stepped yet and the exit is within job_view.lost_after_seconds; the coordinator keeps a node's
    first exit for the incident (jobs.kept_exit). Else its peers' later exits were the first the
    coordinator heard of, and one was named the crashed rank."""
    recent = dog.settings.job_view.lost_after_seconds
    out = []
    for t in dog.tracks_of(job_id):
        old = dog.replaced.pop(t.rank.key, None)
        fresh = t.state in (RankState.STARTING, RankState.HEALTHY) and t.rank.last_progress <= t.rank.registered_at
        exited = old is not None and old.exited_wall is not None and wall - old.exited_wall <= recent
        out.append(old if old is not None and fresh and exited else t)
    return out


def node_report(dog: Watch, job_id: str, episode: Episode | None) -> NodeReport | None:
    """This node's picture of the job for its coordinator (None: no rank of it here); `episode`: the
    job's open episode here, if any."""
    now, wall = dog.clock(), time.time()
    recent = dog.settings.job_view.lost_after_seconds
    tracks = reported(dog, job_id, wall)
    if not tracks:
        return None
    ranks: list[RankView] = []
    lateness: list[stragglers.RankEntries] = []
    for t in sorted(tracks, key=lambda t: t.rank.rank):
        r = t.rank
        exited = t.exited_wall if t.exited_wall is not None and wall - t.exited_wall <= recent else None
        if t.state is RankState.GONE and exited is None:
            continue
        age = now - r.last_progress
        busy = t.state is RankState.SUSPECT and dog.liveness.alive(r.key, now)
        view = rank_view(r.rank, r.local_rank, t.state.value, r.step, r.phase, age, t.probe, exited, busy)
        if exited is not None:
            view.exit_kind = r.exit_kind  # a peer failure is ordered after a cause
        if t.state is not RankState.GONE:  # stopped or in D from /proc alone; CPU once it is watched (suspect)
            view.activity = dog.liveness.activity(r, now, t.probe.frames if t.probe is not None else ())
        if r.collectives is not None and t.state is not RankState.GONE:
            view.collectives, view.collectives_age = r.collectives, round(r.collectives_age(now) or 0.0, 3)
            entries = stragglers.entries_of(r.rank, r.collectives)  # the reporter sends those that moved
            if entries is not None:
                lateness.append(entries)
        ranks.append(view)
    verdict = dog.job_view.verdict(job_id) if dog.job_view is not None else None
    current = verdict.job_incident if verdict is not None and not verdict.closed else None
    report = NodeReport(
        job_id=job_id, node=dog.node, world_size=max(t.rank.world_size for t in tracks), time=wall,
        ranks=ranks, job_incident=current, lateness=lateness,
    )  # fmt: skip
    if episode is not None and episode.stacks_done and current is not None:
        report.dumped = current
    if (armed := dog.store.drills.armed(job_id)) is not None:
        report.drill = armed.drill_id  # drilled here: the job's other nodes take its stall for a drill too
    recorded = episode.incident if episode is not None else dog.parts.get(job_id)
    within = 3 * dog.settings.job_view.report_interval_seconds  # its recovery's stages, after the close too
    if (
        recorded is not None
        and recorded.job_incident is not None
        and (episode is not None or recorded.job_incident == current or recovery_news(recorded, current, wall, within))
    ):
        report.job_incident = recorded.job_incident
        report.part = part_of(recorded, recorded.outcome)
        if episode is None:
            report.dumped = recorded.job_incident
    return report
