"""The reporting side of the job view: for every local job whose coordinator is known, this
node's picture of the job (`source`, the watchdog's) goes to the coordinator every
`job_view.report_interval_seconds`, at once when something changes (a rank turns suspect, a probe
tells who waits, the stacks are dumped, an incident is recorded), and while the job is troubled a
long-poll brings every new verdict as soon as the coordinator has it. When this node is the
coordinator the calls stay in-process.

What a peer may do with it: the coordinator's address is a rank's claim (rank 0's hooks put it in
the job's store, with the job's key), so a report may reach a host a user chose. The report holds
only that job's picture, signed with that job's key, and the answer must be signed back with it
(auth.py); the key is the job's own, so a host the job's owner chose learns nothing it could use
for another job. A verdict changes what this node *records* and how long it waits before killing
its own ranks, never which processes it may signal (docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from sidecar.config import check_url
from sidecar.jobview import auth
from sidecar.jobview import golive as job_golive
from sidecar.jobview.coordinator import Coordinator, CoordinatorError
from sidecar.jobview.golive import JobGoLive
from sidecar.jobview.report import NodeReport, Verdict, parse_verdict
from sidecar.jobview.stragglers import JobLateness, Sent, parse_answer
from sidecar.ranks.golive import JobFigures
from sidecar.ranks.protocol import ProtocolError

log = logging.getLogger(__name__)

TROUBLED_POLL_SECONDS = 1.0  # a long-poll's wait while the job is troubled
GONE_JOB_SECONDS = 120.0  # a job with no local rank for this long is no longer reported
MAX_ANSWER_BYTES = 256 * 1024
LATENESS_FRESH_SECONDS = 45.0  # a lateness judgement older than this is not shown (3 entry slots + a report)


@dataclass
class _Link:
    """One local job's coordinator and what it last said."""

    url: str
    node: str
    key: str | None  # the job's key (auth.py); None only for this node's own coordinator
    verdict: Verdict | None = None
    last_ok: float | None = None  # monotonic, the last answered request
    failures: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    absent_since: float | None = None  # monotonic: no local rank of the job since
    lateness: JobLateness | None = None  # the job's lateness as the coordinator last judged it (stragglers.py)
    sent: Sent = field(default_factory=Sent)  # the entry times it took
    golive: JobGoLive | None = None  # the job's go-live checks as the coordinator last judged them (golive.py)
    golive_at: float = 0.0  # monotonic: when that answer came
    golive_sent: job_golive.Sent = field(default_factory=job_golive.Sent)  # the figures it took
    rtt: float | None = None  # the last report's round trip (seconds), when it was answered


