"""The watchdog's side of the job view (sidecar/jobview/): what a stalled node knows of the
job's other nodes, and what it does about a stall it shares with them.

Every node of a hung job stalls at about the same time: the culprit stops, and every other rank
soon waits for it in a collective. Judged alone, each node would blame one of its own ranks and
kill it. With the job view:

- at SUSPECT, each node probes its suspect ranks' stacks (`Probe`: whether the main thread waits
  in a collective, and its innermost frame) and reports them, so the coordinator can name the
  culprit before anyone's timeout runs out;
- at STALLED, each node dumps its ranks' stacks, says so, and takes the job's verdict (waiting
  at most `job_view.verdict_wait_seconds`) into its incident: the same culprit and job incident
  on every node;
- the culprit's node kills its group once every node has dumped (bounded by the same wait);
- every other node leaves its waiting ranks to torchrun's re-rendezvous and kills them itself
  only if they are still there after `job_view.launcher_grace_seconds`;
- a node that cannot reach its coordinator acts alone, as without the job view.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from sidecar import hang_kinds
from sidecar.incidents.store import Incident
from sidecar.jobview.report import Culprit, NodePart, RankView, Verdict
from trainer_hooks.wire import CRASH_LOOP_EXIT

PART_EVENTS = frozenset(
    {"detected", "dumps_requested", "dumps_received", "verdict", "sigterm", "sigkill", "exit_observed",
     "left_to_launcher", "restarted_by_launcher", "still_running", "held_busy", "resumed_by_itself"}
)  # fmt: skip


@dataclass
class Probe:
    """A rank's stack, looked at while it was suspect or stalled."""

    waiting: bool | None  # its main thread waits in a collective (None: no dump came)
    stack_top: str | None  # its innermost frame
    at: float  # watchdog clock
    frames: tuple[tuple[str, str, int], ...] = ()  # its main thread's (file, function, line), innermost first


class JobView(Protocol):
    """What the watchdog asks of this node's reporter (sidecar/jobview/reporter.py)."""

    def verdict(self, job_id: str) -> Verdict | None: ...

    def coordinator(self, job_id: str) -> tuple[str, str] | None: ...

    def reachable(self, job_id: str) -> bool: ...

    def wake(self, job_id: str) -> None: ...

    async def wait_for(
        self, job_id: str, ready: Callable[[Verdict | None], bool], timeout: float
    ) -> Verdict | None: ...


def has_culprit(v: Verdict | None) -> bool:
    return v is not None and not v.closed and v.culprit is not None


def everyone_dumped(v: Verdict | None) -> bool:
    return v is not None and (v.closed or v.all_dumped)


def open_verdict(job_view: JobView | None, job_id: str) -> Verdict | None:
    """The job's verdict while its job incident is open (None: no job view, no incident, or closed)."""
    verdict = job_view.verdict(job_id) if job_view is not None else None
    return verdict if verdict is not None and not verdict.closed else None


def drill_of(job_view: JobView | None, job_id: str) -> str | None:
    """The drill the job's open verdict names (a node of the job runs `sidecar drill`), if any."""
    verdict = open_verdict(job_view, job_id)
    return verdict.drill if verdict is not None else None


