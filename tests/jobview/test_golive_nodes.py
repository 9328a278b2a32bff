"""The go-live checks across nodes end to end: synthetic node reports posted, signed with the job's
key, to a real sidecar's coordinator endpoint (`POST /v1/jobs/{job}/report`), whose answer carries
the job-wide checks; and a reporter that sends its figures only when they changed and shows the
coordinator's judgement (in-process, this node its job's coordinator)."""

from __future__ import annotations

import asyncio
import json

from sidecar.daemon.api import DAEMON
from sidecar.jobview import auth
from sidecar.jobview import golive as job_golive
from sidecar.jobview.coordinator import Coordinator
from sidecar.jobview.reporter import Reporter
from sidecar.ranks.golive import GIB, JobFigures, LossFigures, RankFigures
from tests.daemon.conftest import child_pid, serve  # noqa: F401 (fixtures)
from tests.daemon.helpers import registration
from tests.jobview.helpers import rank, report


def figures(ranks: range, memory: float = 22 * GIB, loss: LossFigures | None = None) -> JobFigures:
    return JobFigures(2, 50, 0.2, [RankFigures(r, True, int(memory), step_seconds=0.3) for r in ranks], loss)


async def test_the_coordinator_endpoint_answers_every_node_with_the_job_wide_checks(serve, child_pid):  # noqa: F811
    sidecar = await serve()
    reply = await sidecar.post("/v1/register", registration(child_pid, job="j1", rank=0, world_size=6))
    assert reply.status == 200, reply.body
    key = reply.body["job_view"]["key"]
    here = sidecar.app[DAEMON].settings.node_name
    path = "/v1/jobs/j1/report"

    async def post(node: str, got: JobFigures | None, raw: dict | None = None):
        ranks = [rank(r.rank, state="healthy", waiting=None) for r in got.ranks] if got is not None else []
        data = report(node, *ranks, world=6, golive=got).to_wire()
        data.update(raw or {})
        body = json.dumps(data).encode()
        header, _ = auth.sign_request(key, "POST", path, body, here)
        return await sidecar.post(path, body, tcp=True, headers={auth.REQUEST_HEADER: header})

    falling = LossFigures(1, 50, 50, 2.3, 1.9, 0, 1, 50)
    assert (await post("node-a", figures(range(2), loss=falling))).status == 200
    assert (await post("node-b", figures(range(2, 4)))).status == 200
    heavy = figures(range(4, 6))
    heavy.ranks[1].memory = int(31 * GIB)
    answer = await post("node-c", heavy)
    assert answer.status == 200, answer.body
    await asyncio.sleep(1.1)  # past the judgement's rate limit: the next answer judges every node
    answer = await post("node-c", None)  # a heartbeat: figures unchanged
    checks = job_golive.parse_answer(answer.body.get("golive"))
    assert checks is not None and checks.world_size == 6 and checks.nodes == 3, answer.body
    assert checks.checks["ranks_joined"].text == "6 of 6 ranks reported by 3 nodes"
    assert checks.checks["gpu_memory"].state == "warning"
    assert checks.checks["gpu_memory"].text.startswith("rank 5 on node-c uses 31.0 GiB"), checks.checks
    assert checks.checks["loss"].state == "ok"

    bad = await post("node-b", None, {"golive": {**figures(range(2, 4)).to_wire(), "share": -1}})
    assert bad.status == 400 and bad.body["error"].startswith("golive.share"), bad.body

    # this sidecar's own figures of the job (what its reporter sends), and its status: no coordinator
    # named by a rank here, so the checks shown are this node's own
    d = sidecar.app[DAEMON]
    assert d.reporter is not None
    own = d.reporter.figures("j1")
    assert own is not None and [(r.rank, r.stepped) for r in own.ranks] == [(0, False)] and own.steps == 50
    status = await sidecar.get("/v1/status")
    assert status.body["golive"]["j1"]["judged_by"] == "node", status.body["golive"]


def test_a_reporter_sends_its_figures_when_they_change_and_shows_the_coordinators_checks():
    async def scenario():
        c = Coordinator(lambda job: 2 if job == "j1" else 0, lost_after=15.0, verdict_wait=3.0, max_nodes=4,
                        probe=None, node="node-0")  # fmt: skip
        carried: list[bool] = []
        accept = c.accept

        def counting(r):
            carried.append(r.golive is not None)
            return accept(r)

        c.accept = counting  # type: ignore[method-assign]

        def source(job_id: str):
            return report("node-0", rank(0, state="healthy", waiting=None), world=2)

        def mine(job_id: str) -> JobFigures:
            return figures(range(2), loss=LossFigures(1, 50, 50, 2.3, 1.9, 0, 1, 50))

        reporter = Reporter("node-0", "http://127.0.0.1:1", 0.05, source, local=c, golive=mine)
        reporter.set_coordinator("j1", "http://127.0.0.1:1", "node-0", None)
        task = asyncio.get_running_loop().create_task(reporter.run())
        try:
            for _ in range(100):
                await asyncio.sleep(0.05)
                if reporter.golive("j1") is not None and len(carried) >= 3:
                    break
            return carried, reporter.golive("j1")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    carried, got = asyncio.run(scenario())
    assert carried[0] is True and set(carried[1:]) == {False}, carried
    assert got is not None
    answer, age = got
    assert answer.state == "ok" and age < 5, answer
    assert answer.checks["ranks_joined"].text == "2 of 2 ranks reported by 1 node"
