"""`/v1/status` health: degraded, with one line per problem, when a rank stalls or a
collector fails; healthy otherwise."""

from __future__ import annotations

import asyncio
import math
import time

from sidecar.collectors.base import CollectorResult
from sidecar.daemon.api import DAEMON
from tests.daemon.helpers import push_body, registration, step_item


async def status_when(sidecar, predicate, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = (await sidecar.get("/v1/status")).body
        if predicate(body) or time.monotonic() > deadline:
            return body
        await asyncio.sleep(0.1)


async def test_a_fresh_daemon_is_healthy(sidecar):
    body = (await sidecar.get("/v1/status")).body
    assert (body["health"], body["problems"], body["ranks"]) == ("healthy", [], [])


async def test_a_rank_reports_its_latest_values(sidecar, child_pid):
    await sidecar.post("/v1/register", registration(child_pid, rank=1, world_size=4, restart_count=2))
    t = time.time()
    await sidecar.post(
        "/v1/push",
        push_body(
            child_pid,
            [step_item(7, t - 0.25, loss=3.0, lr=0.1), step_item(8, t, loss="nan", grad_norm=2.0)],
            rank=1,
            dropped=5,
        ),
    )
    (rank,) = (await sidecar.get("/v1/status")).body["ranks"]
    assert (rank["rank"], rank["world_size"], rank["step"], rank["restart_count"], rank["dropped"]) == (1, 4, 8, 2, 5)
    assert rank["loss"] is None  # NaN has no JSON form
    assert (rank["grad_norm"], rank["lr"], rank["state"]) == (2.0, 0.1, "healthy")
    assert math.isclose(rank["step_time_seconds"], 0.25, rel_tol=1e-3)
    assert math.isclose(rank["iterations_per_second"], 4.0, rel_tol=1e-3)
    assert rank["timeout_seconds"] >= 30 and 0 <= rank["last_progress_age_seconds"] < 30


async def test_a_stalled_rank_makes_the_node_degraded(serve, child_pid):
    sidecar = await serve(
        watchdog__observe_only=True,
        watchdog__floor_seconds=0.5,
        watchdog__ceiling_seconds=1,
        watchdog__check_interval_seconds=0.1,
        hooks_flush_interval_seconds=0.2,
    )
    await sidecar.post("/v1/register", registration(child_pid))
    await sidecar.post("/v1/push", push_body(child_pid, [step_item(1)]))
    body = await status_when(sidecar, lambda b: b["ranks"][0]["state"] == "stalled")
    assert body["ranks"][0]["state"] == "stalled"
    assert body["health"] == "degraded"
    assert any(p.startswith("rank run-42/0 ") for p in body["problems"]), body["problems"]


class Broken:
    name = "broken"
    metrics = ()

    def collect(self):
        raise OSError("cannot read /sys/class/net")


async def test_a_failing_collector_makes_the_node_degraded(sidecar):
    runner = sidecar.app[DAEMON].runner
    runner.collectors.append(Broken())
    runner.results["broken"] = CollectorResult()
    await runner.run_round()
    body = (await sidecar.get("/v1/status")).body
    assert body["collectors"]["broken"]["success"] is False
    assert body["health"] == "degraded"
    assert body["problems"] == ["collector broken failing: OSError: cannot read /sys/class/net"]
    assert 'sidecar_scrape_collector_success{collector="broken"} 0.0' in await sidecar.metrics()


async def test_readyz_waits_for_the_first_collector_round(serve):
    sidecar = await serve()
    runner = sidecar.app[DAEMON].runner
    runner.first_round.clear()
    assert (await sidecar.get("/readyz")).status == 503
    await runner.run_round()
    assert (await sidecar.get("/readyz")).status == 200
    assert (await sidecar.get("/healthz")).status == 200