def adopt(incident: Incident, verdict: Verdict | None, node: str) -> None:
    """Take the job's verdict into this node's incident: the job incident id and the culprit
    every node names (this node's own first guess stays in the notes)."""
    if verdict is None:
        return
    incident.job_incident = verdict.job_incident
    incident.event("verdict", job_incident=verdict.job_incident, decided=verdict.decided)
    if verdict.drill is not None and incident.drill is None:  # heard of after this node's stall opened
        incident.drill = verdict.drill
    c = verdict.culprit
    if c is None:
        return
    local_guess = f"rank {incident.blamed_rank}" if incident.blamed_rank is not None else "no local rank"
    if c.rank != incident.blamed_rank or c.node != node:
        incident.notes.append(f"this node alone would have blamed {local_guess} ({incident.blame_reason})")
    incident.blamed_rank = c.rank
    kind = hang_kinds.of(c.kind)
    incident.blamed_node = c.node if kind.names_a_rank or kind.blames == "node" else None  # no one blamed
    incident.blame_reason = c.reason
    incident.hang_kind, incident.evidence, incident.collective = c.kind, c.evidence, c.collective
    incident.culprit = {
        "rank": c.rank, "node": c.node, "step": c.step, "phase": c.phase, "stack_top": c.stack_top, "kind": c.kind,
        "evidence": c.evidence,
    }  # fmt: skip
    if c.kind == "collective_mismatch" and c.collective and c.collective.get("repeat"):
        incident.notes.append("the same collective mismatch as the job's previous incident: a restart repeats it")
    if verdict.lost_nodes:
        incident.notes.append(f"nodes lost during the incident: {', '.join(verdict.lost_nodes)}")
    if verdict.crash_loop and incident.crash_loop is None:
        incident.crash_loop = {"repeats": verdict.repeats, "exit_code": CRASH_LOOP_EXIT}
        incident.notes.append(
            f"a crash loop: the job met this verdict at this step {verdict.repeats} time(s) before; it is ended, "
            f"not restarted again: its ranks are told to exit {CRASH_LOOP_EXIT} (job_view.crash_loop_repeats)"
        )


def before_restart(verdict: Verdict | None, registered: Mapping[int, float]) -> bool:
    """The verdict was decided before the local processes it would act on registered (wall clock,
    `registered`: local rank -> its current process's registration): it judged their processes of
    before a restart, and acting on it would kill new processes for what old ones did. The rank it
    names where it names one here, else every local rank. A coordinator's clock ahead of this node's
    by more than the restart's seconds hides this (the verdict then acts, as before)."""
    c = verdict.culprit if verdict is not None else None
    if verdict is None or c is None or verdict.decided is None or not registered:
        return False
    if c.rank is not None and c.rank in registered:
        return registered[c.rank] > verdict.decided
    return all(at > verdict.decided for at in registered.values())


def local_culprit(
    verdict: Verdict | None, node: str, local_ranks: set[int], registered: Mapping[int, float] | None = None
) -> bool | None:
    """Whether the verdict puts the culprit on this node (None: no culprit in it, or none about the
    local processes of now: `before_restart`)."""
    if verdict is None or verdict.culprit is None or before_restart(verdict, registered or {}):
        return None
    c: Culprit = verdict.culprit
    acts = hang_kinds.of(c.kind).acts
    if acts == "every_node":
        return True  # every node of the job acts on its own ranks (a stuck collective, a desync, a lost node)
    if acts == "nobody":
        return False  # report only (a pause; ranks that exited are torchrun's)
    return c.node == node and (c.rank is None or c.rank in local_ranks)


def part_of(incident: Incident, outcome: str) -> NodePart:
    """This node's part of the job incident, as the coordinator keeps it for the story: with its
    recovery's stages once the watchdog follows them (recovery.py)."""
    events = [{"event": e["event"], "time": e["time"]} for e in incident.timeline if e.get("event") in PART_EVENTS][
        -24:
    ]
    recovery = incident.recovery or {}
    stages = dict(list((recovery.get("stages_seconds") or {}).items())[:15])
    if stages:  # and the whole, which stages it could not see leave out
        stages["hang_to_training"] = recovery.get("hang_to_training_seconds")
    return NodePart(incident=incident.id, outcome=outcome, timeline=events, stages=stages)


def recovery_news(incident: Incident, current: str | None, wall: float, within: float) -> bool:
    """Whether the incident's recovery reached a milestone in the last `within` seconds, with no
    newer job incident open (`current`): its part goes to the coordinator again then, after the job
    incident closed too (the stages after the kill come once the job trains again); a few reports
    carry it, so one lost report loses nothing."""
    if current is not None:
        return False
    milestones = (incident.recovery or {}).get("milestones") or {}
    latest = max((t for t in milestones.values() if isinstance(t, (int, float))), default=None)
    return latest is not None and wall - latest <= within


