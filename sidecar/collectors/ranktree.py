"""Which processes belong to which registered rank: the rank's pid and its descendants
(data-loader workers, compile workers). The process and GPU collectors both need it."""
from __future__ import annotations

from typing import Callable, Iterable

import psutil

RankRef = tuple[str, int, int]  # (job_id, rank, pid), as the registry reports live ranks
RanksFn = Callable[[], list[RankRef]]


def process_tree(pid: int) -> tuple[psutil.Process, list[psutil.Process]] | None:
    """The rank's process and its live descendants; None when the rank's process is gone."""
    try:
        root = psutil.Process(pid)
        return root, root.children(recursive=True)
    except psutil.Error:
        return None


def pid_owners(ranks: Iterable[RankRef]) -> dict[int, tuple[str, int]]:
    """Every pid of every rank's tree, mapped to (job_id, rank)."""
    owners: dict[int, tuple[str, int]] = {}
    for job_id, rank, pid in ranks:
        tree = process_tree(pid)
        if tree is None:
            continue
        root, children = tree
        for p in (root, *children):
            owners.setdefault(p.pid, (job_id, rank))
    return owners
