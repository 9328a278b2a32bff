"""Where recovery time goes: after a stall's ranks are gone (killed here, or stopped by torchrun
for the re-rendezvous), the watchdog follows the job's next attempt on this node and writes a
`recovery` section into the incident: seconds per stage, from the hang to training again, and
the steps trained again after the resume.

    hang (the blamed rank's last progress) -> detected -> stacks dumped -> kill sent -> ranks gone
      -> restarted rank processes started -> process group formed -> checkpoint loaded -> first step
      -> back at the step of the hang (the steps redone)

The first five come from the incident's own timeline; the rest from the new attempt's ranks: when
their processes started (the kernel's start time of the registered process), and the hooks' events
`rendezvous_done` and `checkpoint_loaded`
with its `step`, which the bundled trainer sends; a user's script may send them too). A stage
the sidecar cannot see is `null`: unknown, never guessed. Each stage, once known, is observed in
`sidecar_recovery_stage_seconds{stage}`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sidecar.incidents.store import Incident
from sidecar.metric import MetricSpec, spec
from sidecar.ranks.model import Rank

# (stage, the milestone it starts at, the milestone it ends at)
STAGES: tuple[tuple[str, str, str], ...] = (
    ("detect", "hang", "detected"),
    ("dump", "detected", "stacks_dumped"),
    ("decide", "stacks_dumped", "kill_sent"),
    ("kill", "kill_sent", "ranks_gone"),
    ("restart", "ranks_gone", "started"),
    ("rendezvous", "started", "group_formed"),
    ("load", "group_formed", "checkpoint_loaded"),
    ("first_step", "checkpoint_loaded", "first_step"),
    ("redo", "first_step", "caught_up"),
)
STAGE_NAMES = tuple(s for s, _, _ in STAGES)
BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
GIVE_UP_SECONDS = 3600.0  # a next attempt not back at the hang's step within this long: stop following

METRICS: tuple[MetricSpec, ...] = (
    spec(
        "recovery",
        "recovery_stage_seconds",
        "histogram",
        "Seconds each stage of a recovery took, from the hang to training again: detect (hang -> detected), "
        "dump (-> stacks dumped), decide (-> kill sent: the job view's verdict and the other nodes' dumps), "
        "kill (-> ranks gone), restart (-> the new rank processes started), rendezvous (-> process group formed: "
        "imports and the rendezvous), "
        "load (-> checkpoint loaded), first_step (-> first step), redo (-> back at the step of the hang). "
        "Observed once per stall incident on this node, for the stages it could see.",
        ["stage"],
    ),
)


@dataclass
class _Following:
    """One incident's recovery, followed until the job is back at the step of the hang."""

    incident: Incident
    job_id: str
    gone_at: float  # wall clock: the ranks of the stall are gone
    hang_step: int | None  # the highest step the job had reached on this node
    step_time: float | None  # its median step time before the hang
    milestones: dict[str, float | None] = field(default_factory=dict)
    loaded_step: int | None = None
    first_step: int | None = None
    observed: set[str] = field(default_factory=set)


def bucket_counts(bounds: tuple[float, ...], counts: list[int] | None, value: float) -> list[int]:
    """A histogram's cumulative counts per upper bound (the last one +Inf) with `value` observed
    (a new histogram's without `counts`): what this module's and shadow.py's histograms keep."""
    counts = [0] * (len(bounds) + 1) if counts is None else counts
    for i, le in enumerate(bounds):
        if value <= le:
            counts[i] += 1
    counts[-1] += 1
    return counts


def bucket_samples(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, int]]:
    """The histogram's buckets as a metric family takes them: (upper bound, cumulative count)."""
    return [(str(le), c) for le, c in zip(bounds, counts, strict=False)] + [("+Inf", counts[-1])]