def rank_view(
    rank: int, local_rank: int, state: str, step: int | None, phase: str | None, age: float, probe: Probe | None,
    exited_at: float | None = None, busy: bool = False,
) -> RankView:  # fmt: skip
    return RankView(
        rank=rank,
        local_rank=local_rank,
        state=state,
        step=step,
        phase=phase,
        progress_age_seconds=round(max(0.0, age), 3),
        waiting=probe.waiting if probe is not None else None,
        stack_top=probe.stack_top if probe is not None else None,
        exited_at=exited_at,
        busy=busy,
    )


def wall_of(clock_value: float, clock: Callable[[], float]) -> float:
    """The wall-clock time of a watchdog clock reading."""
    return time.time() - (clock() - clock_value)


def registered_walls(dog: Any, job_id: str) -> dict[int, float]:
    """Local rank -> the wall clock its current process registered at."""
    return {t.rank.rank: t.rank.registered_wall for t in dog.tracks_of(job_id)}


def current_culprit(dog: Any, job_id: str) -> Callable[[Verdict | None], bool]:
    """A verdict with a culprit decided since the local ranks of now registered (`before_restart`)."""
    return lambda v: has_culprit(v) and not before_restart(v, registered_walls(dog, job_id))


def names_here_now(dog: Any, job_id: str, verdict: Verdict | None, targets: list[Any]) -> bool:
    """The job's open verdict names a hang to act on here, about the local processes of now: not a
    pause, not a rank its node holds busy (episode.leave_to_launcher: a verdict that changed to a
    rank here after this node left its ranks to the launcher)."""
    c = verdict.culprit if verdict is not None and not verdict.closed else None
    if c is None or c.busy:
        return False
    return local_culprit(verdict, dog.node, {t.rank for t in targets}, registered_walls(dog, job_id)) is True


def culprit_here(ep: Any, verdict: Verdict | None, finding: Any, targets: list[Any]) -> bool:
    """Whether an episode's node (episode.py) acts on the job's verdict: its culprit is here. Without
    one in time, this node's own evidence decides (a local rank late or running: its collective
    `finding`, its ranks' stacks), or the coordinator's silence."""
    dog, incident, jv = ep.dog, ep.incident, ep.dog.job_view
    assert jv is not None
    registered = registered_walls(dog, ep.job_id)
    here = local_culprit(verdict, dog.node, {t.rank for t in targets}, registered)
    if here is not None:
        return here
    if before_restart(verdict, registered):
        incident.notes.append(
            "the job's verdict was decided before this node's ranks of now registered (a restart came between): "
            "not acted on; this node's own evidence decides"
        )
    wait = dog.settings.job_view.verdict_wait_seconds
    late_here = finding is not None and finding.culprit is not None
    # not waiting by its stack, and no collective in flight in its record (a CUDA job's waiting rank
    # sits in its own code: its record shows the wait)
    in_flight = {t.rank.rank for t in dog.tracks_of(ep.job_id) if t.rank.collectives and t.rank.collectives.waiting}
    running = [s.rank for s in incident.ranks if s.in_collective is False and s.rank not in in_flight]
    here = late_here or bool(running) or not jv.reachable(ep.job_id)
    incident.notes.append(
        f"no culprit from the job's coordinator within job_view.verdict_wait_seconds ({wait:g}s); "
        + (
            "this node's collective records show a local rank late to its peers' collective"
            if late_here
            else "this node's own stacks show a rank not waiting for its peers"
            if running
            else "the coordinator does not answer"
            if here
            else "every local rank waits in a collective"
        )  # fmt: skip
    )
    return here
