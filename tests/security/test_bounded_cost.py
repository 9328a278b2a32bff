"""Issue 9, row 9: thousands of registered ranks with custom metrics each must not buy anyone a
slow `/healthz`, an unbounded `/metrics`, or a healthy rank killed because the sidecar fell
behind. The node-wide case (root's ranks: per-user quotas do not apply to them). The
benchmark of the same load is `python -m bench.bench_metrics` (its item-9 case)."""

from __future__ import annotations

import contextlib
import json
import subprocess

import pytest

from tests.support import PYTHON, Sidecar, http_json, spawned, tail, wait_until
from tests.support.load import HEALTHY, Latencies, scrape_and_probe, start_loaders, wait_loaded

pytestmark = pytest.mark.slow  # a load test: 35 s of probing by design
JOBS, RANKS_PER_JOB, CUSTOMS = 4, 500, 32
MAX_SERIES = 3000


def rank_state(sc: Sidecar, job: str) -> str | None:
    status = http_json(sc.url + "/v1/status", timeout=60)
    return next((r["state"] for r in status["ranks"] if r["job_id"] == job), None)


def test_thousands_of_ranks_neither_slow_health_nor_kill_a_healthy_rank(tmp_path):
    with contextlib.ExitStack() as stack:
        sc = Sidecar(
            tmp_path / "sc",
            "collectors.enabled=[nic,process,node]",
            "watchdog.floor_seconds=5",
            "hooks_flush_interval_seconds=1",
            f"limits.max_series={MAX_SERIES}",
            "log_level=warning",
            "metrics_reuse_seconds=0.5",
        )  # the default, which tests/support/__init__.py turns off
        sc.start()
        stack.callback(sc.stop)
        healthy = stack.enter_context(spawned([PYTHON, "-c", HEALTHY], tmp_path / "healthy.log", env=sc.hook_env()))
        wait_until(lambda: rank_state(sc, "healthy") == "healthy", 60, interval=0.5, what="the healthy rank")
        start_loaders(stack, sc, tmp_path, JOBS, RANKS_PER_JOB, CUSTOMS)
        during = scrape_and_probe(sc.port, 20)  # while the ranks register, and after
        accepted = wait_loaded(tmp_path, JOBS, 300)
        after = scrape_and_probe(sc.port, 5)  # back to back: 5 s is dozens of scrapes and ~100 health probes
        seen = Latencies(
            during.healthz_ms + after.healthz_ms,
            during.scrape_ms + after.scrape_ms,
            during.scrape_series + after.scrape_series,
            during.scrape_bytes + after.scrape_bytes,
            during.failures + after.failures,
        )
        print(f"{accepted} ranks registered with {CUSTOMS} custom metrics each; " + seen.summary())
        try:
            assert accepted >= JOBS * RANKS_PER_JOB * 0.9
            assert not seen.failures, seen.failures[:5]
            assert healthy.poll() is None, "the healthy rank was killed"
            assert rank_state(sc, "healthy") == "healthy"
            incidents = http_json(sc.url + "/v1/status", timeout=60)["incidents"]
            assert not [i for i in incidents if i["job_id"] == "healthy"], incidents
            assert max(seen.scrape_series) <= MAX_SERIES
            assert max(seen.healthz_ms) < 1000, seen.summary()  # generous: a shared 2-core machine
            assert len(seen.scrape_ms) >= 10
        except AssertionError:
            print(f"--- sidecar log ---\n{tail(sc.log, 60)}")
            raise
        out = subprocess.run(["ps", "-o", "rss=,pcpu=", "-p", str(sc.proc.pid)], capture_output=True, text=True)
        print("sidecar rss KiB, cpu %:", out.stdout.strip(), json.dumps({"accepted": accepted}))
