"""A crash loop, ended on purpose: this node's side.

A job whose restarts meet the same verdict at the same step (the same rank hung or crashed there,
the same desync: jobs.signature) is not restarted until torchrun's restarts run out. Its
coordinator says so in the verdict (`crash_loop`, past job_view.crash_loop_repeats repeats); every
node that takes that verdict marks the job here, and its ranks' hooks are told, in the answer to
their next push or registration, to exit CRASH_LOOP_EXIT (93). `python -m trainer_hooks.launch`
then stops restarting and exits 93 itself: a status a scheduler reads as "do not requeue" (Slurm's
RequeueExit leaves it out, a Kubernetes Job's podFailurePolicy FailJob on it; docs/slurm.md,
docs/kubernetes.md), as NVRx's launchers exit 93 after 3 cycles without progress.

Only the sidecar the hooks talk to tells them (its socket is root's), only for the job whose
verdict it took from the job's own coordinator (whose reports are signed with the job's key), and
never a rank that asked to be observed only. A fresh launch of the same job id starts over: the
user fixed something, or the scheduler was told to run it again. Fresh means restart 0 *and* a
launcher (the rank's parent process: torchrun's agent, or its forkserver) this node has not seen
start the job's ranks: torch's agent restarts a group for a membership change (another node's
agent re-joining) without counting it, so a rank of the ended job comes back with restart 0 from
the same agent. A rank whose parent cannot be read (an unverified TCP caller) is taken as fresh.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric

from sidecar.jobview.jobs import where
from sidecar.jobview.report import Verdict
from sidecar.metric import spec
from sidecar.ranks.model import Rank
from trainer_hooks.wire import CRASH_LOOP_EXIT

log = logging.getLogger("sidecar.jobview.crashloop")

MAX_ENDED = 1024  # jobs marked on one node at most
MAX_LAUNCHERS = 8  # launchers remembered per job (a node runs one agent per job; a relaunch adds one)
KEPT_SECONDS = 3600.0  # a mark's life (a fresh launch lifts it sooner): the alert pages, then resolves

CRASH_LOOP = spec(
    "daemon",
    "job_crash_loop",
    "gauge",
    "1 while a job with ranks on this node is ended for a crash loop: the same verdict at the same step came back "
    "job_view.crash_loop_repeats times after its first, and its ranks are told to exit 93 instead of being "
    "restarted again (the SidecarJobCrashLoop alert). An hour later, or at a fresh launch of the job, it goes.",
    ["job_id"],
)


@dataclass
class Ended:
    job_incident: str
    repeats: int  # the earlier incidents of the same verdict
    reason: str  # the verdict, in words
    since: float  # wall clock of the mark

    def to_wire(self) -> dict[str, Any]:
        return {
            "exit_code": CRASH_LOOP_EXIT,
            "job_incident": self.job_incident,
            "reason": f"a crash loop: {self.reason}, met {self.repeats + 1} times at the same step",
        }


class CrashLoops:
    """The jobs this node ended for a crash loop, from the verdicts it took."""

    def __init__(self, clock=time.time) -> None:
        self.clock = clock
        self._ended: dict[str, Ended] = {}
        self._launchers: OrderedDict[str, list[tuple[int, float]]] = OrderedDict()  # job -> parents seen

    def see(self, verdict: Verdict) -> None:
        """Every verdict this node takes (jobview/reporter.py): a crash loop marks its job."""
        if not verdict.crash_loop or verdict.culprit is None or verdict.drill is not None:
            return
        known = self._ended.get(verdict.job_id)
        if known is not None and known.job_incident == verdict.job_incident:
            return
        c = verdict.culprit
        reason = f"{c.kind} ({where(c)}{f', its last step {c.step}' if c.step is not None else ''})"
        self._ended.pop(verdict.job_id, None)
        self._ended[verdict.job_id] = Ended(verdict.job_incident, verdict.repeats, reason, self.clock())
        while len(self._ended) > MAX_ENDED:  # the oldest marks go first (its jobs long restarted or gone)
            del self._ended[next(iter(self._ended))]
        log.error(
            "job %s: a crash loop (%s, met %d times at the same step; job incident %s): its ranks here are told to "
            "exit %d, the job is not restarted again", verdict.job_id, reason, verdict.repeats + 1,
            verdict.job_incident, CRASH_LOOP_EXIT,
        )  # fmt: skip

    def registered(self, rank: Rank, launcher: tuple[int, float] | None) -> None:
        """A rank registered here, `launcher` its parent process (pid, start time; None: unknown).
        A rank of a fresh launch of a job marked ended lifts the mark."""
        seen = self._launchers.setdefault(rank.job_id, [])
        self._launchers.move_to_end(rank.job_id)
        fresh = rank.restart_count == 0 and (launcher is None or launcher not in seen)
        if launcher is not None and launcher not in seen:
            seen.append(launcher)
            del seen[:-MAX_LAUNCHERS]
        while len(self._launchers) > MAX_ENDED:
            self._launchers.popitem(last=False)
        if fresh and self._ended.pop(rank.job_id, None) is not None:
            log.warning("job %s: a fresh launch (restart 0, new launcher): its crash-loop mark is lifted", rank.job_id)

    def _expire(self) -> None:
        now = self.clock()
        for job_id in [j for j, e in self._ended.items() if now - e.since > KEPT_SECONDS]:
            del self._ended[job_id]

    def end_for(self, rank: Rank, observe_only: bool) -> dict[str, Any] | None:
        """What the rank's hooks are told to do (`end` in the answer to its push), or None."""
        ended = self.ended(rank.job_id)
        if ended is None or observe_only or rank.observe_only:
            return None
        return ended.to_wire()

    def ended(self, job_id: str) -> Ended | None:
        if job_id in self._ended:
            self._expire()
        return self._ended.get(job_id)

    def families(self) -> list[Metric]:
        self._expire()
        family = CRASH_LOOP.family()
        for job_id in self._ended:
            family.add_metric([job_id], 1)
        return [family]

    def status(self) -> dict[str, dict[str, Any]]:
        self._expire()
        return {job_id: {**e.to_wire(), "since": e.since} for job_id, e in self._ended.items()}
