"""What the exit tracker keeps per rank process while it watches it (sidecar/exits/tracker.py): one
`WatchedProcess` per process (its pidfd and memory cgroup, shared by every key that names it) and
one `Watch` per registered rank until its exit is decided."""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar.exits import kernel
from sidecar.host.identity import PidFd
from sidecar.ranks.model import Rank
from sidecar.ranks.protocol import ExitReport


@dataclass
class WatchedProcess:
    """One watched process, shared by every (job, rank) key registered for it: one pidfd and
    one memory-cgroup descriptor however many keys name it (a process may register thousands)."""

    pid: int
    start_time: float | None
    pidfd: PidFd | None  # the first registration's (identity.py), or one opened here
    cgroup: kernel.MemoryCgroup | None
    oom_baseline: int | None
    watches: int = 0  # how many watches share it; closed with the last
    checked: tuple[int, bool] = (0, True)  # (poll round, alive then): one check per round
    status: tuple[int, tuple[int | None, str | None]] = (0, (None, None))

    def close(self) -> None:
        self.pidfd = None  # a PidFd closes its descriptor with its last reference
        if self.cgroup is not None:
            self.cgroup.close()
            self.cgroup = None


@dataclass
class Watch:
    """One registered rank, from registration until its exit is decided."""

    rank: Rank
    process: WatchedProcess
    gpus: set[str] = field(default_factory=set)
    deregistered: str | None = None
    report: ExitReport | None = None
    remediated_by: str | None = None
    consequence_of: tuple[str, str] | None = None  # (job incident, culprit) when it was left to the launcher
    left_at_progress: float = 0.0  # its last progress then: a step since makes the mark stale (it resumed)
    replaced: bool = False  # a later registration took its key
    exited_at: float | None = None  # monotonic, when the exit was noticed
    exited_wall: float | None = None

    @property
    def retired(self) -> bool:
        """The rank has left the registry's live set (deregistered or replaced) while its
        process may run on: such watches are what a per-user bound may drop."""
        return self.deregistered is not None or self.replaced
