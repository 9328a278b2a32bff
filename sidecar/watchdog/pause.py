"""No one waiting, no hang: an episode whose job is paused, not hung (hang_kinds.JOB_PAUSED).

A job whose every troubled rank uses CPU while none waits on another (an evaluation no one
declared, one long op, host-side preparation on every rank) makes no progress, and its ranks'
stacks may look still (one long torch op shows the same innermost frame at every look), but
nothing in it waits on something that cannot come. It is reported (its incident's kind
`job_paused`, the SidecarJobNotProgressing alert past the job-level budget), never killed at the
floor: the episode holds until the ranks step again, or until the pause ends without progress (a
rank starts waiting on another, or stops using CPU: then it is a hang, judged as one). The tail of a
pause (one rank still working when its peers are done and wait on it: the verdict names it busy)
is held the same way on its node, at most `watchdog.ceiling_seconds` from its last progress.

This node's own ranks must say it (`locally_paused`), and the coordinator's verdict, where there is
one, must agree: a rank elsewhere may be the one its peers wait on (judge.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from sidecar import hang_kinds
from sidecar.incidents.store import Incident
from sidecar.jobview.report import Verdict
from sidecar.watchdog.states import RankState


class Episode(Protocol):
    """What of an episode (episode.py) its pause reads: its watchdog, its job and its incident."""

    dog: Any
    job_id: str
    incident: Incident


log = logging.getLogger("sidecar.watchdog.machine")

TROUBLED = (RankState.SUSPECT, RankState.STALLED, RankState.REMEDIATING)


def _waits(t: Any) -> bool:
    """Its stack shows it in a collective, or its record holds one in flight."""
    if t.probe is not None and t.probe.waiting:
        return True
    return t.rank.collectives is not None and t.rank.collectives.waiting


def locally_paused(ep: Episode) -> bool:
    """This node's own evidence: none of the job's ranks here waits, and every troubled one's CPU time grows."""
    dog, now = ep.dog, ep.dog.clock()
    tracks = dog.tracks_of(ep.job_id)
    troubled = [t for t in tracks if t.state in TROUBLED]
    if not troubled or any(_waits(t) for t in tracks):
        return False
    return all(
        dog.liveness.activity(t.rank, now, t.probe.frames if t.probe is not None else ()) == "cpu" for t in troubled
    )


def verdict_paused(verdict: Verdict | None) -> bool | None:
    """The job's verdict on it: True paused, False a hang, None no verdict with a culprit (yet)."""
    if verdict is None or verdict.closed or verdict.culprit is None:
        return None
    c = verdict.culprit
    if c.busy and c.kind in (hang_kinds.RANK_LATE.name, hang_kinds.RANK_SPINNING.name):
        return True  # a rank still working while its peers wait: its node holds, as for a pause (`busy`)
    return c.kind in hang_kinds.REPORT_ONLY and c.kind != hang_kinds.RANK_CRASHED.name


def paused(ep: Episode, verdict: Verdict | None) -> bool:
    """Paused: this node's own ranks say so, and the job's verdict, where it has one, agrees (a
    verdict alone never holds a node whose ranks wait or stopped working: docs/security.md)."""
    return verdict_paused(verdict) is not False and locally_paused(ep)


async def hold_paused(ep: Episode) -> str | None:
    """Hold the paused job's episode: "resumed" once none of its ranks here is stalled, None once the
    pause ended without progress (now a hang: the caller judges and acts as for one)."""
    dog, incident, interval = ep.dog, ep.incident, ep.dog.settings.watchdog.check_interval_seconds
    jv = dog.job_view
    started = dog.clock()
    if incident.hang_kind != hang_kinds.JOB_PAUSED.name:  # no verdict says so: this node's own evidence
        incident.hang_kind, incident.evidence = hang_kinds.JOB_PAUSED.name, "stacks"
        incident.blamed_rank, incident.blamed_node = None, None
        incident.blame_reason = "no rank of the job here waits on another and every troubled one uses CPU"
    incident.event("paused")
    incident.notes.append("paused, not hung: no rank waits on another and every troubled rank uses CPU; not killed")
    dog.store.save(incident)
    log.warning("job %s: paused, not hung (no rank waits on another, every troubled rank uses CPU): not killed",
                ep.job_id)  # fmt: skip
    while True:
        await asyncio.sleep(interval)
        mine = [t for t in dog.tracks_of(ep.job_id) if t.episode is ep]
        if not any(t.state in (RankState.STALLED, RankState.REMEDIATING) for t in mine):
            held = dog.clock() - started
            incident.event("resumed_by_itself", held_seconds=round(held, 3))
            incident.notes.append(f"the job stepped again {held:.1f}s into the pause")
            log.warning("job %s: progressing again after a pause of %.1fs; not killed", ep.job_id, held)
            return "resumed"
        verdict = jv.verdict(ep.job_id) if jv is not None else None
        waited_on = verdict is not None and verdict.culprit is not None and verdict.culprit.busy
        ceiling = dog.settings.watchdog.ceiling_seconds  # a rank its peers wait on is held this long at most
        if not paused(ep, verdict) or (waited_on and max(dog.deadline(t.rank).age for t in mine) >= ceiling):
            incident.event("pause_ended", held_seconds=round(dog.clock() - started, 3))
            incident.notes.append("the pause ended without progress: a rank now waits on another, or stopped using CPU")
            log.warning("job %s: the pause ended without progress: judged as a hang", ep.job_id)
            return None
