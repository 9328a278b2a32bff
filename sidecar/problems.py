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
    RESTART_TRAP = "restart_trap"  # a job whose process group would not come back after a torchrun restart
    CRASH_LOOP = "crash_loop"  # a job ended on purpose: the same verdict at the same step after restarts


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


RESTART_TRAP_FIX = (
    "import trainer_hooks before the script calls torch.distributed.init_process_group (or form the group "
    "with trainer_hooks.distributed.init_process_group; and leave SIDECAR_ATTEMPT_STORE unset), or set "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment"
)


def restart_trap(job_id: str, ranks: list[int]) -> Problem:
    """The job's ranks that said their process group would not come back after a torchrun restart
    (the registration's `restart_safe: false`, docs/architecture/restarts.md "Restarts and the agent's store")."""
    ranks = sorted(ranks)
    shown = ", ".join(str(r) for r in ranks[:4]) + (f" and {len(ranks) - 4} more" if len(ranks) > 4 else "")
    return Problem(
        Kind.RESTART_TRAP,
        f"job {job_id}: rank{'s' if len(ranks) > 1 else ''} {shown} would not come back after a torchrun restart "
        f"(torchrun shares its store across attempts and the process group has no namespace of its own attempt, "
        f"so a restarted attempt can die in init_process_group); fix: {RESTART_TRAP_FIX}",
        job_id,
    )
