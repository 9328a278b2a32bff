"""Kill-and-resume drills (`sidecar drill`): which job is being drilled now, so that the stall incident
the watchdog opens for it is recorded as a drill (its `drill` field names the drill) and the exits it
causes are not counted as the job's failures (sidecar_job_failures_total).

The store (store.py) holds one `DrillMarks`; the daemon arms it (root only, sidecar/daemon/operations.py)
and the watchdog's drill driver (sidecar/watchdog/drill.py) disarms it once the job trains again or
the drill's time is up. At most one drill per job, MAX_DRILLS on the node.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

MAX_DRILLS = 8  # armed at once on the node
KEPT = 16  # finished drills remembered (for their answer and their incidents)


@dataclass
class Armed:
    drill_id: str
    job_id: str
    until: float  # wall clock: past this the drill no longer claims incidents or exits
    incidents: list[str] = field(default_factory=list)  # the stall incidents it claimed
    active: bool = True


class DrillMarks:
    def __init__(self, wall=time.time):
        self.wall = wall
        self._by_id: dict[str, Armed] = {}

    def arm(self, drill_id: str, job_id: str, seconds: float) -> Armed:
        if self.armed(job_id) is not None:
            raise ValueError(f"a drill of job {job_id} is already running")
        if sum(1 for a in self._by_id.values() if a.active) >= MAX_DRILLS:
            raise ValueError(f"{MAX_DRILLS} drills are already running on this node")
        armed = Armed(drill_id, job_id, self.wall() + seconds)
        self._by_id[drill_id] = armed
        finished = [k for k, a in self._by_id.items() if not a.active]
        for k in finished[: max(0, len(finished) - KEPT)]:
            del self._by_id[k]
        return armed

    def disarm(self, drill_id: str) -> None:
        armed = self._by_id.get(drill_id)
        if armed is not None:
            armed.active = False

    def armed(self, job_id: str) -> Armed | None:
        """The drill of the job running now, if any."""
        now = self.wall()
        return next((a for a in self._by_id.values() if a.active and a.job_id == job_id and now <= a.until), None)

    def claim(self, job_id: str, incident_id: str) -> str | None:
        """A stall incident of the job opens: the drill's id when a drill of the job runs."""
        armed = self.armed(job_id)
        if armed is None:
            return None
        armed.incidents.append(incident_id)
        return armed.drill_id

    def is_drill_incident(self, incident_id: str | None) -> bool:
        return incident_id is not None and any(incident_id in a.incidents for a in self._by_id.values())

    def get(self, drill_id: str) -> Armed | None:
        return self._by_id.get(drill_id)
