"""The watchdog's timeout policy: how long a rank may go without progress now.

start-up (no step yet)      watchdog.startup_timeout_seconds
a declared phase            the rank's own budget, else watchdog.phase_timeouts[name],
                            else watchdog.default_phase_timeout_seconds
training steps              multiplier x quantile(recent step times), in [floor, ceiling]

Each is measured from the rank's own last progress (the time its hooks stamped on its latest step
or phase end), not from when the sidecar received it, and never from earlier than the rank's
progress could have been: the hooks send the first step after a pause at once
(wire.STEP_GAP_SEND_SECONDS) and every push carries every step recorded before it, so while a rank
pushes, its latest step is known; a rank that has not pushed for `push_gap` (its hooks push at
least every max(flush interval, KEEPALIVE_SECONDS)) may have stepped after its last push and
frozen with those steps unsent, so its progress is taken to have lasted until its last push plus
`push_gap` (a frozen rank is declared at most `push_gap` after the floor, never before), unless
the job's other ranks are shown waiting for it in a collective it never entered (`left_behind`):
then at the floor from its own last step, as its peers are.

A job's own pauses teach it (sidecar/watchdog/shadow.py): a stall that ended by itself after D
seconds in a phase (or in steps, or before the first step) raises that job's budget there to at
least LEARN_FACTOR x D, never above `ceiling_seconds`, for as long as the job is known (`keep_jobs`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from sidecar.config import WatchdogSettings
from sidecar.ranks.model import Rank, RankKey

LEARN_FACTOR = 1.5  # a job's budget after a pause of D seconds that ended by itself: at least this x D


@dataclass
class Deadline:
    """How long a rank may go without progress now, and how long it has."""

    timeout: float
    age: float
    basis: str  # "startup" | "phase:<name>" | "steps"


def quantile(values: Iterable[float], q: float) -> float | None:
    """The nearest-rank quantile (no interpolation: a timeout follows an observed value)."""
    ordered = sorted(v for v in values if math.isfinite(v) and v >= 0)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class Timeouts:
    """Deadlines by the settings of `watchdog.*`; the step timeout of each rank is kept until
    its next step (the quantile sorts up to `window` step times: once per step, not per tick)."""

    def __init__(self, settings: WatchdogSettings, push_gap: float = 2.5):
        self.settings, self.push_gap = settings, push_gap
        self._cache: dict[RankKey, tuple] = {}  # (rank, (step, step time), step timeout)
        # job_id -> (its owner's uid, {phase name, "steps" or "startup": the least budget its own
        # pauses taught it}); a job_id that passes to another uid learns anew
        self._learned: dict[str, tuple[int | None, dict[str, float]]] = {}

    def forget(self, key: RankKey) -> None:
        self._cache.pop(key, None)

    def learn(self, job_id: str, phase: str, seconds: float, owner_uid: int | None = None) -> float:
        """A pause of the job's of `seconds` in `phase` ("steps", "startup" or a declared phase)
        ended by itself: from now on the job's budget there is at least LEARN_FACTOR x it, never
        above the ceiling. Returns the least budget the job now has there."""
        known = self._learned.get(job_id)
        table = known[1] if known is not None and known[0] == owner_uid else {}
        self._learned[job_id] = (owner_uid, table)
        table[phase] = max(table.get(phase, 0.0), min(self.settings.ceiling_seconds, LEARN_FACTOR * seconds))
        return table[phase]

    def learned(self, job_id: str, owner_uid: int | None = None) -> dict[str, float]:
        """The least budgets the job's pauses taught it while `owner_uid` owned it (none when the
        job_id was another uid's: what another owner learned never applies, as in `deadline`)."""
        known = self._learned.get(job_id)
        return dict(known[1]) if known is not None and known[0] == owner_uid else {}

    def keep_jobs(self, jobs: Collection[str]) -> None:
        """Forget what the jobs no longer known (no rank in the registry) had learned."""
        for job_id in [j for j in self._learned if j not in jobs]:
            del self._learned[job_id]

    def progress_horizon(self, rank: Rank, now: float, left_behind: bool = False) -> float:
        """The latest the rank's own progress may have been (monotonic): its last known progress,
        or, when its hooks have not pushed for `push_gap`, its last push plus `push_gap`.

        `left_behind`: the backend's own record shows the job's other ranks waiting in a collective
        this rank never entered (the job view's verdict, kind rank_late). Steps it could have made
        unseen after its last push would have taken it into that collective, so its last known
        progress is its progress: no gap is added (the floor still runs from its own last step)."""
        horizon = rank.last_progress
        if not left_behind and rank.contact_at is not None and now - rank.contact_at > self.push_gap:
            horizon = max(horizon, rank.contact_at + self.push_gap)
        return horizon

    def deadline(self, rank: Rank, now: float, left_behind: bool = False, no_phase: bool = False) -> Deadline:
        """`no_phase`: the rank's phase cannot end (its DataLoader's worker is stopped): its steps judge it."""
        wd = self.settings
        progress = self.progress_horizon(rank, now, left_behind)
        known = self._learned.get(rank.job_id) if self._learned else None
        learned = known[1] if known is not None and known[0] == rank.owner_uid else None
        if rank.phase is not None and not no_phase:
            budget = rank.phase_timeout or wd.phase_timeouts.get(rank.phase) or wd.default_phase_timeout_seconds
            if learned:
                budget = max(budget, learned.get(rank.phase, 0.0))
            started = rank.phase_started if rank.phase_started is not None else progress
            return Deadline(float(budget), now - max(started, progress), f"phase:{rank.phase}")
        if rank.step is None:
            budget = (
                max(wd.startup_timeout_seconds, learned.get("startup", 0.0)) if learned else wd.startup_timeout_seconds
            )
            return Deadline(budget, now - progress, "startup")
        basis = (rank.step, rank.metrics.get("step_time_seconds"))
        cached = self._cache.get(rank.key)
        if cached is not None and cached[0] is rank and cached[1] == basis:
            timeout = cached[2]
        else:
            timeout = self.step_timeout(rank.step_times, basis[1])
            self._cache[rank.key] = (rank, basis, timeout)
        if learned:
            timeout = max(timeout, learned.get("steps", 0.0))
        return Deadline(timeout, now - progress, "steps")

    def step_timeout(self, step_times: Iterable[float], last_step_time: float | None = None) -> float:
        """multiplier x quantile of the recent step times, clamped to [floor, ceiling]. Before
        there is an interval between two steps, the step time the rank reported with its first
        step stands in (a slow first step must not make the second one a stall); without
        either, the floor."""
        wd = self.settings
        recent = list(step_times)[-wd.window :]
        q = quantile(recent, wd.quantile)
        if q is None and last_step_time is not None:
            q = quantile([last_step_time], 1.0)
        if q is None:
            return wd.floor_seconds
        return min(wd.ceiling_seconds, max(wd.floor_seconds, wd.multiplier * q))
