"""The coordinator's budget of ranks (`job_view.max_ranks`), shared fairly between owners and jobs.

A coordinator keeps the latest report of every node of every job it coordinates, bounded by
`job_view.max_ranks` ranks in all (round 3, rows 1 and 13). First come, first served let one local
user hold it all (round 4, row 3): one sleeper of her own job claiming a world size of 2**24, her
invented nodes held 16,383 of 16,384 ranks, another user's second node then got 429 on its reports,
and that user's real hang was judged by one node alone and blamed on a healthy waiting rank.

Now, when a report does not fit, the budget is split: each owner (the uid of the job's verified
ranks here; unverified callers are one owner) present or asking gets an equal share, and each of an
owner's jobs an equal part of it. A report that would take its job past its part is refused (429);
otherwise the jobs most over their parts give back their excess (their largest nodes' reports
dropped first, the largest excess first) until it fits. So with n owners present, one owner holds
at most max_ranks/n once another asks, and a job that keeps within its part is never refused while
others hold more than theirs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Holding:
    job: str
    owner: int | None
    ranks: int  # ranks of the job's latest reports, kept now


def parts(holdings: Iterable[Holding], job: str, owner: int | None, budget: int) -> dict[str, int]:
    """Each job's fair part of `budget` (ranks), with `job` of `owner` among them."""
    jobs_of: dict[int | None, set[str]] = {owner: {job}}
    for h in holdings:
        if h.ranks > 0 or h.job == job:
            jobs_of.setdefault(h.owner, set()).add(h.job)
    share = budget // len(jobs_of)
    return {j: share // len(js) for js in jobs_of.values() for j in js}


def make_room(
    holdings: list[Holding], job: str, owner: int | None, more: int, budget: int
) -> list[tuple[str, int]] | None:
    """(job, ranks it gives back) so that `more` ranks of `job` fit in `budget`, the most over
    their fair part first, each at most its excess; None when `job` itself would be past its part
    (refuse it) or the others' excess is not enough."""
    fair = parts(holdings, job, owner, budget)
    held = {h.job: h.ranks for h in holdings}
    if held.get(job, 0) + more > fair[job]:
        return None
    need = sum(held.values()) + more - budget
    over = [h for h in holdings if h.job != job and h.ranks > fair.get(h.job, 0)]
    victims = []
    for h in sorted(over, key=lambda h: fair.get(h.job, 0) - h.ranks):  # the largest excess first
        if need <= 0:
            break
        given = min(need, h.ranks - fair.get(h.job, 0))
        victims.append((h.job, given))
        need -= given
    return victims if need <= 0 else None


def largest_first(held_by_node: dict[str, int], ranks: int) -> list[str]:
    """The nodes whose reports to drop, largest first, until at least `ranks` are freed."""
    chosen, freed = [], 0
    for node in sorted(held_by_node, key=held_by_node.__getitem__, reverse=True):
        if freed >= ranks:
            break
        chosen.append(node)
        freed += held_by_node[node]
    return chosen