class Recoveries:
    """Follows the recoveries of this node's stall incidents. `save(incident)` writes an incident
    again (the watchdog's store); `observe(stage, seconds)` feeds the histogram."""

    def __init__(
        self, save: Callable[[Incident], None], wall: Callable[[], float] = time.time, boot_time: float | None = None
    ):
        self.save, self.wall = save, wall
        # Wall clock of the boot, to the clock tick (psutil's boot_time() is whole seconds):
        # a process's start time is counted from it.
        self.boot_time = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) if boot_time is None else boot_time
        self._following: list[_Following] = []
        self.histograms: dict[str, tuple[list[int], float, int]] = {}

    def start(self, incident: Incident, ranks: list[Rank], hang_step: int | None, step_time: float | None) -> None:
        """The stall's ranks are gone: follow the job's next attempt."""
        gone = incident.event_time("exit_observed") or incident.event_time("restarted_by_launcher") or self.wall()
        blamed = next((r for r in incident.ranks if r.rank == incident.blamed_rank), None)
        hang = None
        if blamed is not None and blamed.last_progress_age_seconds is not None:
            hang = incident.time - blamed.last_progress_age_seconds
        elif incident.ranks:
            ages = [r.last_progress_age_seconds for r in incident.ranks if r.last_progress_age_seconds is not None]
            hang = incident.time - max(ages) if ages else None
        f = _Following(incident, incident.job_id, gone, hang_step, step_time)
        f.milestones = {
            "hang": hang,
            "detected": incident.time,
            "stacks_dumped": incident.event_time("dumps_received") or incident.event_time("py_spy_done"),
            "kill_sent": incident.event_time("sigterm"),
            "ranks_gone": gone,
        }
        self._following.append(f)
        del self._following[:-16]
        self._write(f)

    def tick(self, ranks_by_job: dict[str, list[Rank]]) -> None:
        """Read the new attempts' milestones (called from the watchdog's tick)."""
        now = self.wall()
        for f in list(self._following):
            new = [r for r in ranks_by_job.get(f.job_id, []) if r.registered_wall >= f.gone_at - 0.5]
            changed = False
            if new:
                formed = _event_time(new, "rendezvous_done")
                started = min(self._started(r) for r in new)
                changed |= self._set(f, "started", started)
                gone, sent = f.milestones.get("ranks_gone"), f.milestones.get("kill_sent")
                if gone is not None and started < gone and (sent is None or started >= sent):
                    # Seen gone only at the next look (every 0.05 s), after the launcher had already
                    # started their successors: they were gone by then.
                    f.milestones["ranks_gone"] = started
                changed |= self._set(f, "group_formed", formed)
                loaded = _event(new, "checkpoint_loaded")
                if loaded is not None:
                    changed |= self._set(f, "checkpoint_loaded", loaded[0])
                    step = loaded[1].get("step")
                    f.loaded_step = step if type(step) is int else f.loaded_step
                stepped = [r for r in new if r.step is not None]
                if stepped:
                    first = min(r.first_step_wall or r.step_wall or now for r in stepped)
                    changed |= self._set(f, "first_step", first)
                    if f.hang_step is None or min(r.step or 0 for r in stepped) >= f.hang_step:
                        caught = max(r.step_wall or now for r in stepped) if f.hang_step is not None else first
                        changed |= self._set(f, "caught_up", caught)
            done = "caught_up" in f.milestones or now - f.gone_at > GIVE_UP_SECONDS
            if changed or done:
                self._write(f, final=done)
            if done:
                self._following.remove(f)

    def _started(self, r: Rank) -> float:
        """Wall clock of the rank process's start (the kernel's), else of its registration."""
        if r.pid_start_time is None:
            return r.registered_wall
        return self.boot_time + r.pid_start_time

    def _set(self, f: _Following, milestone: str, at: float | None) -> bool:
        if at is None or f.milestones.get(milestone) is not None:
            return False
        f.milestones[milestone] = at
        return True

    def _write(self, f: _Following, final: bool = False) -> None:
        m = f.milestones
        stages: dict[str, float | None] = {}
        for stage, start, end in STAGES:
            a, b = m.get(start), m.get(end)
            stages[stage] = round(b - a, 3) if a is not None and b is not None and b >= a else None
            if stages[stage] is not None and stage not in f.observed:
                f.observed.add(stage)
                self.observe(stage, stages[stage] or 0.0)
        hang, first = m.get("hang"), m.get("first_step")
        redone = None
        if f.hang_step is not None and f.loaded_step is not None:
            redone = max(0, f.hang_step - f.loaded_step)
        f.incident.recovery = {
            "milestones": {k: (round(v, 3) if v is not None else None) for k, v in m.items()},
            "stages_seconds": stages,
            "hang_to_training_seconds": round(first - hang, 3) if hang is not None and first is not None else None,
            "steps_redone": redone,
            "steps_redone_seconds": stages.get("redo"),
            "checkpoint_step": f.loaded_step,
            "complete": final and "caught_up" in m,
        }
        self.save(f.incident)

    # ------------------------------------------------------------ the histogram

    def observe(self, stage: str, seconds: float) -> None:
        counts, total, n = self.histograms.get(stage, (None, 0.0, 0))
        self.histograms[stage] = (bucket_counts(BUCKETS, counts, seconds), total + seconds, n + 1)

    def families(self) -> Iterable[Any]:
        family = METRICS[0].family()
        for stage in STAGE_NAMES:
            if stage not in self.histograms:
                continue
            counts, total, _ = self.histograms[stage]
            family.add_metric([stage], bucket_samples(BUCKETS, counts), total)
        return [family]


def _event(ranks: list[Rank], name: str) -> tuple[float, dict[str, Any]] | None:
    """The earliest event `name` among the ranks: (its time, its fields)."""
    found = []
    for r in ranks:
        for when, event_name, _ in r.events:
            if event_name == name:
                fields = r.last_event(name) or {}
                found.append((when, fields))
                break
    return min(found, key=lambda e: e[0]) if found else None


def _event_time(ranks: list[Rank], name: str) -> float | None:
    found = _event(ranks, name)
    return found[0] if found else None
