"""Straggler incidents: one incident of kind `straggler` per episode of a rank of this node being
its job's straggler (docs/architecture/stragglers.md#stragglers-lateness-per-rank), in the watchdog's incident
store, so that `sidecar incidents` lists it with the stalls and the exits.

An episode opens when a local rank is first named straggler, by the job's coordinator (over the
whole job) or by this node (over its own ranks), as `/v1/status` `stragglers` shows the judgements
(stragglers.status); it is updated while the rank stays named (its lateness now and at most, the
group it is latest in, who judged it) and closes once the rank has not been named for
CLOSE_AFTER_SECONDS: a lateness that hovers at the threshold, named on one look and not the next,
stays one episode, not one incident a minute. Only the straggler's own node keeps the incident:
every node of the job sees the coordinator's judgement, but one episode is one record, on the node
where its cause is to be found.

A straggler is reported, never remediated: nothing here signals a process (the outcome of a
straggler incident is `straggler` while open and `recovered` once closed). Opt-in
(`job_view.straggler_exclude_after_seconds`, 0: off), a straggler whose cause is in its node's
hardware (a GPU's clocks held down: straggler_cause.Cause.hardware; a CPU quota is the job's own
setting and never counts) for that long marks the node for exclusion at the job's next restart: a
node fitness finding (`findings`, reason `straggler`), so `sidecar status --check node` answers
unfit and node-problem-detector sets its condition, held for
`job_view.straggler_exclude_hold_seconds` after the episode ends (a node left out names no
straggler, and should not be let back at the restart after). Writes: on open, on
close, when who judged it or the group changes, and otherwise at most once every
SAVE_EVERY_SECONDS while it stays open, each in the executor (IncidentStore.save_async).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from sidecar.fitness import Finding, Reason
from sidecar.incidents.store import Incident, IncidentStore, document
from sidecar.jobview import stragglers
from sidecar.jobview.reporter import Reporter
from sidecar.ranks import lateness
from sidecar.ranks.model import Rank, RankKey
from sidecar.ranks.straggler_cause import Cause, Causes, GpuReasons

log = logging.getLogger(__name__)

CHECK_SECONDS = 5.0  # how often the judgements are looked at (the hooks send entry times once per 10 s slot)
CLOSE_AFTER_SECONDS = 60.0  # an episode ends when its rank has not been named for this long
SAVE_EVERY_SECONDS = 60.0  # an open episode's record is rewritten at most this often (besides its changes)


@dataclass
class StragglerIncident(Incident):
    kind: str = "straggler"
    # The finding as last judged: lateness_seconds, max_lateness_seconds, pg, interval_seconds,
    # threshold_seconds, judged_by ("coordinator" or "node"), judged_on (the judging node).
    straggler: dict[str, Any] = field(default_factory=dict)
    started: float | None = None  # Unix time the episode opened (first named)
    last_named: float | None = None  # Unix time it was last named
    ended: float | None = None  # Unix time it closed (not named for CLOSE_AFTER_SECONDS); None while open
    looks_named: int = 0  # looks at the judgements that named it

    @property
    def summary(self) -> str:
        s = self.straggler
        late = s.get("lateness_seconds")
        most = s.get("max_lateness_seconds")
        text = f"job {self.job_id}: straggler {self.blamed}"
        if isinstance(late, (int, float)):
            text += f", {late * 1000:.1f} ms late"
            if isinstance(most, (int, float)) and most > late:
                text += f" (at most {most * 1000:.1f} ms)"
        text += f" in pg {s.get('pg')}, judged by {s.get('judged_by')} ({s.get('judged_on')}), cause {s.get('cause')}"
        if self.ended is not None and self.started is not None:
            return text + f"; recovered after {self.ended - self.started:.0f} s; never killed"
        return text + "; ongoing; never killed"

    def text(self) -> str:
        def when(t: float | None) -> str:
            return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t is not None else "-"

        s = self.straggler
        interval = s.get("interval_seconds")
        lines = [
            f"Incident {self.id}",
            f"  straggler in job {self.job_id} on {self.node}",
            f"  summary   {self.summary}",
            f"  rank      {self.blamed_rank} on {self.blamed_node}",
            f"  lateness  {_ms(s.get('lateness_seconds'))} now, {_ms(s.get('max_lateness_seconds'))} at most",
            f"  group     pg {s.get('pg')}, "
            + (f"{_ms(interval)} between collectives, " if isinstance(interval, (int, float)) else "")
            + f"threshold {_ms(s.get('threshold_seconds'))}",
            f"  judged by {s.get('judged_by')} ({s.get('judged_on')})",
            f"  cause     {s.get('cause')}" + (f" ({s['cause_evidence']})" if s.get("cause_evidence") else ""),
            f"  started   {when(self.started)}",
            f"  ended     {when(self.ended)}" if self.ended is not None else "  ended     - (still named)",
            "",
            "  timeline",
        ]
        for e in self.timeline:
            extra = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("event", "time", "after_detection_seconds"))
            lines.append(f"    +{e['after_detection_seconds']:9.3f}s  {e['event']}" + (f"  ({extra})" if extra else ""))
        for note in self.notes:
            lines.append(f"  note: {note}")
        return document(lines)

    def brief(self) -> dict[str, Any]:
        out = super().brief()
        out.update(kind=self.kind, straggler=self.straggler, started=self.started, ended=self.ended)
        return out


def _ms(value: Any) -> str:
    return f"{value * 1000:.1f} ms" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


@dataclass
class _Episode:
    incident: StragglerIncident
    last_named: float  # monotonic
    saved: float  # monotonic, its last write
    hardware_since: float | None = None  # monotonic, since when its cause has been in the hardware without a break


@dataclass
class _Mark:
    """A node marked for exclusion at the job's next restart, for one straggler."""

    text: str
    until: float | None = None  # monotonic; None while its episode is open


