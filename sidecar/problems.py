"""What makes a node degraded, as values: the watchdog's and `/v1/status`'s problems.

Each problem has a kind and the subject it is about (a rank, a job, a collector); `/v1/status`
lists their text. Two sources may see the same subject (the watchdog words a stalled rank with
its timeout basis; the status document words any rank in a bad state): the first one's wording
stands, matched by subject, never by text.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class Kind(enum.Enum):
    RANK = "rank"  # a rank suspect, stalled or being remediated
    STORM_CAP = "storm_cap"  # a job's remediation suppressed by the storm cap
    COLLECTOR = "collector"  # a collector failing
    NODE = "node"  # the node is unfit (sidecar/fitness.py): what outlives a job


@dataclass(frozen=True)
class Problem:
    kind: Kind
    text: str  # one line for people, as `/v1/status` shows it
    job_id: str | None = None
    rank: int | None = None
    collector: str | None = None

    @property
    def subject(self) -> tuple:
        return (self.kind, self.job_id, self.rank, self.collector)

    def __str__(self) -> str:
        return self.text


def merged(first: Iterable[Problem], more: Iterable[Problem]) -> list[Problem]:
    """`first`, then those of `more` about a subject `first` does not cover."""
    out = list(first)
    seen = {p.subject for p in out}
    out += [p for p in more if p.subject not in seen]
    return out
