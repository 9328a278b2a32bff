"""The job's coordinator: the sidecar on rank 0's node keeps every node's latest report of the
job (its books: ledger.py), opens one job incident when the first node reports trouble, judges the
culprit (judge.py), and answers every report with the verdict, long-polled so that a node hears of a
change at once and the coordinator serves one outstanding request per node, not a poll storm.

A node that has not reported for `job_view.lost_after_seconds` (or, once an incident is open and a
node stays silent for `job_view.verdict_wait_seconds`, whose sidecar does not answer a probe) is
lost, and named when every rank that still reports waits in a collective. Bounded as its books are
(ledger.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from sidecar import hang_kinds
from sidecar.hang_kinds import OLDEST_PROGRESS as _OLDEST
from sidecar.jobview.collectives import STALE_AFTER_SECONDS
from sidecar.jobview.jobs import (
    REFINED,
    Job,
    JobIncident,
    exit_time,
    is_busy,
    kept_exit,
    later_exit,
    rank_brief,
    repeat_count,
    signature,
    tail_of_pause,
    where,
    who,
)
from sidecar.jobview.judge import judge_summaries, records_said, refine
from sidecar.jobview.ledger import PROBE_SECONDS, CoordinatorError, Ledger, Probe
from sidecar.jobview.report import MAX_NOT_DUMPED, Culprit, NodeReport, Verdict

__all__ = ["CLOSE_AFTER_SECONDS", "Coordinator", "CoordinatorError"]  # CoordinatorError: ledger.py's, named here too

log = logging.getLogger(__name__)

JUDGE_EVERY_SECONDS = 0.05  # a job is judged at most this often, however many nodes report
JUDGE_SHARE = 10  # ... and no sooner than this many times what its last judgement took
CLOSE_AFTER_SECONDS = 1.0  # an incident closes once every node's latest report is untroubled this long


class Coordinator(Ledger):
    """`hosts(job_id)`: the job's world size as its ranks registered here said (0: no rank of it
    here; True: hosted, size unknown). `max_ranks`: the ranks of every job's reports together
    (job_view.max_ranks); a job's own are bounded by its world size."""

    def __init__(
        self,
        hosts: Callable[[str], int | bool],
        lost_after: float,
        verdict_wait: float,
        max_nodes: int,
        probe: Probe | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        stale_after: float = STALE_AFTER_SECONDS,
        max_ranks: int = 16384,
        node: str = "",
        cluster_key: bytes | None = None,  # job_view.cluster_key_file's secret (auth.bind)
        crash_loop_repeats: int = 2,  # job_view.crash_loop_repeats (0: never a crash loop)
    ):
        self.crash_loop_repeats = crash_loop_repeats
        self.stale_after = stale_after  # a collective record this old says its rank's process stopped
        super().__init__(hosts, lost_after, verdict_wait, max_nodes, probe, clock, wall, max_ranks, node, cluster_key)

    # ------------------------------------------------------------ reports

    def accept(self, report: NodeReport) -> Verdict | None:
        """Take one node's report; returns the job's current verdict (None: no incident)."""
        job, now = self._take(report)
        self._update(job, report, now)
        return job.current.verdict if job.current is not None else None

    def _update(self, job: Job, report: NodeReport, now: float) -> None:
        """O(the report's ranks): the judgement, which reads every node, runs at most every
        JUDGE_EVERY_SECONDS per job (tick). Long-polls wake only for what a node acts on: an
        incident opened or closed, a culprit named, a node lost, every node's stacks dumped; a
        node joining the incident or a part recorded does not wake a thousand waiters."""
        changed = False
        if report.drill is not None or (job.drill is not None and job.drill[1] == report.node):
            job.drill = (report.drill, report.node) if report.drill is not None else None
        if report.troubled:
            job.troubled.add(report.node)
        else:
            job.troubled.discard(report.node)
        incident = job.current
        if (incident is None or incident.verdict.closed) and report.troubled:
            incident = job.current = self._open(job)
            changed = True
        for past in (incident, *job.closed) if report.part is not None else ():  # a closed one's: its recovery's stages
            if past is not None and past.verdict.closed and past.verdict.job_incident == report.job_incident:
                if report.node in past.node_set:  # from a node that took part, kept for the story only
                    past.parts[report.node] = report.part
        if incident is None or incident.verdict.closed:
            return
        kept_exit(job, incident, report.node)
        v = incident.verdict
        if v.drill is None and job.drill is not None:  # the drilling node said so: a drill on every node
            v.drill, changed = job.drill[0], True
        dumped_before = v.all_dumped
        if report.node not in incident.node_set:
            incident.node_set.add(report.node)
            incident.order.append(report.node)
        if report.troubled:
            incident.ranks[report.node] = [rank_brief(r) for r in report.ranks]
        if report.dumped == v.job_incident:
            incident.dumped_set.add(report.node)
        v.nodes, v.dumped = len(incident.node_set), len(incident.dumped_set)
        if not v.all_dumped:
            v.not_dumped = sorted(incident.node_set - incident.dumped_set)[:MAX_NOT_DUMPED]
        if report.part is not None and report.job_incident == v.job_incident:
            incident.parts[report.node] = report.part
        changed |= v.all_dumped and not dumped_before
        if changed:
            self._bump(job)
        self._judge_soon(job, now)

    def _judge_soon(self, job: Job, now: float) -> None:
        wait = max(JUDGE_EVERY_SECONDS, JUDGE_SHARE * job.judge_cost) - (now - job.judged_at)
        if wait <= 0:
            self.tick(job.job_id)
            return
        if job.judge_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a direct call): judge now
            self.tick(job.job_id)
            return
        job.judge_pending = True
        loop.call_later(wait, self.tick, job.job_id)

    def _judge(self, job: Job, incident: JobIncident, now: float) -> bool:
        v = incident.verdict
        lost = self.lost(job, now)
        changed = lost != v.lost_nodes
        v.lost_nodes = lost[:64]
        if v.culprit is not None and v.culprit.kind not in REFINED and (v.culprit.rank is not None or not lost):
            s = job.summaries.get(v.culprit.node)
            if s is not None and refine(v.culprit, s):  # the same rank, its kind made specific
                log.warning("job %s (%s): %s: %s", job.job_id, v.job_incident, v.culprit.kind, v.culprit.reason)
                changed = self._repeats(job, incident) or True
            return self._busy_changed(job, v.culprit) or changed
        gone = set(lost)
        fresh = [s for node, s in job.summaries.items() if node not in gone]
        probing = job.probing is not None and not job.probing.done()
        force = now - incident.opened_mono >= self.verdict_wait + PROBE_SECONDS and not probing
        silent = [node for node, (_, at) in job.reports.items() if at < incident.opened_mono]
        offsets = {n: o for n in job.summaries if (o := job.lateness.offset(n)) is not None}
        culprit = judge_summaries(fresh, lost, force, silent, self.stale_after, now, offsets)
        if culprit is not None:
            culprit.busy = is_busy(job, culprit)
        same = (
            culprit is not None
            and v.culprit is not None
            and (who(culprit) == who(v.culprit) or culprit.kind == v.culprit.kind == _OLDEST.name)
        )  # a guess is not swapped for an equal guess: only better evidence changes it
        if v.culprit is not None and culprit is not None and v.culprit.kind == hang_kinds.JOB_PAUSED.name:
            # still the pause; its tail (ranks done wait for the last ones at work: `busy`, which bounds
            # the hold by watchdog.ceiling_seconds on every node) or no one waiting again
            tail = not same and tail_of_pause(job, incident, culprit)
            if culprit.kind == _OLDEST.name:  # a guess never replaces the pause's evidence (its end: steps again)
                return changed
            if tail or same:
                changed |= v.culprit.busy != tail
                v.culprit.busy = tail
                return changed
        if culprit is not None and not same and later_exit(job, incident, culprit):
            return changed  # the first exit stays first: its node moved on (a restart) and no longer lists it
        if culprit is not None and not same:
            if culprit.kind == hang_kinds.RANK_CRASHED.name:
                incident.exit_at = exit_time(job, culprit)
            v.culprit, v.decided = culprit, self.wall()
            self._repeats(job, incident)
            if culprit.kind == "collective_mismatch" and culprit.collective is not None:
                culprit.collective["repeat"] = v.repeats > 0
            incident.paused = incident.paused or culprit.kind == "job_paused"
            log.warning("job %s (%s): %s: %s: %s", job.job_id, v.job_incident, culprit.kind, where(culprit),
                        culprit.reason)  # fmt: skip
            if culprit.evidence != "collectives" and any(s.recorded for s in fresh):
                log.info("job %s: the collective records did not decide it: %s", job.job_id, records_said(fresh, now))
            return True
        return changed

    def _repeats(self, job: Job, incident: JobIncident) -> bool:
        """The verdict met again at the same step (jobs.signature), and whether that makes a crash
        loop: past job_view.crash_loop_repeats repeats the job is ended (every node tells its ranks
        of the attempt to exit CRASH_LOOP_EXIT), not restarted to meet it again. Once said, kept."""
        v = incident.verdict
        if v.culprit is not None and v.drill is None:
            incident.signature = signature(v.culprit, job.step())
        n = repeat_count(job, incident.signature)
        loop = v.crash_loop or (self.crash_loop_repeats > 0 and n >= self.crash_loop_repeats)
        if (n, loop) == (v.repeats, v.crash_loop):
            return False
        if loop and not v.crash_loop and v.culprit is not None:
            log.error("job %s (%s): a crash loop: the same verdict at the same step %d time(s) before (%s): the job "
                      "is ended, not restarted", job.job_id, v.job_incident, n, where(v.culprit))  # fmt: skip
        v.repeats, v.crash_loop = n, loop
        return True

    def _busy_changed(self, job: Job, culprit: Culprit) -> bool:
        """The named rank's node shows it alive, not judged hung (busy, or its CPU time growing while
        judged), or no longer: every node is told; none kills meanwhile (its node judges it, up to the ceiling)."""
        busy = is_busy(job, culprit)
        if busy == culprit.busy:
            return False
        culprit.busy = busy
        log.warning(
            "job %s: rank %s on %s is %s", job.job_id, culprit.rank, culprit.node,
            "alive and not judged hung (its CPU time grows; its node looks at its stack): no node kills meanwhile"
            if busy else "no longer shown alive by its node",
        )  # fmt: skip
        return True

    def _maybe_close(self, job: Job, incident: JobIncident, now: float) -> bool:
        """An incident closes once every node's latest report has been untroubled for
        CLOSE_AFTER_SECONDS (training again; a timer, not a next report: a node that waits on the
        verdict's long poll reports again only when it changes), or when no node reports ranks. A
        crash's at once: its ranks are back, and a crash on the first batch after a restart (a crash
        loop) comes within a second."""
        if any(now - job.reports[node][1] <= self.lost_after for node in job.troubled if node in job.reports):
            incident.untroubled_since = None
            return False
        c = incident.verdict.culprit
        hold = 0.0 if c is not None and c.kind == hang_kinds.RANK_CRASHED.name else CLOSE_AFTER_SECONDS
        if incident.untroubled_since is None:
            incident.untroubled_since = now
            if hold:
                self._tick_later(job, hold)  # no report need come: a node long-polls meanwhile
        if now - incident.untroubled_since < hold:
            return False
        incident.verdict.closed = True
        log.info("job %s: job incident %s closed", job.job_id, incident.verdict.job_incident)
        return True

    def _tick_later(self, job: Job, wait: float) -> None:
        with contextlib.suppress(RuntimeError):  # no loop (a direct call): the next report decides
            asyncio.get_running_loop().call_later(wait, self.tick, job.job_id)

    # ------------------------------------------------------------ waiting, probing

    async def wait_change(self, job_id: str, known: int, timeout: float) -> Verdict | None:
        """The job's verdict once its version differs from `known`, or after `timeout`."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        if job.version == known:
            event = job.changed
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self.tick(job_id)
        return job.current.verdict if job.current is not None else None

    def tick(self, job_id: str) -> None:
        """Judge the job from every node's latest report (after reports, or when time has passed:
        a forced judgement, a lost node), and close its incident once it trains again."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        now = self.clock()
        job.judged_at, job.judge_pending = now, False
        if job.current is None or job.current.verdict.closed:
            return
        started = time.perf_counter()
        if self._judge(job, job.current, now) | self._maybe_close(job, job.current, now):
            self._bump(job)
        job.judge_cost = time.perf_counter() - started
