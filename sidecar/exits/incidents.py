"""Exit incidents: a record for every rank exit that was not clean, in the watchdog's incident
store (so `sidecar incidents` lists both kinds).

When one worker dies, torchrun stops the others, and on a node with eight ranks the first
death is followed by seven more within seconds. Those exits (of the same restart attempt) go into
the one incident that the first opened (for `exits.group_seconds`), which names the first as the
likely cause; the next attempt's failure is a new incident. An exit
the sidecar's own remediation caused has its stall incident already and opens none.

Cost: an incident keeps its first MAX_INLINE_EXITS exits in full and only counts the rest by
reason (`exits_left_out`), so however many ranks exit, each save writes a bounded record; and
`add` only marks the incident changed: `flush` writes each changed incident once (the tracker
calls it once per round, so N exits of one job cost one write, not N writes of a growing file),
rendered on the event loop and written in the executor.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from sidecar.incidents.store import Incident, IncidentStore, document, slurm_lines

MAX_INLINE_EXITS = 32  # exits kept in full per incident; the rest are counted by reason


@dataclass
class ExitIncident(Incident):
    kind: str = "exit"
    exits: list[dict[str, Any]] = field(default_factory=list)  # the first MAX_INLINE_EXITS decided exits, in order
    exits_left_out: dict[str, int] = field(default_factory=dict)  # reason -> later exits only counted

    @property
    def exit_count(self) -> int:
        return len(self.exits) + sum(self.exits_left_out.values())

    @property
    def summary(self) -> str:
        if not self.exits:
            return f"job {self.job_id}: rank exit"
        first = self.exits[0]
        text = f"job {self.job_id}: rank {first['rank']} exited: {first['reason']}"
        if first.get("consequence_of"):
            text += f", a consequence of job incident {first.get('job_incident')} ({first['consequence_of']})"
        exc = first.get("exception")
        if exc:
            text += f" ({exc['type']}: {exc['message'][:120]})"
        rollback = first.get("rollback")
        if rollback and rollback.get("checkpoint_step") is not None:
            text += f"; resume from checkpoint step {rollback['checkpoint_step']}"
        if self.exit_count > 1:
            text += "; then " + ", ".join(f"rank {e['rank']} ({e['reason']})" for e in self.exits[1:6])
            if self.exit_count > 6:
                text += f" and {self.exit_count - 6} more"
        return text

    def text(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.time))
        lines = [
            f"Incident {self.id}",
            f"  exit of   job {self.job_id} on {self.node}, {when}",
            *slurm_lines(self.slurm),
            f"  summary   {self.summary}",
            "",
        ]
        for e in self.exits:
            lines.append(f"  rank {e['rank']} (pid {e['pid']}, restart {e.get('restart_count', 0)}): {e['reason']}")
            lines.append(
                f"    last step {_show(e.get('step'))}, loss {_show(e.get('loss'))}, "
                f"step time {_show(e.get('step_time_seconds'))}s"
            )
            lines += [f"    evidence: {line}" for line in e.get("evidence", [])]
            exc = e.get("exception")
            if exc and exc.get("traceback"):
                lines.append("    traceback (innermost last):")
                lines += [f"      {frame}" for frame in exc["traceback"]]
            rollback = e.get("rollback")
            if rollback:
                where = (
                    f"checkpoint step {rollback['checkpoint_step']} at {rollback.get('checkpoint_path')}"
                    if rollback.get("checkpoint_step") is not None
                    else "no checkpoint before it is known"
                )
                lines.append(
                    f"    rollback: loss first non-finite at step {rollback['first_nonfinite_loss_step']}; "
                    f"last checkpoint before it: {where}"
                )
        if self.exits_left_out:
            counted = ", ".join(f"{n} {reason}" for reason, n in sorted(self.exits_left_out.items()))
            lines.append(f"  and {sum(self.exits_left_out.values())} more exits, only counted: {counted}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return document(lines)

    def brief(self) -> dict[str, Any]:
        out = super().brief()
        out.update(kind=self.kind, reason=self.outcome)
        return out


def _show(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class ExitIncidents:
    """Opens, groups and saves exit incidents."""

    def __init__(self, store: IncidentStore, group_seconds: float, clock=time.monotonic):
        self.store, self.group_seconds, self.clock = store, group_seconds, clock
        self._open: dict[tuple[str, int], tuple[float, ExitIncident]] = {}  # (job_id, restart) -> (opened, incident)
        self._changed: dict[str, ExitIncident] = {}  # by id: added to since their last write
        self._writing = asyncio.Lock()  # one flush at a time: a file never goes back to an older state
        self._tasks: set[asyncio.Task] = set()

    def add(self, entry: dict[str, Any]) -> tuple[str, bool]:
        """File one decided exit; returns the incident's id and whether this exit opened it.
        Nothing is written yet: `flush` writes the changed incidents."""
        job_id, now = entry["job_id"], self.clock()
        key = (job_id, entry.get("restart_count") or 0)
        for stale in [k for k, (opened, _) in self._open.items() if now - opened > self.group_seconds]:
            del self._open[stale]
        current = self._open.get(key)
        opened = current is None
        if current is None:
            incident = self.store.open(
                job_id,
                cls=ExitIncident,
                save=False,
                blamed_rank=entry["rank"],
                blame_reason=f"first local rank to exit ({entry['reason']})",
                timeout_seconds=None,
                observe_only=False,
                ranks=[],
                outcome=entry["reason"],
            )
            assert isinstance(incident, ExitIncident)  # open() builds the `cls` it is given
            self._open[key] = (now, incident)
        else:
            incident = current[1]
        if entry.get("job_incident") and incident.job_incident is None:
            incident.job_incident = entry["job_incident"]  # another node's hang or loss: part of that job incident
        if len(incident.exits) < MAX_INLINE_EXITS:
            incident.exits.append(entry)
            incident.event("rank_exit", at=entry["time"], rank=entry["rank"], reason=entry["reason"])
        else:
            incident.exits_left_out[entry["reason"]] = incident.exits_left_out.get(entry["reason"], 0) + 1
        self._changed[incident.id] = incident
        return incident.id, opened

    async def flush(self) -> None:
        """Write every incident changed since the last flush, once each, off the event loop."""
        async with self._writing:
            changed, self._changed = list(self._changed.values()), {}
            for incident in changed:
                await self.store.save_async(incident)

    def flush_soon(self) -> None:
        """`flush` in a task of its own (for an exit decided outside the tracker's rounds)."""
        if not self._changed:
            return
        try:
            task = asyncio.get_running_loop().create_task(self.flush())
        except RuntimeError:  # no running loop (a caller outside the daemon): write now
            for incident in self._changed.values():
                self.store.save(incident)
            self._changed = {}
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
