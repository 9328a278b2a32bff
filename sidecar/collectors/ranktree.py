"""Which processes belong to which registered rank: the rank's pid and its descendants
(data-loader workers, compile workers). The process and GPU collectors both need it.

Finding descendants means reading every process's parent. psutil's `children()` scans all of
/proc on each call; with 8 ranks and two collectors that is 16 scans a round. Here one scan
serves every lookup for SNAPSHOT_MAX_AGE seconds: a new worker shows up that much later, and a
process that exited meanwhile is simply not found when it is read."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable

import psutil

RankRef = tuple[str, int, int]  # (job_id, rank, pid), as the registry reports live ranks
RanksFn = Callable[[], list[RankRef]]

SNAPSHOT_MAX_AGE = 5.0  # seconds; process trees change rarely (workers start with an epoch)

_lock = threading.Lock()
_snapshot: tuple[float, dict[int, list[int]]] = (float("-inf"), {})


def _scan(procfs: str) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for name in os.listdir(procfs):
        if not name.isdigit():
            continue
        try:
            with open(f"{procfs}/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:  # exited while we looked
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        fields = data[data.rfind(b")") + 2 :].split(b" ", 2)
        children.setdefault(int(fields[1]), []).append(int(name))
    return children


def children_map() -> dict[int, list[int]]:
    """pid -> its direct children, from one recent scan of procfs."""
    global _snapshot
    with _lock:
        taken, children = _snapshot
        if time.monotonic() - taken > SNAPSHOT_MAX_AGE:
            try:
                children = _scan(psutil.PROCFS_PATH)
            except OSError:
                children = {}
            _snapshot = (time.monotonic(), children)
        return children


def descendant_pids(pid: int, children: dict[int, list[int]]) -> list[int]:
    out, stack, seen = [], list(children.get(pid, ())), {pid}
    while stack:
        child = stack.pop()
        if child in seen:
            continue
        seen.add(child)
        out.append(child)
        stack.extend(children.get(child, ()))
    return out


def tree_pids(pid: int) -> list[int] | None:
    """The rank's pid followed by its descendants' pids; None when the rank's process is gone."""
    if pid <= 0 or not psutil.pid_exists(pid):  # 0 would be the kernel's idle task
        return None
    return [pid, *descendant_pids(pid, children_map())]


def pid_owners(ranks: Iterable[RankRef]) -> dict[int, tuple[str, int]]:
    """Every pid of every rank's tree, mapped to (job_id, rank)."""
    children = children_map()
    owners: dict[int, tuple[str, int]] = {}
    for job_id, rank, pid in ranks:
        if pid > 0 and psutil.pid_exists(pid):
            for p in (pid, *descendant_pids(pid, children)):
                owners.setdefault(p, (job_id, rank))
    return owners
