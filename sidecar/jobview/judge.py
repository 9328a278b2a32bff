"""Who holds a job up, from every node's report: the rule of DESIGN.md's job view.

When a rank hangs, every other rank of the job soon waits for it in a collective. The culprit is
therefore the rank that is *not* waiting for its peers at the job's lowest step; a rank that waits
in a collective is never blamed. When every rank that still reports waits, the rank holding the
job up is on a node that stopped reporting (its sidecar and ranks gone, or cut off): that node is
named. Until the stacks of the ranks at the lowest step are known the judgement waits, unless it
is forced (the nodes cannot wait longer): then the rank with the oldest progress at the lowest
step is named, and the reason says the stacks were not known.

The backend's own record comes first (collectives.py): where the ranks' Flight Recorder summaries
decide it, the late rank, a stuck collective or a desync is the verdict, whatever the stacks
show; the stack rule above judges only where they do not (no record: an older torch, the recorder
off). Every culprit says which evidence judged it (`evidence`: collectives, stacks, progress).

When ranks exit instead (a crash, a lost peer), the first to exit is the cause and the others'
exits its consequences, unless a node went silent: its loss is what made the others fail.

Each report is summarised once, when it arrives (`summarize`, linear in its ranks); a judgement
reads the summaries (`judge_summaries`, linear in the nodes), so a coordinator of 1,000 nodes
judges in well under a millisecond.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace

from sidecar.jobview import collectives
from sidecar.jobview.report import Culprit, NodeReport, RankView

NO_STEP = -1


@dataclass
class Summary:
    """What judging needs of one node's report."""

    node: str
    lowest: int | None = None  # the lowest step of its live ranks (NO_STEP: one has none yet)
    behind: list[RankView] = field(default_factory=list)  # its live ranks at that step
    waiting: int = 0  # its live ranks that wait in a collective
    stalled: bool = False  # a live rank is suspect or stalled
    first_exit: RankView | None = None  # its rank that exited first, recently
    recorded: list[RankView] = field(default_factory=list)  # its live ranks with a collective record
    received: float | None = None  # the judge's clock when the report arrived (records' ages are as of then)
    busy: list[int] = field(default_factory=list)  # its ranks busy, not hung (RankView.busy)


def _step(r: RankView) -> int:
    return NO_STEP if r.step is None else r.step


def summarize(report: NodeReport, received: float | None = None) -> Summary:
    s = Summary(report.node, received=received)
    for r in report.ranks:
        if r.exited_at is not None and (s.first_exit is None or r.exited_at < (s.first_exit.exited_at or 0.0)):
            s.first_exit = r
        if r.state == "gone":
            continue
        step = _step(r)
        if s.lowest is None or step < s.lowest:
            s.lowest, s.behind = step, [r]
        elif step == s.lowest:
            s.behind.append(r)
        s.waiting += bool(r.waiting)
        s.stalled = s.stalled or r.troubled
        if r.busy:
            s.busy.append(r.rank)
        if r.collectives is not None:
            s.recorded.append(r)
    return s


def judge(
    reports: Iterable[NodeReport], lost: Collection[str] = (), force: bool = False, silent: Collection[str] = (),
    stale_after: float = collectives.STALE_AFTER_SECONDS,
) -> Culprit | None:  # fmt: skip
    """The culprit of a troubled job, or None while it cannot be told (or nothing is wrong).
    `lost`: nodes that stopped reporting (or whose sidecar no longer answers); `silent`: nodes
    that have not reported since the incident opened (they may yet turn out lost); `stale_after`:
    a collective record older than this says its rank's process stopped."""
    return judge_summaries([summarize(r) for r in reports], lost, force, silent, stale_after)