class Reporter:
    def __init__(
        self,
        node: str,
        own_url: str,
        report_interval: float,
        source: Callable[[str], NodeReport | None],
        local: Coordinator | None = None,
        request_timeout: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        golive: Callable[[str], JobFigures | None] | None = None,
        cluster_key: bytes | None = None,  # job_view.cluster_key_file's secret: signs with auth.bind's key
    ):
        self.cluster_key = cluster_key
        self.node, self.own_url = node, own_url
        self.report_interval, self.source, self.local = report_interval, source, local
        self.request_timeout, self.clock = request_timeout, clock
        self.figures = golive  # a job's figures for its go-live checks (sidecar/ranks/golive.py)
        self.figures_failed = 0
        self._links: dict[str, _Link] = {}
        self._changed = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._running = False
        self.sent = 0  # reports sent (HTTP or in-process)
        self.bytes_sent = 0  # their JSON bodies
        self.refused_urls = 0  # coordinator addresses refused (check_url, no job key)
        self.on_verdict: Callable[[Verdict], None] | None = None  # every new verdict taken (crashloop.py)
        self.foreign_verdicts = 0  # verdicts of another job than the one asked about: ignored

    # ------------------------------------------------------------ inputs

    def set_coordinator(self, job_id: str, url: str, node: str, key: str | None) -> bool:
        """A local rank says where its job's coordinator is, with the job's key; False when the
        address is refused (or another node's coordinator comes without a key: hooks older than
        wire protocol 6)."""
        why = check_url(url)
        if why is None and not self._is_local(_Link(url.rstrip("/"), node, key)) and not auth.valid_key(key):
            why = "no job key to sign reports with (the job's hooks predate wire protocol 6)"
        if why is not None:
            self.refused_urls += 1
            log.warning("job %s: coordinator address %r refused: %s", job_id, url[:80], why)
            return False
        url = url.rstrip("/")
        link = self._links.get(job_id)
        if link is not None and (link.url, link.node, link.key) == (url, node, key):
            return True
        if link is not None and link.task is not None:
            link.task.cancel()
        self._links[job_id] = _Link(url, node, key)
        log.info("job %s: coordinator is %s (%s)", job_id, node, url)
        if self._running:
            self._start(job_id)
        return True

    def wake(self, job_id: str) -> None:
        link = self._links.get(job_id)
        if link is not None:
            link.wake.set()

    # ------------------------------------------------------------ reading

    def verdict(self, job_id: str) -> Verdict | None:
        link = self._links.get(job_id)
        return link.verdict if link is not None else None

    def coordinator(self, job_id: str) -> tuple[str, str] | None:
        """(node, url) of the job's coordinator, when known."""
        link = self._links.get(job_id)
        return (link.node, link.url) if link is not None else None

    def reachable(self, job_id: str) -> bool:
        """The coordinator answered recently (in-process: always)."""
        link = self._links.get(job_id)
        if link is None:
            return False
        if self._is_local(link):
            return True
        return link.last_ok is not None and self.clock() - link.last_ok <= 2 * self.report_interval + 1.0

    async def wait_for(self, job_id: str, ready: Callable[[Verdict | None], bool], timeout: float) -> Verdict | None:
        """The job's verdict once `ready(verdict)`, or whatever it is after `timeout`."""
        deadline = self.clock() + timeout
        while True:
            verdict = self.verdict(job_id)
            left = deadline - self.clock()
            if ready(verdict) or left <= 0:
                return verdict
            self.wake(job_id)
            event = self._changed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), min(left, 0.5))

    def lateness(self, job_id: str) -> tuple[JobLateness, float] | None:
        """The job's lateness as its coordinator judged it, and how old that judgement is (seconds,
        on the coordinator's clock by this node's offset estimate); None when none or stale."""
        link = self._links.get(job_id)
        if link is None or link.lateness is None:
            return None
        judged = link.lateness
        age = max(0.0, time.time() - (judged.clock_offset or 0.0) - judged.time)
        return (judged, age) if age <= LATENESS_FRESH_SECONDS else None

    def clock_offset(self, job_id: str) -> dict[str, float]:
        """A push answer's `clock_offset`: this node's clock - the job's coordinator's, once the
        coordinator has said it (the hooks then read their collective entries in the coordinator's
        wall-clock slots, so ranks on nodes whose clocks differ read the same collectives); else {}."""
        link = self._links.get(job_id)
        offset = None if link is None or link.lateness is None else link.lateness.clock_offset
        return {} if offset is None else {"clock_offset": round(offset, 6)}

    def lateness_of(self, job_id: str) -> dict[int, float] | None:
        """This node's ranks of the job -> their lateness judged over the whole job (None: no fresh
        judgement; the metric then shows this node's own)."""
        got = self.lateness(job_id)
        return got[0].ranks if got is not None else None

    def golive(self, job_id: str) -> tuple[JobGoLive, float] | None:
        """The job's go-live checks as its coordinator judged them over every node, and how old that
        judgement is (seconds); None when none or stale (older than golive.FRESH_SECONDS)."""
        link = self._links.get(job_id)
        if link is None or link.golive is None:
            return None
        age = job_golive.age_now(link.golive, link.golive_at, self.clock)
        return (link.golive, age) if age <= job_golive.FRESH_SECONDS else None

    def status(self) -> dict:
        out = {}
        for job, link in sorted(self._links.items()):
            got = self.lateness(job)
            out[job] = {
                "coordinator": link.node,
                "url": link.url,
                "reachable": self.reachable(job),
                "verdict": link.verdict.to_wire() if link.verdict is not None else None,
                "lateness": {**got[0].to_wire(), "age_seconds": round(got[1], 3)} if got is not None else None,
            }
        return out

    # ------------------------------------------------------------ the loops

    async def run(self) -> None:
        self._running = True
        try:
            for job_id in list(self._links):
                self._start(job_id)
            while True:
                await asyncio.sleep(self.report_interval)
                if self.local is not None:
                    self.local.sweep()
                for job_id, link in list(self._links.items()):
                    if link.task is None or link.task.done():
                        self._start(job_id)
        finally:
            self._running = False
            tasks = [link.task for link in self._links.values() if link.task is not None]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._session is not None:
                await self._session.close()
                self._session = None

    def _start(self, job_id: str) -> None:
        link = self._links[job_id]
        link.task = asyncio.get_running_loop().create_task(self._job_loop(job_id, link), name=f"report-{job_id}")

    async def _job_loop(self, job_id: str, link: _Link) -> None:
        while self._links.get(job_id) is link:
            report = self.source(job_id)
            now = self.clock()
            if report is None:
                link.absent_since = link.absent_since or now
                if now - link.absent_since > GONE_JOB_SECONDS:
                    del self._links[job_id]
                    return
                await self._sleep(link, self.report_interval)
                continue
            link.absent_since = None
            report.node, report.url, report.rtt = self.node, self.own_url, link.rtt
            if not report.troubled and (link.verdict is None or link.verdict.closed):
                report.healthy, report.ranks = len(report.ranks), []  # a heartbeat: the coordinator needs no more
            report.lateness = link.sent.due(report.lateness)  # only entries that moved since it took them
            report.golive = link.golive_sent.due(self._figures(job_id), now)  # when changed (or every minute)
            link.wake.clear()
            try:
                verdict, judged, checks = await self._exchange(link, report)
                self._take(job_id, link, verdict)
                link.sent.taken(report.lateness)
                link.golive_sent.taken(report.golive, now)
                link.lateness = judged or link.lateness
                if checks is not None:
                    link.golive, link.golive_at = checks, self.clock()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                link.failures += 1
                if link.failures in (1, 10) or link.failures % 100 == 0:
                    log.warning("job %s: coordinator %s did not take the report: %s", job_id, link.node, e)
                await self._sleep(link, min(self.report_interval, 1.0 * link.failures))
                continue
            troubled = report.troubled or (link.verdict is not None and not link.verdict.closed)
            if troubled:
                await self._long_poll(job_id, link)
            else:
                await self._sleep(link, self.report_interval)

    def _figures(self, job_id: str) -> JobFigures | None:
        """The job's go-live figures; a failure to read them never holds up a report."""
        try:
            return self.figures(job_id) if self.figures is not None else None
        except Exception:
            self.figures_failed += 1
            if self.figures_failed in (1, 100) or self.figures_failed % 10_000 == 0:
                log.exception("job %s: go-live figures not read (%d times)", job_id, self.figures_failed)
            return None

    async def _sleep(self, link: _Link, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(link.wake.wait(), seconds)

    async def _long_poll(self, job_id: str, link: _Link) -> None:
        """Until the verdict changes, this node has something new to say, or a short while."""
        known = link.verdict.version if link.verdict is not None else -1
        poll = asyncio.ensure_future(self._fetch_verdict(link, job_id, known, TROUBLED_POLL_SECONDS))
        woken = asyncio.ensure_future(link.wake.wait())
        try:
            done, _ = await asyncio.wait({poll, woken}, timeout=TROUBLED_POLL_SECONDS + self.request_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            if poll in done and poll.exception() is None:
                self._take(job_id, link, poll.result())
        finally:
            for t in (poll, woken):
                t.cancel()
            await asyncio.gather(poll, woken, return_exceptions=True)

    def _take(self, job_id: str, link: _Link, verdict: Verdict | None) -> None:
        link.last_ok, link.failures = self.clock(), 0
        if verdict is not None and verdict.job_id != job_id:  # a coordinator answers for its own job only
            self.foreign_verdicts += 1
            if self.foreign_verdicts in (1, 100) or self.foreign_verdicts % 10_000 == 0:
                log.warning("job %s: coordinator %s answered a verdict of job %r: ignored (%d times)", job_id,
                            link.node, verdict.job_id[:80], self.foreign_verdicts)  # fmt: skip
            return
        if verdict is not None and (link.verdict is None or verdict.version != link.verdict.version
                                    or verdict.job_incident != link.verdict.job_incident):  # fmt: skip
            link.verdict = verdict
            if self.on_verdict is not None:
                self.on_verdict(verdict)
            self._changed.set()
            self._changed = asyncio.Event()

    def _is_local(self, link: _Link) -> bool:
        """The coordinator is this node: its name and its address (two sidecars of one host may share
        a name; each would judge the job alone from its own ranks)."""
        return self.local is not None and link.node == self.node and link.url == self.own_url.rstrip("/")

    # ------------------------------------------------------------ requests

    async def _exchange(
        self, link: _Link, report: NodeReport
    ) -> tuple[Verdict | None, JobLateness | None, JobGoLive | None]:
        """`_send`, the report's `time` stamped last and its round trip kept for the next report (the
        bound on this one's one-way delay; none after a failure: a later answer may not be this report's)."""
        link.rtt = None
        started = time.monotonic()
        report.time = time.time()
        answer = await self._send(link, report)
        link.rtt = 0.0 if self._is_local(link) else time.monotonic() - started
        return answer

    async def _send(
        self, link: _Link, report: NodeReport
    ) -> tuple[Verdict | None, JobLateness | None, JobGoLive | None]:
        """The coordinator's verdict, its judgement of the job's lateness and its go-live checks
        (None: none, or a coordinator that predates them)."""
        body = json.dumps(report.to_wire(), separators=(",", ":")).encode()
        self.sent += 1
        self.bytes_sent += len(body)
        if self._is_local(link):
            assert self.local is not None
            try:  # a copy: the link must hold what it was told, not the coordinator's live object
                verdict = copy.deepcopy(self.local.accept(report))
            except CoordinatorError as e:
                raise RuntimeError(str(e)) from None
            checks = self.local.golive(report.job_id)
            return verdict, self.local.lateness(report.job_id, self.node), copy.deepcopy(checks)
        answer = await self._request(link, "POST", f"/v1/jobs/{_quote(report.job_id)}/report", body)
        try:
            judged = parse_answer(answer.get("lateness"))
        except ProtocolError as e:  # the verdict still counts: lateness is never worth a hang's handling
            log.warning("job %s: coordinator %s: lateness ignored: %s", report.job_id, link.node, e)
            judged = None
        try:
            checks = job_golive.parse_answer(answer.get("golive"))
        except ProtocolError as e:  # likewise: the go-live checks are never worth the verdict
            log.warning("job %s: coordinator %s: go-live checks ignored: %s", report.job_id, link.node, e)
            checks = None
        return parse_verdict(answer.get("verdict")), judged, checks

    async def _fetch_verdict(self, link: _Link, job_id: str, known: int, wait: float) -> Verdict | None:
        if self._is_local(link):
            assert self.local is not None
            return copy.deepcopy(await self.local.wait_change(job_id, known, wait))
        path = f"/v1/jobs/{_quote(job_id)}/verdict?known={known}&wait={wait:g}"
        answer = await self._request(link, "GET", path, b"", extra_timeout=wait)
        return parse_verdict(answer.get("verdict"))

    async def fetch_story(self, job_id: str, job_incident: str | None) -> dict | None:
        """The job incident's story from the coordinator (None when it cannot be had)."""
        link = self._links.get(job_id)
        if link is None:
            return None
        if self._is_local(link):
            assert self.local is not None
            return self.local.story(job_id, job_incident)
        query = f"?incident={urllib.parse.quote(job_incident)}" if job_incident else ""
        try:
            answer = await self._request(link, "GET", f"/v1/jobs/{_quote(job_id)}/story{query}", b"")
        except Exception as e:
            log.info("job %s: no story from %s: %s", job_id, link.node, e)
            return None
        story = answer.get("story")
        return story if isinstance(story, dict) else None

    async def _request(self, link: _Link, method: str, path: str, body: bytes, extra_timeout: float = 0.0) -> dict:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        headers = {"Content-Type": "application/json"}
        if link.key is None:
            raise RuntimeError("no job key to sign with")
        key = auth.bind(link.key, self.cluster_key)
        headers[auth.REQUEST_HEADER], nonce = auth.sign_request(key, method, path, body, link.node)
        timeout = aiohttp.ClientTimeout(
            total=self.request_timeout + extra_timeout, connect=min(1.0, self.request_timeout)
        )
        async with self._session.request(method, link.url + path, data=body or None, headers=headers,
                                         timeout=timeout, allow_redirects=False) as resp:  # fmt: skip
            raw = await resp.content.read(MAX_ANSWER_BYTES + 1)
            if len(raw) > MAX_ANSWER_BYTES:
                raise RuntimeError(f"{method} {path}: answer larger than {MAX_ANSWER_BYTES} bytes")
            if not auth.reply_is_signed(key, nonce, raw, resp.headers.get(auth.REPLY_HEADER)):
                raise RuntimeError(f"{method} {path}: {resp.status}, the answer is not signed with the job's key")
            if resp.status != 200:
                raise RuntimeError(f"{method} {path}: {resp.status} {raw[:200]!r}")
        try:
            answer = json.loads(raw)
        except ValueError:
            raise RuntimeError(f"{method} {path}: the answer is not JSON") from None
        if not isinstance(answer, dict):
            raise RuntimeError(f"{method} {path}: the answer is not a JSON object")
        try:
            parse_verdict(answer.get("verdict"))
        except ProtocolError as e:
            raise RuntimeError(f"{method} {path}: bad verdict: {e}") from None
        return answer


def _quote(job_id: str) -> str:
    return urllib.parse.quote(job_id, safe="")
