"""The collector runner: one collector stuck in a driver call delays only itself, and is
reported failing once it has run for too long."""

from __future__ import annotations

import asyncio
import threading

from prometheus_client.core import GaugeMetricFamily

from sidecar.collectors.base import CollectorRunner


class Quick:
    name = "quick"
    metrics = ()

    def __init__(self):
        self.runs = 0

    def collect(self):
        self.runs += 1
        g = GaugeMetricFamily("sidecar_quick", "runs", labels=[])
        g.add_metric([], self.runs)
        return [g]


class Stuck:
    name = "stuck"
    metrics = ()

    def __init__(self):
        self.release = threading.Event()

    def collect(self):
        self.release.wait(30)  # like an NVML call on a GPU that fell off the bus
        return []


async def test_a_stuck_collector_delays_only_itself_and_is_reported_hung():
    quick, stuck = Quick(), Stuck()
    runner = CollectorRunner([quick, stuck], interval=0.05)
    runner.hung_after_seconds = 0.3
    task = asyncio.create_task(runner.run_forever())
    try:
        await asyncio.sleep(1.0)
        assert quick.runs >= 5
        assert b"sidecar_quick" in runner.rendered_text()
        view = runner.snapshot()
        assert view["quick"].success and not view["stuck"].success
        assert view["stuck"].error.startswith("hung: its current run has lasted")
        success = {
            s.labels["collector"]: s.value
            for f in runner.health_families()
            if f.name == "sidecar_scrape_collector_success"
            for s in f.samples
        }
        assert success == {"quick": 1.0, "stuck": 0.0}
        assert not runner.first_round.is_set()  # readiness waits for every collector once
    finally:
        stuck.release.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_with_no_collectors_the_runner_is_ready_at_once():
    runner = CollectorRunner([], interval=1.0)
    task = asyncio.create_task(runner.run_forever())
    try:
        await asyncio.wait_for(runner.first_round.wait(), 5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_the_health_of_collectors_is_read_safely_while_runs_start_and_end():
    """Make test, one of six runs: `/metrics` answered 500 ("dictionary changed size during
    iteration"): it renders in an executor thread while the event loop's collectors start and end,
    and `hung()` iterated the running ones' dict itself."""
    import threading

    from sidecar.collectors.base import CollectorResult, CollectorRunner

    runner = CollectorRunner([], interval=1.0)
    runner.results = {f"c{i}": CollectorResult() for i in range(64)}  # 64 collectors, each "hung" when running
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            runner._running_since[f"c{i % 64}"] = 0.0
            runner._running_since.pop(f"c{(i + 32) % 64}", None)
            i += 1

    worker = threading.Thread(target=churn, daemon=True)
    worker.start()
    try:
        for _ in range(20000):
            runner.hung()
            list(runner.families())
    finally:
        stop.set()
        worker.join(5)
