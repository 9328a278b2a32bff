"""Who holds a job up, from every node's report: the rule of DESIGN.md's job view.

When a rank hangs, every other rank of the job soon waits for it in a collective. The culprit is
therefore the rank that is *not* waiting for its peers at the job's lowest step; a rank that waits
in a collective is never blamed. When every rank that still reports waits, the rank holding the
job up is on a node that stopped reporting (its sidecar and ranks gone, or cut off): that node is
named. Until the stacks of the ranks at the lowest step are known the judgement waits, unless it
is forced (the nodes cannot wait longer): then the rank with the oldest progress at the lowest
step is named, and the reason says the stacks were not known.

When ranks exit instead (a crash, a lost peer), the first to exit is the cause and the others'
exits its consequences, unless a node went silent: its loss is what made the others fail.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from sidecar.jobview.report import Culprit, NodeReport, RankView


def _step(r: RankView) -> int:
    return -1 if r.step is None else r.step


def judge(
    reports: Iterable[NodeReport], lost: Collection[str] = (), force: bool = False, silent: Collection[str] = ()
) -> Culprit | None:
    """The culprit of a troubled job, or None while it cannot be told (or nothing is wrong).
    `lost`: nodes that stopped reporting (or whose sidecar no longer answers); `silent`: nodes
    that have not reported since the incident opened (they may yet turn out lost)."""
    reports = list(reports)
    ranks = [(report.node, r) for report in reports for r in report.ranks if r.state != "gone"]
    exited = [(report.node, r) for report in reports for r in report.ranks if r.exited_at is not None]
    stalled = [(node, r) for node, r in ranks if r.troubled]
    if not stalled and not exited and not lost:
        return None
    if stalled:
        found = _hang(ranks, lost, force)
        if found is not None or not exited:
            return found
    if lost:
        return _lost(lost, "ranks of the job exit or wait")
    if silent and not force:
        return None  # a silent node may be the lost one: wait for it (or for its probe)
    node, r = min(exited, key=lambda nr: nr[1].exited_at or 0.0)
    return _culprit(node, r, "the first rank of the job to exit")


def _hang(ranks: list[tuple[str, RankView]], lost: Collection[str], force: bool) -> Culprit | None:
    lowest = min(_step(r) for _, r in ranks)
    where = "no step yet" if lowest < 0 else f"step {lowest}"
    behind = [(node, r) for node, r in ranks if _step(r) == lowest]
    waiting = [r for _, r in ranks if r.waiting]
    running = [(node, r) for node, r in behind if r.waiting is False and r.troubled]
    if running:
        node, r = max(running, key=lambda nr: nr[1].progress_age_seconds)
        others = f"{len(waiting)} rank{'s' if len(waiting) != 1 else ''} wait" if waiting else "no rank waits"
        why = f"not waiting for its peers at the job's lowest step ({where}), while {others} in a collective"
        return _culprit(node, r, why)
    unknown = [(node, r) for node, r in behind if r.waiting is None]
    if lost and not unknown:
        return _lost(lost, "every rank that reports waits in a collective")
    if force and behind:
        node, r = max(unknown or behind, key=lambda nr: nr[1].progress_age_seconds)
        known = "its stack was not known" if r.waiting is None else "every rank waits in a collective"
        return _culprit(node, r, f"oldest progress at the job's lowest step ({where}); {known}")
    return None


def _lost(lost: Collection[str], what: str) -> Culprit:
    names = ", ".join(sorted(lost))
    plural = "s" if len(lost) > 1 else ""
    return Culprit(
        None, sorted(lost)[0], reason=f"{what}; node{plural} {names} stopped reporting (sidecar unreachable)"
    )


def _culprit(node: str, r: RankView, reason: str) -> Culprit:
    return Culprit(r.rank, node, r.step, r.phase, r.stack_top, reason)