class StragglerIncidents:
    """Opens, updates and closes straggler incidents from the judgements `/v1/status` shows."""

    def __init__(
        self,
        store: IncidentStore,
        close_after: float = CLOSE_AFTER_SECONDS,
        save_every: float = SAVE_EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        exclude_after: float = 0.0,
        exclude_hold: float = 3600.0,
    ):
        self.store, self.close_after, self.save_every = store, close_after, save_every
        self.clock, self.wall = clock, wall
        self.exclude_after, self.exclude_hold = exclude_after, exclude_hold
        self.open: dict[RankKey, _Episode] = {}
        self.marks: dict[RankKey, _Mark] = {}

    def observe(
        self, judgements: Iterable[dict[str, Any]], local: Collection[RankKey],
        causes: Callable[[RankKey], Cause | None] | None = None,
    ) -> list[StragglerIncident]:  # fmt: skip
        """Take one look at the judgements (stragglers.status: per job, who judged it and the
        stragglers it names), this node's live ranks and, where known, each one's cause
        (straggler_cause.py); returns the incidents to write."""
        now, wall = self.clock(), self.wall()
        named: dict[RankKey, dict[str, Any]] = {}
        for j in judgements:
            for s in j.get("stragglers") or []:
                key = (str(j.get("job_id")), s.get("rank"))
                if key in local and key not in named:  # the coordinator's judgement comes first
                    cause = causes(key) if causes is not None else None
                    named[key] = {
                        **s, "judged_by": j.get("judged_by"), "judged_on": j.get("judged_on"),
                        "cause": cause.cause if cause is not None else "unknown",
                        "cause_evidence": cause.evidence if cause is not None else None,
                        "hardware": cause.hardware if cause is not None else False,
                    }  # fmt: skip
        changed: list[StragglerIncident] = []
        for key, s in sorted(named.items()):
            episode = self.open.get(key)
            if episode is None:
                self.open[key] = _Episode(self._opened(key, s, wall), now, now)
                self._exclusion(key, self.open[key], s, now, wall)
                changed.append(self.open[key].incident)
                continue
            episode.last_named = now
            updated = self._update(episode.incident, s, wall)
            if self._exclusion(key, episode, s, now, wall) or updated or now - episode.saved >= self.save_every:
                episode.saved = now
                changed.append(episode.incident)
        for key in [k for k, e in self.open.items() if k not in named and now - e.last_named >= self.close_after]:
            episode = self.open.pop(key)
            incident = episode.incident
            incident.ended, incident.outcome = wall, "recovered"
            incident.event("recovered", at=wall, not_named_for_seconds=round(now - episode.last_named, 3))
            if key in self.marks:
                self.marks[key].until = now + self.exclude_hold
            log.info("job %s: rank %s is no straggler any more: incident %s closed", key[0], key[1], incident.id)
            changed.append(incident)
        return changed

    def _exclusion(self, key: RankKey, episode: _Episode, s: dict[str, Any], now: float, wall: float) -> bool:
        """Follow how long its cause has been in the hardware; mark the node for exclusion once that
        reaches `exclude_after` (opt-in). Whether it was marked now."""
        if not s.get("hardware"):
            episode.hardware_since = None
            return False
        if episode.hardware_since is None:
            episode.hardware_since = now
        held = now - episode.hardware_since
        marked = key in self.marks and self.marks[key].until is None  # once per episode
        if self.exclude_after <= 0 or held < self.exclude_after or marked:
            return False
        job_id, rank = key
        text = (
            f"job {job_id}: rank {rank} has been its straggler for {held:.0f} s with a cause in this node's hardware "
            f"({s.get('cause_evidence')}): leave this node out at the job's next restart"
        )
        self.marks[key] = _Mark(text)
        episode.incident.event("marked_for_exclusion", at=wall, hardware_cause_seconds=round(held, 3))
        log.warning("%s (job_view.straggler_exclude_after_seconds)", text)
        return True

    def findings(self) -> list[Finding]:
        """The node fitness findings (sidecar/fitness.py): one per straggler that marked this node for
        exclusion, while its episode is open and for `exclude_hold` seconds after."""
        now = self.clock()
        for key in [k for k, m in self.marks.items() if m.until is not None and now >= m.until]:
            del self.marks[key]
        return [Finding(Reason.STRAGGLER, m.text) for _, m in sorted(self.marks.items())]

    def _opened(self, key: RankKey, s: dict[str, Any], wall: float) -> StragglerIncident:
        job_id, rank = key
        incident = self.store.open(
            job_id,
            cls=StragglerIncident,
            save=False,
            blamed_rank=rank,
            blamed_node=s.get("node") or self.store.node,
            blame_reason="enters its collectives last (lateness)",
            timeout_seconds=None,
            observe_only=True,
            ranks=[],
            outcome="straggler",
        )
        assert isinstance(incident, StragglerIncident)  # open() builds the `cls` it is given
        incident.started = incident.last_named = wall
        incident.notes.append("a straggler is reported, never killed")
        self._update(incident, s, wall)
        incident.looks_named = 1
        log.warning("job %s: rank %s is a straggler: incident %s", job_id, rank, incident.id)
        return incident

    @staticmethod
    def _update(incident: StragglerIncident, s: dict[str, Any], wall: float) -> bool:
        """The finding as judged now; whether something worth a write at once changed (who
        judged it, the group)."""
        old = incident.straggler
        late = s.get("lateness_seconds")
        most = max((v for v in (late, old.get("max_lateness_seconds")) if isinstance(v, (int, float))), default=None)
        new = {
            "lateness_seconds": late,
            "max_lateness_seconds": most,
            "pg": s.get("pg"),
            "interval_seconds": s.get("interval_seconds"),
            "threshold_seconds": s.get("threshold_seconds"),
            "judged_by": s.get("judged_by"),
            "judged_on": s.get("judged_on"),
            "cause": s.get("cause", "unknown"),
            "cause_evidence": s.get("cause_evidence"),
            "hardware": bool(s.get("hardware")),
        }
        incident.straggler, incident.last_named = new, wall
        incident.looks_named += 1
        moved = bool(old) and (old.get("judged_by"), old.get("pg")) != (new["judged_by"], new["pg"])
        if moved:
            by, on = new["judged_by"], new["judged_on"]
            incident.event("judged_again", at=wall, judged_by=by, judged_on=on, pg=new["pg"])
        if new["cause"] != old.get("cause", "unknown") and (old or new["cause"] != "unknown"):
            incident.event("cause", at=wall, cause=new["cause"], evidence=new["cause_evidence"])
            moved = True
        return moved

    async def look(
        self, judgements: Iterable[dict[str, Any]], local: Collection[RankKey],
        causes: Callable[[RankKey], Cause | None] | None = None,
    ) -> None:  # fmt: skip
        for incident in self.observe(judgements, local, causes):
            await self.store.save_async(incident)


