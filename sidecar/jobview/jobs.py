"""What the job's coordinator (coordinator.py) keeps per job: every node's latest report and its
summary, the open job incident and a few closed ones, and the small rules over them that a verdict
needs (who a verdict names, whether it may still change, whether a desync repeats the last one)."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Any

from sidecar import hang_kinds
from sidecar.jobview.golive import JobChecks
from sidecar.jobview.judge import Summary, exit_order
from sidecar.jobview.report import Culprit, NodePart, NodeReport, RankView, Verdict
from sidecar.jobview.stragglers import JobJudge

CLOSED_KEPT = 4  # closed job incidents kept per job (their stories)
HISTORY_KEPT = 16  # what the job's newest closed incidents repeat (`signature`): a crash loop's count


@dataclass
class JobIncident:
    verdict: Verdict
    paused: bool = False  # its verdict said job_paused: a rank still working when its peers wait is the pause's tail
    parts: dict[str, NodePart] = field(default_factory=dict)
    ranks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # node -> its ranks when troubled
    opened_mono: float = 0.0  # monotonic, when it opened
    node_set: set[str] = field(default_factory=set)  # the nodes that reported during it
    order: list[str] = field(default_factory=list)  # the same, in the order they first reported
    dumped_set: set[str] = field(default_factory=set)  # those whose stacks are dumped
    untroubled_since: float | None = None  # monotonic: every report fine since
    signature: tuple | None = None  # what a restart would repeat of its verdict (`signature`), once named
    exit_at: float | None = None  # a rank_crashed verdict's exit, on the coordinator's clock (`exit_time`)
    exits: dict[str, RankView] = field(default_factory=dict)  # node -> its first exit reported during it (`kept_exit`)


@dataclass
class Job:
    job_id: str
    reports: dict[str, tuple[NodeReport, float]] = field(default_factory=dict)  # node -> (report, monotonic)
    summaries: dict[str, Summary] = field(default_factory=dict)  # node -> its latest report, summarised
    current: JobIncident | None = None
    closed: collections.deque = field(default_factory=lambda: collections.deque(maxlen=CLOSED_KEPT))
    unreachable: set[str] = field(default_factory=set)  # nodes whose sidecar did not answer a probe
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    version: int = 0
    probing: asyncio.Task | None = None
    troubled: set[str] = field(default_factory=set)  # nodes whose latest report is troubled
    judged_at: float = -1e9  # monotonic, the last judgement
    judge_cost: float = 0.0  # seconds the last judgement took
    judge_pending: bool = False
    ranks_held: int = 0  # ranks in its nodes' latest reports
    lateness: JobJudge = field(default_factory=JobJudge)  # its ranks' entry times, judged (stragglers.py)
    stragglers_logged: set[int] = field(default_factory=set)
    golive: JobChecks = field(default_factory=JobChecks)  # its go-live checks over every node
    drill: tuple[str, str] | None = None  # (id, node): a node of the job drills it now (`sidecar drill`)
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=HISTORY_KEPT))

    def close_current(self) -> None:
        """Its current incident joins the closed ones (a new one opens)."""
        if self.current is not None:
            self.closed.append(self.current)
            self.history.append(self.current.signature if self.current.verdict.drill is None else None)

    def step(self) -> int | None:
        """The job's highest step its nodes report (exited ranks too): where the ranks that wait
        stand, their pushes going on while they wait, where a stopped rank's last push may lag."""
        steps = [r.step for report, _ in self.reports.values() for r in report.ranks if r.step is not None]
        return max(steps) if steps else None

    def held_by(self, node: str) -> int:
        got = self.reports.get(node)
        return len(got[0].ranks) if got is not None else 0


# Verdicts later evidence may still change: a pause that turns out a hang, the first exit before an
# earlier one (or the lost node) is heard of, the oldest progress before the stacks come.
REFINED = hang_kinds.REPORT_ONLY | {hang_kinds.OLDEST_PROGRESS.name}


def who(c: Culprit) -> tuple:
    """What nodes act on in a verdict (its reason may be reworded as evidence comes, unannounced)."""
    return c.kind, c.rank, c.node, c.evidence


def where(c: Culprit) -> str:
    if c.rank is not None:
        return f"rank {c.rank} on {c.node}"
    return f"node {c.node}" if hang_kinds.of(c.kind).blames == "node" else "no rank"


