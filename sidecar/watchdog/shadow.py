"""Shadow mode and false alarms: the kills the watchdog would have made, and the stalls that ended
by themselves (docs/architecture/watchdog.md, "Shadow mode and false alarms").

- Observe-only: the node's (`watchdog.observe_only`), or a job's own, asked at registration
  (`observe_only: true`; honoured while `watchdog.allow_job_observe_only`). A stall of such a job is
  detected, dumped (py-spy only: no signal) and recorded, never killed. One that would have been
  killed (its ranks registered by a verified caller, and something would restart them, or
  `remediation.kill_without_restart`) is a would-be kill: `sidecar_watchdog_would_kill_total`.
  Each node counts the stall of its own ranks: for a job across nodes, take the max by job_id.
- A false alarm: a rank declared STALLED whose own progress came back while it was not killed,
  in any mode (observe-only, storm cap, nothing to restart it, a failed kill).
  `sidecar_watchdog_false_alarms_total{job_id,phase}` counts them (`phase`: the rank's phase at the
  stall, `steps` between steps, `startup` before its first step) and
  `sidecar_watchdog_false_alarm_duration_seconds` observes how long the rank was without progress in
  all. A rank that progresses while its kill is under way is killed all the same (the decision is
  taken) and is not counted.
- Learning: a false alarm of D seconds in phase P raises the job's budget for P (its step timeout
  for `steps`) to at least 1.5 x D, never above `watchdog.ceiling_seconds`, for as long as the job is
  known (timeouts.py): the same pause again is not a stall. The log and the stall's incident say so.

`/v1/status` (`watchdog.shadow`) and `sidecar status` show per job: its would-be kills, its false
alarms, the longest self-resolved pause per phase, and the floor that would have killed none of
them (the longest such pause plus one watchdog tick).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sidecar.config import Settings
from sidecar.metric import MetricSpec, spec
from sidecar.ranks.model import Rank, RankKey
from sidecar.watchdog.recovery import bucket_counts, bucket_samples
from sidecar.watchdog.restarts import no_restart_reasons
from sidecar.watchdog.timeouts import LEARN_FACTOR, Timeouts

log = logging.getLogger(__name__)

BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
MAX_JOBS = 256  # jobs whose figures are kept (the one untouched longest is dropped beyond)

METRICS: tuple[MetricSpec, ...] = (
    spec(
        "watchdog",
        "watchdog_would_kill",
        "counter",
        "Stalls an observe-only watchdog (watchdog.observe_only, or the job's own observe_only at registration) "
        "left alive that it would have killed: ranks of verified callers that something would restart. Each node "
        "counts its own ranks' stall: across nodes, max by job_id.",
        ["job_id"],
    ),
    spec(
        "watchdog",
        "watchdog_false_alarms",
        "counter",
        "Stalls that ended by themselves: a rank declared stalled whose own progress came back while it was not "
        "killed (any mode). phase: the rank's phase at the stall, `steps` between steps, `startup` before its "
        "first step.",
        ["job_id", "phase"],
    ),
    spec(
        "watchdog",
        "watchdog_false_alarm_duration_seconds",
        "histogram",
        "How long the rank of a false alarm was without progress in all, from its own last progress to its "
        "progress again; the job's budget for that phase is raised to at least 1.5 x it (at most "
        "watchdog.ceiling_seconds).",
        ["job_id", "phase"],
    ),
)


def phase_of(rank: Rank) -> str:
    """What a rank is doing, as the timeout policy sees it: its declared phase, else `steps`, or
    `startup` before its first step."""
    if rank.phase is not None:
        return rank.phase
    return "steps" if rank.step is not None else "startup"


def progress_of(rank: Rank) -> float:
    """The rank's own latest sign of progress (watchdog clock): its last step or phase end, or the
    start of the phase it declared since."""
    return max(rank.last_progress, rank.phase_started or rank.last_progress)


@dataclass
class _Stall:
    rank: Rank
    phase: str
    start: float  # its own last progress before the stall (watchdog clock)


@dataclass
class _Figures:
    """One job's shadow figures on this node."""

    would_kill: int = 0
    false_alarms: Counter = field(default_factory=Counter)  # phase -> count
    longest: dict[str, float] = field(default_factory=dict)  # phase -> the longest self-resolved pause
    histograms: dict[str, tuple[list[int], float]] = field(default_factory=dict)  # phase -> (buckets, sum)
    observe_only: bool = False  # the job asked for observe-only at registration (and it was honoured)
    owner_uid: int | None = None  # the uid owning the job_id when a rank of it was last seen here