def watching(
    incidents: StragglerIncidents, node: str, ranks: Callable[[], Iterable[Rank]], reporter: Reporter | None,
    tracker: lateness.Tracker, gpus: Callable[[RankKey], GpuReasons | None] = lambda key: None,
) -> Callable[[], Awaitable[None]]:  # fmt: skip
    """The daemon's background job: this node's ranks judged as `/v1/status` shows them (the job's
    coordinator's fresh judgement, and this node's own), looked at every CHECK_SECONDS, each
    live verified rank's cause with them (`gpus`: a rank's GPUs' slowing clock-event reasons)."""
    causes = Causes()

    async def run() -> None:
        while True:
            live = [r for r in ranks() if not r.gone]
            judged = stragglers.status(
                node,
                live,
                reporter.lateness if reporter is not None else lambda job_id: None,
                reporter.coordinator if reporter is not None else lambda job_id: None,
                tracker,
            )
            # every live rank's CPU counters, so that a rank named straggler has a cause at once
            seen = {r.key: await asyncio.to_thread(causes.look, r, gpus(r.key)) for r in live if r.peer_verified}
            causes.forget(set(seen))
            await incidents.look(judged, {r.key for r in live}, seen.get)
            await asyncio.sleep(CHECK_SECONDS)

    return run


def with_causes(judgements: list[dict[str, Any]], recent: Iterable[Incident]) -> list[dict[str, Any]]:
    """`/v1/status` `stragglers` with each local straggler's cause, from its open incident."""
    causes: dict[tuple[Any, Any], dict[str, Any]] = {
        (i.job_id, i.blamed_rank): i.straggler for i in recent if isinstance(i, StragglerIncident) and i.ended is None
    }
    for j in judgements:
        for s in j.get("stragglers") or []:
            found = causes.get((j.get("job_id"), s.get("rank")))
            if found is not None:
                s["cause"], s["cause_evidence"] = found.get("cause"), found.get("cause_evidence")
    return judgements