def is_busy(job: Job, culprit: Culprit) -> bool:
    """Its node finds the named rank busy, not hung; or the job was paused in this incident and the
    rank still works (CPU time growing) where its peers are done: the tail of the same pause."""
    s = job.summaries.get(culprit.node)
    if s is None or culprit.rank is None:
        return False
    if culprit.rank in s.busy:
        return True
    tail = job.current is not None and job.current.paused
    return tail and any(r.rank == culprit.rank and r.activity == "cpu" for r in s.behind + s.recorded)


def signature(c: Culprit, step: int | None) -> tuple | None:
    """What a crash loop repeats (hang_kinds.HangKind.loops): the same rank held the job up, hung or
    crashed, with the job at the same step (Job.step); a desync's same group and collectives at odds
    (sequence numbers restart with the process group). None: a kind a restart does not repeat."""
    if not hang_kinds.of(c.kind).loops:
        return None
    if c.kind == hang_kinds.COLLECTIVE_MISMATCH.name:
        coll = c.collective or {}
        return (c.kind, coll.get("pg"), tuple(sorted(coll.get("ops") or {})), step)
    return ("rank", c.rank, step)


def repeat_count(job: Job, mine: tuple | None) -> int:
    """How many of the job's closed incidents (the newest HISTORY_KEPT) were the same (`signature`)."""
    return 0 if mine is None else sum(1 for past in job.history if past == mine)


def exit_time(job: Job, c: Culprit) -> float | None:
    """When the named rank exited, on the coordinator's clock, while its node still reports it."""
    s = job.summaries.get(c.node)
    if s is None or s.first_exit is None or s.first_exit.rank != c.rank or s.first_exit.exited_at is None:
        return None
    return exit_order(s.first_exit) - (job.lateness.offset(c.node) or 0.0)


def kept_exit(job: Job, incident: JobIncident, node: str) -> None:
    """The first exit a node reported during the incident stays its first (`Summary.first_exit`)
    though its later reports drop it: a node lists an exited rank only until its restart takes its
    place, and the coordinator may not have judged meanwhile (a node of the job not heard of yet).
    One rank view per node of the incident."""
    s = job.summaries.get(node)
    if s is None:
        return
    kept = incident.exits.get(node)
    if s.first_exit is not None and (kept is None or exit_order(s.first_exit) < exit_order(kept)):
        incident.exits[node] = s.first_exit
    elif kept is not None:
        s.first_exit = kept


def later_exit(job: Job, incident: JobIncident, culprit: Culprit) -> bool:
    """Another rank named first to exit, though the named one exited before it: a node's report
    drops its exited rank once a restarted one takes its place (bench_crash_loop: the first of
    four crashes renamed to a consequence a second later, so the loop was found one crash late)."""
    v, crashed = incident.verdict, hang_kinds.RANK_CRASHED.name
    if v.culprit is None or v.culprit.kind != crashed or culprit.kind != crashed or incident.exit_at is None:
        return False
    new = exit_time(job, culprit)
    return new is None or new >= incident.exit_at


def tail_of_pause(job: Job, incident: JobIncident, culprit: Culprit) -> bool:
    """A paused job's last ranks still working (CPU time growing, `is_busy`) while the others,
    done, wait for them in the next collective: no one waits on something that cannot come, so
    the verdict stays `job_paused` (a chain of waits that ends in a working rank is no hang). It
    is named once its node reads that rank stopped working (stopped, idle, in D, on its DataLoader),
    or at watchdog.ceiling_seconds on its node; a moment its node cannot read it (its stack being
    read: state t) says nothing either way."""
    v = incident.verdict
    paused = v.culprit is not None and v.culprit.kind == hang_kinds.JOB_PAUSED.name
    if not paused or culprit.kind not in (hang_kinds.RANK_LATE.name, hang_kinds.RANK_SPINNING.name):
        return False
    s = job.summaries.get(culprit.node)
    doing = next((r.activity for r in (s.behind + s.recorded if s else []) if r.rank == culprit.rank), None)
    return culprit.busy or doing in (None, "cpu")


def rank_brief(r: Any) -> dict[str, Any]:
    return {
        "rank": r.rank,
        "state": r.state,
        "step": r.step,
        "phase": r.phase,
        "waiting": r.waiting,
        "stack_top": r.stack_top,
        "collectives": r.collectives.brief() if r.collectives is not None else None,
    }
