"""The coordinator's books (coordinator.py judges from them): every job's per-node report windows
(each node's latest report, its summary, when it came), the job's key and owner (auth.py), the
bounds a report must fit (the job's world size, `job_view.max_nodes`, `job_view.max_ranks` shared
fairly between owners and jobs: budget.py), the job incident's id and version, the probes of nodes
gone silent, and the story of each incident as the nodes told it.

Bounded: reports only for jobs with a rank registered on this node (`hosts`), at most
`job_view.max_nodes` nodes per job, and a few closed incidents kept per job for their story.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sidecar.jobview import auth, budget
from sidecar.jobview.golive import JobGoLive
from sidecar.jobview.jobs import Job, JobIncident
from sidecar.jobview.judge import summarize
from sidecar.jobview.report import NodeReport, Verdict
from sidecar.jobview.stragglers import JobLateness

# The coordinator's log lines keep the one logger name they always had, wherever their code lives.
log = logging.getLogger("sidecar.jobview.coordinator")

PROBE_SECONDS = 1.0  # how long a probe of a silent node's sidecar may take
FORGET_AFTER_SECONDS = 600.0  # a node silent this long is no longer part of the job


class CoordinatorError(Exception):
    """A report the coordinator refuses; `status` and `code` map onto the API's error body."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


Probe = Callable[[str], Awaitable[bool]]  # url -> whether a sidecar answers there


