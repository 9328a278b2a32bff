"""Goodput, live: each job's wall time on this node by what it was spent on, as counters, so that
`rate()` gives the share of useful training over any window (docs/metrics.md, "Goodput").

    productive  the job's lowest local step advanced past anything it had reached before
    stalled     from the job's last progress before a stall until the watchdog detected it
    recovering  from that detection until the job's next progress (dumps, kill, restart,
                rendezvous, checkpoint load, first step)
    redone      steps trained again after a resume, up to the step the job had reached

Time is classified when the job progresses (a step of its slowest local rank), so the counters
lag the present by at most one step, or by one stall until training resumes; nothing is
guessed for time not yet understood. Every node of a job counts the job's wall time once: per job,
the ratio is the same on each node, so average it by job_id across nodes (never sum the seconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sidecar.metric import MetricSpec, spec
from sidecar.ranks.model import Rank

STATES = ("productive", "stalled", "recovering", "redone")
MAX_JOBS = 64  # jobs whose clock is kept (the one silent longest is dropped beyond)

METRICS: tuple[MetricSpec, ...] = (
    spec(
        "goodput",
        "job_seconds",
        "counter",
        "The job's wall time on this node by state: productive (its slowest local rank advanced past any step "
        "it had reached), stalled (last progress -> the stall's detection), recovering (detection -> the next "
        "progress: dumps, kill, restart, rendezvous, checkpoint load), redone (steps trained again after a "
        "resume). Goodput = rate(productive) / rate(all states); per job, average the ratio across nodes.",
        ["job_id", "state"],
    ),
)


@dataclass
class _JobClock:
    lowest: int | None = None  # the job's lowest local step at its last progress
    progress_wall: float | None = None  # when that was
    high_water: int = -1  # the highest of those steps: below it, a resumed job redoes steps
    stalled_at: float | None = None  # wall clock: a stall detected since the last progress
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STATES, 0.0))


class Goodput:
    def __init__(self, wall: Callable[[], float] = time.time):
        self.wall = wall
        self._jobs: dict[str, _JobClock] = {}

    def stalled(self, job_id: str, detected_wall: float) -> None:
        """The watchdog detected a stall of the job (the first of its episode counts)."""
        clock = self._jobs.get(job_id)
        if clock is not None and clock.stalled_at is None:
            clock.stalled_at = detected_wall

    def tick(self, jobs: dict[str, list[Rank]]) -> None:
        """Classify the time up to each job's latest progress (from the watchdog's tick)."""
        for job_id, ranks in jobs.items():
            live = [r for r in ranks if not r.gone]
            if not live or any(r.step is None for r in live):
                continue  # starting (or restarting): the next progress classifies this time
            lowest = min(r.step for r in live if r.step is not None)
            at = max((r.step_wall or 0.0) for r in live if r.step == lowest)
            clock = self._jobs.get(job_id)
            if clock is None:
                if len(self._jobs) >= MAX_JOBS:
                    del self._jobs[min(self._jobs, key=lambda j: self._jobs[j].progress_wall or 0.0)]
                self._jobs[job_id] = _JobClock(lowest, at, lowest)
                continue
            if lowest == clock.lowest or clock.progress_wall is None or at <= clock.progress_wall:
                continue
            self._account(clock, lowest, at)

    def _account(self, clock: _JobClock, lowest: int, at: float) -> None:
        assert clock.progress_wall is not None
        start = clock.progress_wall
        if clock.stalled_at is not None and start <= clock.stalled_at <= at:
            clock.seconds["stalled"] += clock.stalled_at - start
            clock.seconds["recovering"] += at - clock.stalled_at
        elif lowest <= clock.high_water:
            clock.seconds["redone"] += at - start
        else:
            clock.seconds["productive"] += at - start
        clock.stalled_at = None
        clock.lowest, clock.progress_wall = lowest, at
        clock.high_water = max(clock.high_water, lowest)

    def ratio(self, job_id: str) -> float | None:
        clock = self._jobs.get(job_id)
        total = sum(clock.seconds.values()) if clock is not None else 0.0
        return clock.seconds["productive"] / total if clock is not None and total > 0 else None

    def families(self) -> Iterable[Any]:
        family = METRICS[0].family()
        for job_id, clock in sorted(self._jobs.items()):
            for state in STATES:
                family.add_metric([job_id, state], round(clock.seconds[state], 3))
        return [family]
