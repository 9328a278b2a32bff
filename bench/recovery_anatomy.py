"""Where a recovery's time went (bench_recovery's anatomy table): the points of one hang -> training
again, from the incident's timeline and the trainer's start-up milestones, and their printing."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from harness.job import LogEvent, event_time
from sidecar_trainer.startup import MILESTONES

POINTS = ("hang", "detected", "sigterm", "ranks_gone", *MILESTONES)
STAGES = {  # stage name (a table column) -> the point it ends at
    "detect": "detected",
    "dump": "sigterm",
    "kill": "ranks_gone",
    "restart": "process_started",
    "imports": "imports_done",
    "pg": "process_group_formed",
    "build": "model_built",
    "load": "checkpoint_loaded",
    "1st step": "first_step",
}


@dataclass
class Anatomy:
    """Where one recovery's time went: the Unix time of each point (missing: not seen), the step
    the job resumed from and where it came from, and the steps trained again after it."""

    points: dict[str, float]
    resumed_step: int | None = None
    source: str | None = None
    redone_steps: int | None = None

    def stage(self, name: str) -> float | None:
        end = STAGES[name]
        start = POINTS[POINTS.index(end) - 1]
        if start in self.points and end in self.points:
            return self.points[end] - self.points[start]
        return None

    def span(self, start: str, end: str) -> float | None:
        if start in self.points and end in self.points:
            return self.points[end] - self.points[start]
        return None


def anatomy(hang: float, last_step: int | None, incident: dict | None, startup: list[LogEvent]) -> Anatomy:
    """Put together one recovery: `hang` (when it began), the last step finished before it, the
    sidecar's incident record of it and rank 0's start-up milestones logged after it."""
    points = {"hang": hang}
    if incident:
        points["detected"] = incident["time"]
        for point, event in (("sigterm", "sigterm"), ("ranks_gone", "exit_observed")):
            when = event_time(incident, event)
            if when is not None:
                points[point] = when
    out = Anatomy(points)
    # The restarted attempt starts after the SIGTERM; the sidecar sees the ranks gone at its next
    # look (every 0.05 s), sometimes after torchrun has started their successors.
    after = points.get("sigterm", hang)
    for e in startup:
        milestone, when = e.fields["milestone"], e.fields["t"]
        if milestone in POINTS and milestone not in points and when >= after:
            points[milestone] = when
            if milestone == "checkpoint_loaded":
                out.resumed_step, out.source = e.fields.get("step"), e.fields.get("source")
    if "ranks_gone" in points and points.get("process_started", points["ranks_gone"]) < points["ranks_gone"]:
        points["ranks_gone"] = points["process_started"]  # they were gone by then
    if out.resumed_step is not None and last_step is not None:
        out.redone_steps = max(0, last_step - out.resumed_step)
    return out


def incidents_in(diag_dir: Path) -> list[dict]:
    """Every incident record the sidecar wrote, oldest first."""
    records = []
    for path in sorted((diag_dir / "incidents").glob("*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda r: r["time"])


def print_anatomies(rows: list[tuple[str, Anatomy]], step_seconds: float | None = None) -> None:
    names = list(STAGES)
    print(
        f"\nwhere each recovery's time went (seconds; kill -> first step = ranks gone -> first step)\n"
        f"{'':<16}" + "".join(f"{n:>9}" for n in names) + f"{'gone->1st':>10}{'total':>8}  resumed"
    )
    totals: dict[str, list[float]] = {n: [] for n in [*names, "gone->1st", "total"]}
    for label, a in rows:
        values = [a.stage(n) for n in names] + [a.span("ranks_gone", "first_step"), a.span("hang", "first_step")]
        for n, v in zip([*names, "gone->1st", "total"], values, strict=True):
            if v is not None:
                totals[n].append(v)
        redone = ""
        if a.redone_steps is not None:
            redone = f", {a.redone_steps} steps redone"
            if step_seconds:
                redone += f" ({a.redone_steps * step_seconds:.2f}s)"
        resumed = f"step {a.resumed_step} from {a.source}{redone}" if a.resumed_step is not None else "-"
        print(
            f"{label:<16}"
            + "".join(f"{fmt(v):>9}" for v in values[:-2])
            + f"{fmt(values[-2]):>10}{fmt(values[-1]):>8}  {resumed}"
        )
    if len(rows) > 1:
        med = [statistics.median(totals[n]) if totals[n] else None for n in [*names, "gone->1st", "total"]]
        print(f"{'median':<16}" + "".join(f"{fmt(v):>9}" for v in med[:-2]) + f"{fmt(med[-2]):>10}{fmt(med[-1]):>8}")


def fmt(value: float | None) -> str:
    return f"{value:7.2f}" if value is not None else "      -"
