"""Who holds a stalled job up: the watchdog's first guess from the registry (`blame`), refined
once the stack dumps are in (`refine_blame`), then by the ranks' collective records where they
decide it (`judge_collectives`: the backend's own record before the stacks)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from sidecar import hang_kinds
from sidecar.incidents.store import Incident
from sidecar.jobview import collectives
from sidecar.jobview.report import RankView
from sidecar.ranks.model import Rank, RankKey


def blame(ranks: list[Rank], stalled_keys: Collection[RankKey]) -> tuple[Rank | None, str]:
    """The rank most likely to hold the job up, and why: the one with the lowest step (the
    others wait for it in a collective), then the one whose progress is oldest; among ranks
    alike, the only one past its timeout (`stalled_keys`: the keys of those past it)."""
    if not ranks:
        return None, "no local rank"
    stalled = [r for r in ranks if r.key in stalled_keys]
    if len(ranks) == 1:
        return ranks[0], "the only local rank"

    def step_of(r: Rank) -> int:
        return -1 if r.step is None else r.step

    lowest = min(step_of(r) for r in ranks)
    behind = [r for r in ranks if step_of(r) == lowest]
    oldest = min(behind, key=lambda r: r.last_progress)
    where = "no step yet" if lowest < 0 else f"step {lowest}"
    if len(behind) < len(ranks):
        return oldest, f"lowest step ({where}) of the job's local ranks"
    if len(stalled) == 1:
        return stalled[0], f"first to pass its timeout ({where})"
    return oldest, f"oldest progress among ranks at {where}"


def refine_blame(incident: Incident) -> None:
    """After stack dumps: among the ranks at the lowest step, one that is not waiting for its
    peers while others wait in a collective is the culprit; when every local rank waits, the
    culprit is on another node."""
    known = [r for r in incident.ranks if r.in_collective is not None]
    if not known:
        return
    waiting = [r.rank for r in known if r.in_collective]
    if len(waiting) == len(known):
        incident.blame_reason += (
            "; every local rank waits in a collective, so the rank holding the job up is probably on another node"
        )
        return
    lowest = min(r.step if r.step is not None else -1 for r in incident.ranks)
    outside = [r for r in known if not r.in_collective and (r.step if r.step is not None else -1) == lowest]
    if outside and waiting:
        chosen = next((r for r in outside if r.rank == incident.blamed_rank), outside[0])
        others = f"rank {waiting[0]} waits" if len(waiting) == 1 else f"ranks {', '.join(map(str, waiting))} wait"
        incident.blamed_rank = chosen.rank
        incident.blame_reason = f"not waiting for its peers, while {others} for it in a collective"


def judge_collectives(
    incident: Incident, ranks: Iterable[Rank], node: str, now: float, stale_after: float
) -> collectives.Finding | None:
    """This node's ranks' collective records into the incident (each rank's, for the record), and
    the judgement they give of the node's own ranks (a job whose ranks are all here, or a node
    judging alone); the job's verdict, where there is one, replaces it (coordination.adopt)."""
    ranks = list(ranks)
    by_rank = {r.rank: r for r in ranks}
    for snap in incident.ranks:
        r = by_rank.get(snap.rank)
        if r is not None and r.collectives is not None:
            snap.collectives = r.collectives.brief()
    views = []
    for r in ranks:
        if r.collectives is None:
            continue
        state = next((s.state for s in incident.ranks if s.rank == r.rank), "stalled")
        views.append((node, RankView(r.rank, r.local_rank, state, r.step, r.phase, 0.0,
                                     collectives=r.collectives, collectives_age=r.collectives_age(now))))  # fmt: skip
    incident.evidence = "stacks" if any(s.in_collective is not None for s in incident.ranks) else "progress"
    finding = collectives.judge(views, stale_after)
    if finding is None:  # this node's own guess, by name, until a verdict replaces it (one name everywhere)
        stacks = incident.evidence == "stacks"
        incident.hang_kind = (hang_kinds.RANK_UNKNOWN if stacks else hang_kinds.OLDEST_PROGRESS).name
        return None
    c = finding.to_culprit()
    world = max((r.world_size for r in ranks), default=0)
    if c.rank is None and finding.kind == "collective_stuck" and len(ranks) < world:
        return None  # a collective of ranks elsewhere too: the job's verdict says whose it is
    incident.hang_kind, incident.evidence, incident.collective = c.kind, c.evidence, c.collective
    if c.rank is not None:
        incident.blamed_rank = c.rank
    incident.blame_reason = c.reason
    return finding
