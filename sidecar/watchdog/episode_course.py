"""How a stall's episode (episode.py) begins and which way it goes, in the order of its life:

    open       blame one rank, open the incident, decide what this node may do about it
    start      which way it goes, as its own task: observed only, with the job view, or alone
    observe    stacks and the verdict, no signal that ends a process
    remediate  alone: dump, hold while a rank here is busy, kill
    coordinate with the job view: dump, the job's verdict (coordination.py), then kill here or
               leave the ranks to the launcher

Each way goes through the steps an `Episode` takes (episode.py: dump, hold, kill or leave to the
launcher, end); the per-rank state machine (machine.py) opens and starts an episode here.
"""

from __future__ import annotations

import asyncio
import logging

from sidecar.host.signals import Target
from sidecar.watchdog import pause
from sidecar.watchdog.attribution import blame
from sidecar.watchdog.coordination import (
    adopt,
    before_restart,
    culprit_here,
    current_culprit,
    drill_of,
    everyone_dumped,
    has_culprit,
    registered_walls,
)
from sidecar.watchdog.episode import Episode, Track, Watch
from sidecar.watchdog.remediation import target_of
from sidecar.watchdog.restarts import NOT_KILLED_NO_RESTART, no_restart_note, no_restart_reasons
from sidecar.watchdog.states import RankState

# The watchdog's log lines keep the one logger name they always had, wherever their code lives.
log = logging.getLogger("sidecar.watchdog.machine")


# ------------------------------------------------------------ open: blame and the incident


def open_episode(dog: Watch, job_id: str, members: list[Track], now: float) -> Episode:
    """Blame one of the job's watched ranks here, open the stall's incident and count it, and
    decide what this node may do: observe only (the node's mode or the job's), nothing when the
    storm cap is reached, no signal to ranks no verified caller registered, no kill that nothing
    would restart."""
    blamed, why = blame([t.rank for t in members], {t.rank.key for t in members if t.state is RankState.STALLED})
    stalled_deadline = dog.deadline(blamed, now) if blamed is not None else None
    observe_only = dog.shadow.observing(t.rank for t in members)  # the node's mode, or the job's own
    # A kill that nothing restarts turns the hang into a failed job: by default, don't.
    no_restart = [] if observe_only else no_restart_reasons(t.rank for t in members)
    spare = bool(no_restart) and not dog.settings.remediation.kill_without_restart
    owner = members[0].rank.owner_uid if members else None
    # Ranks no verified caller registered are never signalled, so their stall spends no slot
    # of the storm cap (a slot another job's real hang may need) and gets no remediation.
    verified = any(t.rank.peer_verified for t in members)
    full = None if observe_only or spare or not verified else dog.storm_cap.allow(owner)
    incident = dog.store.open(
        job_id,
        blamed_rank=blamed.rank if blamed else None,
        blame_reason=why,
        timeout_seconds=stalled_deadline.timeout if stalled_deadline else None,
        observe_only=observe_only,
        ranks=[t.snapshot(dog.deadline(t.rank, now)) for t in members],
    )
    dog.liveness.annotate(incident, [t.rank for t in members])  # the checks that found a rank busy
    if incident.drill is None and (drill := drill_of(dog.job_view, job_id)) is not None:
        incident.drill = drill  # another node of the job drills it: its stall here is the drill's too
        incident.notes.append(f"a drill of the job on another node ({drill}), not a real stall")
    episode = Episode(
        dog, job_id, incident, [t.rank.key for t in members], suppressed=full is not None, why=why,
        observe_only=observe_only, verified=verified, spare=spare, full=full,
    )  # fmt: skip
    if incident.drill is None:  # a drill's stall is counted apart (finish), so no alert fires for it
        dog.counters.stalls[job_id] += 1
    dog.counters.last_incident = incident.time
    dog.goodput.stalled(job_id, incident.time)
    if no_restart:
        incident.notes.append(no_restart_note(no_restart, killing=not spare))
    if observe_only and dog.shadow.observed(job_id, [t.rank for t in members], verified):
        incident.notes.append("observe-only: a would-be kill (sidecar_watchdog_would_kill_total)")
    return episode


# ------------------------------------------------------------ start: which way it goes