class Shadow:
    def __init__(self, settings: Settings, timeouts: Timeouts):
        self.settings, self.timeouts = settings, timeouts
        self._stalls: dict[RankKey, _Stall] = {}
        self._jobs: dict[str, _Figures] = {}

    def _figures(self, job_id: str) -> _Figures:
        figures = self._jobs.pop(job_id, None) or _Figures()
        self._jobs[job_id] = figures  # most recently touched last
        while len(self._jobs) > MAX_JOBS:
            del self._jobs[next(iter(self._jobs))]
        return figures

    # ------------------------------------------------------------ observe-only

    def observing(self, ranks: Iterable[Rank]) -> bool:
        """Whether a stall of these ranks (one job's) is only observed: the node's setting, or a
        rank of the job asked for it at registration (the registry honours it only while
        watchdog.allow_job_observe_only)."""
        return self.settings.watchdog.observe_only or any(r.observe_only for r in ranks)

    def observed(self, job_id: str, ranks: list[Rank], verified: bool) -> bool:
        """An observe-only stall: counts a would-be kill when the watchdog would have killed it
        (verified callers' ranks that something would restart, or kill_without_restart). The
        storm cap is not consulted (it spends a slot). True when counted."""
        figures = self._figures(job_id)
        figures.observe_only = any(r.observe_only for r in ranks)
        if ranks:
            figures.owner_uid = ranks[0].owner_uid
        restarted = self.settings.remediation.kill_without_restart or not no_restart_reasons(ranks)
        if verified and restarted:
            figures.would_kill += 1
            return True
        return False

    # ------------------------------------------------------------ false alarms

    def stalled(self, rank: Rank) -> None:
        """The rank was declared stalled (again, after a failed kill: its first stall stands)."""
        held = self._stalls.get(rank.key)
        if held is None or held.rank is not rank:
            self._stalls[rank.key] = _Stall(rank, phase_of(rank), progress_of(rank))
        figures = self._jobs.get(rank.job_id)
        if figures is not None:  # the job's budgets shown are its owner's now (a job_id may pass to another uid)
            figures.owner_uid = rank.owner_uid

    def forget(self, key: RankKey) -> None:
        """The rank is gone (killed, exited, replaced): its stall did not end by itself."""
        self._stalls.pop(key, None)

    def resumed(self, rank: Rank, killing: bool) -> str | None:
        """The rank left STALLED for a watched state. If its own progress came back and no kill of
        it is under way, a false alarm: counted, and the job's budget for that phase learned.
        Returns the incident's note, or None when it was no false alarm."""
        stall = self._stalls.get(rank.key)
        if stall is None or stall.rank is not rank:
            return None
        end = progress_of(rank)
        if end <= stall.start:  # its deadline grew (a budget learned meanwhile): no progress, still the stall
            return None
        del self._stalls[rank.key]
        if killing:
            return None
        seconds = end - stall.start
        figures = self._figures(rank.job_id)
        figures.owner_uid = rank.owner_uid
        figures.false_alarms[stall.phase] += 1
        figures.longest[stall.phase] = max(figures.longest.get(stall.phase, 0.0), seconds)
        counts, total = figures.histograms.get(stall.phase, (None, 0.0))
        figures.histograms[stall.phase] = (bucket_counts(BUCKETS, counts, seconds), total + seconds)
        before = self.timeouts.learned(rank.job_id, rank.owner_uid).get(stall.phase)
        budget = self.timeouts.learn(rank.job_id, stall.phase, seconds, rank.owner_uid)
        what = "step timeout" if stall.phase == "steps" else f"budget for {stall.phase}"
        if before is not None and budget <= before:
            learned = f"the job's {what} stays at least {budget:.1f}s"
        else:
            bound = f"{LEARN_FACTOR:g} x the pause"
            if budget < LEARN_FACTOR * seconds:
                bound += f", cut to watchdog.ceiling_seconds {self.settings.watchdog.ceiling_seconds:g}s"
            learned = f"the job's {what} is now at least {budget:.1f}s ({bound})"
        note = (
            f"false alarm: rank {rank.rank} progressed again by itself after {seconds:.1f}s without progress "
            f"({stall.phase}); {learned}"
        )
        log.warning("job %s: %s", rank.job_id, note)
        return note

    # ------------------------------------------------------------ reading

    def families(self) -> list[Any]:
        would, alarms, durations = (m.family() for m in METRICS)
        for job_id, f in sorted(self._jobs.items()):
            if f.would_kill:
                would.add_metric([job_id], f.would_kill)
            for phase, n in sorted(f.false_alarms.items()):
                alarms.add_metric([job_id, phase], n)
            for phase, (counts, total) in sorted(f.histograms.items()):
                durations.add_metric([job_id, phase], bucket_samples(BUCKETS, counts), total)
        return [would, alarms, durations]

    def status(self) -> dict[str, dict]:
        """Per job: its would-be kills, false alarms and longest self-resolved pause per phase, the
        floor that would have killed none of them (that pause plus a tick), and the budgets its
        pauses taught it."""
        tick = self.settings.watchdog.check_interval_seconds
        out = {}
        for job_id, f in sorted(self._jobs.items()):
            longest = max(f.longest.values(), default=None)
            out[job_id] = {
                "observe_only": f.observe_only or self.settings.watchdog.observe_only,
                "would_kill": f.would_kill,
                "false_alarms": sum(f.false_alarms.values()),
                "phases": {
                    phase: {
                        "false_alarms": n,
                        "longest_pause_seconds": round(f.longest[phase], 3),
                        "budget_killing_none_seconds": round(f.longest[phase] + tick, 3),
                    }
                    for phase, n in sorted(f.false_alarms.items())
                },
                "floor_killing_none_seconds": None if longest is None else round(longest + tick, 3),
                "learned_budgets_seconds": {
                    k: round(v, 3) for k, v in sorted(self.timeouts.learned(job_id, f.owner_uid).items())
                },
            }
        return out