class Ledger:
    """What the job's coordinator holds (coordinator.py's `Coordinator` judges from it). `hosts`,
    `max_ranks`: as the coordinator's."""

    def __init__(
        self,
        hosts: Callable[[str], int | bool],
        lost_after: float,
        verdict_wait: float,
        max_nodes: int,
        probe: Probe | None,
        clock: Callable[[], float],
        wall: Callable[[], float],
        max_ranks: int,
        node: str,
        cluster_key: bytes | None,
    ):
        self.hosts, self.lost_after, self.verdict_wait = hosts, lost_after, verdict_wait
        self.max_nodes, self.probe, self.clock, self.wall = max_nodes, probe, clock, wall
        self.max_ranks, self.node, self.cluster_key = max_ranks, node, cluster_key
        self._jobs: dict[str, Job] = {}
        self._keys: dict[str, auth.JobKey] = {}
        self.reports_total = 0
        self.ranks_held = 0  # ranks in every job's latest reports
        self.forgotten = 0  # jobs forgotten (no rank of them registered here any more)

    # ------------------------------------------------------------ keys

    def key_for(self, job_id: str, owner: int | None) -> str:
        """The job's key, for the job view offer of its verified rank registering here: made once
        per job and owner (a job_id that passed to another uid gets a new one)."""
        entry = self._keys.get(job_id)
        if entry is None or entry.owner != owner:
            key = auth.new_key()
            entry = self._keys[job_id] = auth.JobKey(
                owner, auth.Verifier(auth.bind(key, self.cluster_key), self.node), key
            )
        return entry.offered

    def owner(self, job_id: str) -> int | None:
        return entry.owner if (entry := self._keys.get(job_id)) is not None else None

    def verifier(self, job_id: str) -> auth.Verifier | None:
        """Checks the job's peer requests; None when no verified rank of it registered here."""
        entry = self._keys.get(job_id)
        return entry.verifier if entry is not None else None

    def sweep(self) -> None:
        """Forget every job this node no longer hosts (`hosts`: no rank of it here for a while):
        its reports, incidents and key (round 3, row 2: a job's state used to stay for ever)."""
        for job_id in list(self._keys.keys() | self._jobs.keys()):
            if self.hosts(job_id):
                continue
            self._keys.pop(job_id, None)
            if job_id in self._jobs:
                self.forget_job(job_id)
                self.forgotten += 1
                log.info("job %s: forgotten (no rank of it registered here any more)", job_id)

    # ------------------------------------------------------------ reports

    def _take(self, report: NodeReport) -> tuple[Job, float]:
        """Keep one node's report in its job's books, within their bounds (the judgement is the
        coordinator's); returns the job and when it came."""
        world = self.hosts(report.job_id)
        if not world:
            raise CoordinatorError(
                404, "not_coordinator", f"job_id: no rank of job {report.job_id!r} is registered on this node"
            )
        size = None if world is True else int(world)
        job = self._jobs.get(report.job_id)
        if job is None:
            job = self._jobs[report.job_id] = Job(report.job_id)
        now = self.clock()
        self._bound(job, report, size, now)
        held = len(report.ranks) - job.held_by(report.node)
        job.ranks_held += held
        self.ranks_held += held
        job.reports[report.node] = (report, now)
        job.summaries[report.node] = summarize(report, received=now)
        job.unreachable.discard(report.node)
        self.reports_total += 1
        wall, bound = self.wall(), size or self.max_ranks
        job.lateness.take(report.node, report.time, wall, report.lateness, now, bound, report.rtt)
        job.golive.take(report.node, report.golive, size or report.world_size, now)
        if job.lateness.judge(now, self.wall(), self.node):
            job.stragglers_logged = job.lateness.log_changes(job.job_id, self.node, job.stragglers_logged)
        return job, now

    def lateness(self, job_id: str, node: str) -> JobLateness | None:
        """The job's lateness as `node` is told it, in the answer to its report (None: not judged)."""
        job = self._jobs.get(job_id)
        return job.lateness.answer(node) if job is not None else None

    def golive(self, job_id: str) -> JobGoLive | None:
        """The job's go-live checks over every node, in the answer to each report (None: none yet)."""
        job = self._jobs.get(job_id)
        return job.golive.answer(self.clock(), self.wall(), self.lost_after) if job is not None else None

    def _bound(self, job: Job, report: NodeReport, size: int | None, now: float) -> None:
        """Refuse a report past the job's world size or the coordinator's bounds (round 3, rows 1
        and 13: invented nodes of 1,024 ranks each grew one sidecar until the OOM killer came)."""
        name = f"job {report.job_id}"
        if size is not None and any(r.rank >= size for r in report.ranks):
            raise CoordinatorError(400, "bad_field", f"ranks: {name} has {size} ranks (its world size here)")
        nodes = self.max_nodes if size is None else min(self.max_nodes, size)
        more = len(report.ranks) - job.held_by(report.node)
        within = (
            (report.node in job.reports or len(job.reports) < nodes)
            and (size is None or job.ranks_held + more <= size)
            and self.ranks_held + more <= self.max_ranks
        )
        if within:
            return
        self._forget_silent(job, now)
        more = len(report.ranks) - job.held_by(report.node)
        if report.node not in job.reports and len(job.reports) >= nodes:
            why = f"job_view.max_nodes ({self.max_nodes})" if nodes == self.max_nodes else f"its world size ({size})"
            raise CoordinatorError(429, "limit_exceeded", f"{name}: {nodes} nodes reported already, {why}")
        if size is not None and job.ranks_held + more > size:
            raise CoordinatorError(
                429, "limit_exceeded", f"{name}: its nodes' reports would hold more ranks than its world size ({size})"
            )
        if self.ranks_held + more > self.max_ranks:  # shared fairly between owners and jobs (budget.py)
            owner_of = {j: k.owner for j, k in self._keys.items()}
            held = [budget.Holding(j.job_id, owner_of.get(j.job_id), j.ranks_held) for j in self._jobs.values()]
            victims = budget.make_room(held, job.job_id, owner_of.get(job.job_id), more, self.max_ranks)
            if victims is None:
                raise CoordinatorError(429, "limit_exceeded", f"job_view.max_ranks ({self.max_ranks}): {name} "
                                       "would hold more than its fair part of the ranks reported here")  # fmt: skip
            for victim, ranks in victims:  # its largest nodes' reports go; they come again, within its part
                drop = budget.largest_first(
                    {n: self._jobs[victim].held_by(n) for n in self._jobs[victim].reports}, ranks
                )
                log.warning(
                    "job %s: %d node reports dropped: over its fair part of job_view.max_ranks", victim, len(drop)
                )
                for node in drop:
                    self._drop_node(self._jobs[victim], node)

    def _open(self, job: Job) -> JobIncident:
        job.close_current()
        wall = self.wall()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(wall)) + f".{int(wall % 1 * 1000):03d}Z"
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", job.job_id)[:60] or "job"
        incident = JobIncident(
            Verdict(job.job_id, f"{stamp}-{name}-{secrets.token_hex(3)}", 0, wall), opened_mono=self.clock()
        )
        log.warning("job %s: job incident %s opened", job.job_id, incident.verdict.job_incident)
        self._start_probes(job)
        return incident

    def lost(self, job: Job, now: float) -> list[str]:
        """Nodes of the job gone silent past lost_after, or whose sidecar did not answer a probe."""
        late = {node for node, (_, at) in job.reports.items() if now - at > self.lost_after}
        return sorted(late | (job.unreachable & set(job.reports)))

    def _bump(self, job: Job) -> None:
        job.version += 1
        if job.current is not None:
            job.current.verdict.version = job.version
        job.changed.set()
        job.changed = asyncio.Event()

    def _forget_silent(self, job: Job, now: float) -> None:
        for node in [n for n, (_, at) in job.reports.items() if now - at > FORGET_AFTER_SECONDS]:
            self._drop_node(job, node)

    def _drop_node(self, job: Job, node: str) -> None:
        held = job.held_by(node)
        job.ranks_held -= held
        self.ranks_held -= held
        del job.reports[node]
        job.summaries.pop(node, None)
        job.troubled.discard(node)
        job.lateness.forget_node(node)
        job.golive.forget_node(node)

    # ------------------------------------------------------------ probing

    def tick(self, job_id: str) -> None:
        """Judge the job again (coordinator.py): a probe's answer may have lost a node."""
        raise NotImplementedError

    def _start_probes(self, job: Job) -> None:
        if self.probe is None or (job.probing is not None and not job.probing.done()):
            return
        try:
            job.probing = asyncio.get_running_loop().create_task(self._probe_silent(job), name=f"probe-{job.job_id}")
        except RuntimeError:  # no loop (tests calling accept() directly)
            job.probing = None

    async def _probe_silent(self, job: Job) -> None:
        """Once an incident is open: nodes that have not reported within verdict_wait are asked
        whether their sidecar is there; one that does not answer is lost."""
        await asyncio.sleep(self.verdict_wait)
        incident = job.current
        if incident is None or incident.verdict.closed or self.probe is None:
            return
        opened = incident.opened_mono
        silent = [(node, r.url) for node, (r, at) in job.reports.items() if at < opened and r.url]
        results = await asyncio.gather(*(self.probe(url) for _, url in silent[:64]), return_exceptions=True)
        for (node, _), answered in zip(silent[:64], results, strict=True):
            if answered is not True and job.reports.get(node, (None, 0.0))[1] < opened:
                job.unreachable.add(node)
        self.tick(job.job_id)

    # ------------------------------------------------------------ reading

    def verdict(self, job_id: str) -> Verdict | None:
        job = self._jobs.get(job_id)
        return job.current.verdict if job is not None and job.current is not None else None

    def story(self, job_id: str, job_incident: str | None = None) -> dict[str, Any] | None:
        """The job incident's story: the verdict, each node's part and its ranks' stack tops, one
        timeline (every node's events, by time). The latest incident when none is named."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        incidents = [*job.closed, *([job.current] if job.current is not None else [])]
        chosen = next(
            (i for i in reversed(incidents) if job_incident in (None, i.verdict.job_incident)),
            None,
        )
        if chosen is None:
            return None
        timeline = sorted(
            ({**e, "node": node} for node, part in chosen.parts.items() for e in part.timeline),
            key=lambda e: e["time"],
        )
        return {
            "verdict": chosen.verdict.to_wire(),
            "nodes": {
                node: {
                    "part": (  # with its recovery's seconds per stage, once known
                        {"incident": p.incident, "outcome": p.outcome, "stages": dict(p.stages)}
                        if (p := chosen.parts.get(node)) is not None
                        else None
                    ),
                    "ranks": chosen.ranks.get(node, []),
                }
                for node in chosen.order
            },
            "timeline": timeline,
        }

    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    def forget_job(self, job_id: str) -> None:
        job = self._jobs.pop(job_id, None)
        if job is None:
            return
        self.ranks_held -= job.ranks_held
        if job.probing is not None:
            job.probing.cancel()
        job.changed.set()  # long-polls of it answer now