def start_episode(ep: Episode, members: list[Track], now: float) -> None:
    """The episode's task (the watchdog keeps ticking meanwhile): `observe` when this node may
    not kill, `coordinate` when the job's coordinator answers, else `remediate` alone."""
    dog, job_id, incident = ep.dog, ep.job_id, ep.incident
    observe_only, suppressed, verified, spare = ep.observe_only, ep.suppressed, ep.verified, ep.spare
    targets = [target_of(t.rank) for t in members]
    if observe_only or suppressed or not verified or spare:
        ep.outcome = (
            "observe_only"
            if observe_only
            else "suppressed"
            if suppressed
            else "unverified"
            if not verified
            else NOT_KILLED_NO_RESTART
        )
        if suppressed:
            incident.notes.append(f"storm cap: {ep.full} reached; not killing")
        elif not verified and not observe_only:
            incident.notes.append(
                "no rank of this job was registered by a verified caller: never signalled, no py-spy, "
                "no storm-cap slot spent"
            )
        log.error(
            "job %s stalled (%s); %s",
            job_id,
            incident.summary,
            "observe-only mode: not killing"
            if observe_only
            else "storm cap reached: not killing"
            if suppressed
            else "registered by unverified callers: not killing"
            if not verified
            else "nothing would restart its ranks: not killing",
        )
        ep.task = asyncio.get_running_loop().create_task(observe(ep, targets), name=f"observe-{job_id}")
        return
    if _coordinated(ep):
        log.error("job %s stalled: %s; asking the job's coordinator who holds it up", job_id, ep.why)
        ep.task = asyncio.get_running_loop().create_task(coordinate(ep, targets), name=f"coordinate-{job_id}")
        return
    log.error("job %s stalled: %s; remediating %d local rank(s)", job_id, ep.why, len(members))
    if not any(dog.liveness.alive(t.rank.key, now) for t in members):
        dog.begin_kill(ep, now)  # else the task holds first (`hold`)
    ep.task = asyncio.get_running_loop().create_task(remediate(ep, targets), name=f"remediate-{job_id}")


def _coordinated(ep: Episode) -> bool:
    """The job's coordinator is known and answers: the stall is handled as the job's."""
    jv = ep.dog.job_view
    return jv is not None and jv.coordinator(ep.job_id) is not None and jv.reachable(ep.job_id)


async def observe(ep: Episode, targets: list[Target]) -> None:
    """Stalls left alive: stacks, the incident (with the job's verdict, when the job view has one),
    the count; no signal that ends a process. Observe-only and storm-capped stalls get py-spy's
    stacks only (it reads memory and never signals); a stall nothing would restart also gets the
    ranks' own dump signal."""
    dog = ep.dog
    try:
        await ep.dump(targets, signal_ranks=ep.outcome == NOT_KILLED_NO_RESTART)
        dog.probes_from(ep.incident)
        ep.stacks_done = True
        if _coordinated(ep):
            assert dog.job_view is not None
            dog.job_view.wake(ep.job_id)
            wait = dog.settings.job_view.verdict_wait_seconds
            adopt(ep.incident, await dog.job_view.wait_for(ep.job_id, has_culprit, wait), dog.node)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("collecting stacks of job %s failed", ep.job_id)
    ep.finish(ep.outcome)


async def remediate(ep: Episode, targets: list[Target]) -> None:
    """Alone (no job view, or its coordinator unknown or silent): dump, then kill unless a busy
    rank here holds the stall until the job progresses again."""
    try:
        await ep.dump(targets)
        await ep.attach_links()
        if pause.locally_paused(ep) and await pause.hold_paused(ep) == "resumed":
            outcome = "resumed"
        else:
            outcome = "resumed" if await ep.hold() else await ep.kill(targets)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # remediation bugs must not take the watchdog down
        log.exception("remediation of job %s failed", ep.job_id)
        ep.incident.notes.append(f"remediation error: {type(e).__name__}: {e}")
        outcome = "failed"
    ep.end(outcome)


async def coordinate(ep: Episode, targets: list[Target]) -> None:
    """A stall the job's other nodes share (module docstring of coordination.py): dump, take
    the verdict, then kill if the culprit is here, else leave the ranks to torchrun."""
    dog, job_id, incident, jv = ep.dog, ep.job_id, ep.incident, ep.dog.job_view
    assert jv is not None  # only coordinated episodes come here
    wait = dog.settings.job_view.verdict_wait_seconds
    try:
        finding = await ep.dump(targets)
        dog.probes_from(incident)
        ep.stacks_done = True
        dog.store.save(incident)
        jv.wake(job_id)
        verdict = await jv.wait_for(job_id, current_culprit(dog, job_id), wait)
        if not before_restart(verdict, registered_walls(dog, job_id)):
            adopt(incident, verdict, dog.node)
        if pause.paused(ep, verdict):  # no one waits: hold, judge again if the pause ends without progress
            if await pause.hold_paused(ep) == "resumed":
                ep.end("resumed")
                return
            verdict = await jv.wait_for(job_id, lambda v: has_culprit(v) and not pause.verdict_paused(v), wait)
            adopt(incident, verdict, dog.node)
        await ep.attach_links()
        here = culprit_here(ep, verdict, finding, targets)
        dog.store.save(incident)
        if here and await ep.hold():
            outcome = "resumed"
        elif here:
            dumped = await jv.wait_for(job_id, everyone_dumped, wait)
            if not everyone_dumped(dumped):
                missing = dumped.not_dumped if dumped is not None else []
                incident.notes.append(
                    f"killing before every node had dumped its stacks (waited {wait:g}s"
                    + (f"; missing: {', '.join(missing[:8])}" if missing else "")
                    + ")"
                )
            outcome = await ep.kill(targets)
        else:
            outcome = await ep.leave_to_launcher(targets)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # coordination bugs must not take the watchdog down
        log.exception("remediation of job %s failed", job_id)
        incident.notes.append(f"remediation error: {type(e).__name__}: {e}")
        outcome = "failed"
    ep.end(outcome)