def judge_summaries(
    summaries: Iterable[Summary], lost: Collection[str] = (), force: bool = False, silent: Collection[str] = (),
    stale_after: float = collectives.STALE_AFTER_SECONDS, now: float | None = None,
) -> Culprit | None:  # fmt: skip
    """`now`: the clock the summaries' `received` times are on; each record's age is brought to it
    (nodes report at different moments: their ages must be compared as of one instant)."""
    summaries = list(summaries)
    live = [s for s in summaries if s.lowest is not None]
    exits = [s for s in summaries if s.first_exit is not None]
    if not any(s.stalled for s in live) and not exits and not lost:
        return None
    if any(s.stalled for s in live):
        finding = collectives.judge(_records_now(live, now), stale_after, force)
        if finding is not None:
            return finding.to_culprit()
        # Records that do not decide it yet (a fresh one is on its way): the stacks only when forced.
        undecided = not force and not lost and any(s.recorded for s in live)
        found = None if undecided else _hang(live, lost, force)
        if found is not None or not exits:
            return found
    if lost:
        return _lost(lost, "ranks of the job exit or wait")
    if silent and not force:
        return None  # a silent node may be the lost one: wait for it (or for its probe)
    first = min(exits, key=lambda s: s.first_exit.exited_at or 0.0 if s.first_exit else 0.0)
    assert first.first_exit is not None
    return _culprit(first.node, first.first_exit, "the first rank of the job to exit", "first_exit", "progress")


def _records_now(live: list[Summary], now: float | None) -> list[tuple[str, RankView]]:
    out = []
    for s in live:
        shift = max(0.0, now - s.received) if now is not None and s.received is not None else 0.0
        for r in s.recorded:
            if shift and r.collectives_age is not None:
                r = replace(r, collectives_age=r.collectives_age + shift)
            out.append((s.node, r))
    return out


def _hang(live: list[Summary], lost: Collection[str], force: bool) -> Culprit | None:
    lowest = min(s.lowest for s in live if s.lowest is not None)
    where = "no step yet" if lowest < 0 else f"step {lowest}"
    behind = [(s.node, r) for s in live if s.lowest == lowest for r in s.behind]
    waiting = sum(s.waiting for s in live)
    running = [(node, r) for node, r in behind if r.waiting is False and r.troubled]
    if running:
        node, r = max(running, key=lambda nr: nr[1].progress_age_seconds)
        others = f"{waiting} rank{'s' if waiting != 1 else ''} wait" if waiting else "no rank waits"
        why = f"not waiting for its peers at the job's lowest step ({where}), while {others} in a collective"
        return _culprit(node, r, why, "rank_running", "stacks")
    unknown = [(node, r) for node, r in behind if r.waiting is None]
    if lost and not unknown:
        return _lost(lost, "every rank that reports waits in a collective")
    if force and behind:
        node, r = max(unknown or behind, key=lambda nr: nr[1].progress_age_seconds)
        known = "its stack was not known" if r.waiting is None else "every rank waits in a collective"
        return _culprit(node, r, f"oldest progress at the job's lowest step ({where}); {known}", "oldest_progress",
                        "progress")  # fmt: skip
    return None


def _lost(lost: Collection[str], what: str) -> Culprit:
    names = ", ".join(sorted(lost))
    plural = "s" if len(lost) > 1 else ""
    return Culprit(
        None, sorted(lost)[0], reason=f"{what}; node{plural} {names} stopped reporting (sidecar unreachable)",
        kind="node_lost", evidence="progress",
    )  # fmt: skip


def _culprit(node: str, r: RankView, reason: str, kind: str, evidence: str) -> Culprit:
    return Culprit(r.rank, node, r.step, r.phase, r.stack_top, reason, kind, evidence)


def records_said(summaries: list[Summary], now: float) -> str:
    """Each rank's record in a line's worth, for the log when the records did not decide a verdict."""
    said = []
    for s in summaries:
        shift = max(0.0, now - s.received) if s.received is not None else 0.0
        for r in s.recorded[:8]:
            assert r.collectives is not None
            groups = ", ".join(
                f"pg {g.pg} enq {g.enqueued} done {g.completed}"
                + (f" in #{g.pending[0].seq} {r.collectives.time - g.pending[0].created:.1f}s" if g.pending else "")
                for g in r.collectives.groups[:4]
            )
            said.append(f"{s.node} rank {r.rank} ({(r.collectives_age or 0.0) + shift:.1f}s old): {groups}")
    return "; ".join(said[:32])
