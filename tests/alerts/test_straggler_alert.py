"""SidecarStragglerRank on the real thing (issue 30): two real gloo ranks with `Monitor` hooks push to a
real sidecar, rank 1 computing 100 ms longer per step from step 30 on; a real Prometheus scrapes the
sidecar and evaluates the shipped rules (only `for:` shortened, `alerts.build --for`). The alert
fires for rank 1, with its node and its job, and never for rank 0, whose step time is the same
(each rank waits for the slowest at every all-reduce): only the lateness tells them apart."""

from __future__ import annotations

import time

import pytest

from alerts import build as alerts_build
from tests.alerts.realstack import Prometheus
from tests.hooks.test_collectives_lateness import SLOW_FROM, Job
from tests.support import Sidecar

pytestmark = [pytest.mark.slow, pytest.mark.system, pytest.mark.xdist_group("straggler-alert")]


def test_the_straggler_alert_fires_for_the_late_rank_only(tmp_path):
    rules = tmp_path / "rules"
    alerts_build.write(rules, for_override="2s")
    with Sidecar(tmp_path / "sidecar", "watchdog.observe_only=true", "hooks_flush_interval_seconds=0.5") as sidecar:
        prom = Prometheus(
            tmp_path / "prom", targets=[f"127.0.0.1:{sidecar.port}"], rule_files=sorted(rules.glob("*.rules.yml"))
        )
        with prom.running():
            (tmp_path / "job").mkdir()
            job = Job(tmp_path / "job", sidecar, "straggling", slow=True)
            try:
                deadline, firing, seen_rank0 = time.monotonic() + 150, [], []
                while time.monotonic() < deadline:
                    job.check_alive()
                    firing = [
                        a for a in prom.firing("SidecarStragglerRank") if a["labels"].get("job_id") == "straggling"
                    ]
                    seen_rank0 += [a for a in firing if a["labels"].get("rank") != "1"]
                    if any(a["labels"].get("rank") == "1" for a in firing):
                        break
                    time.sleep(1)
                assert job.step_at(1, SLOW_FROM) is not None, "the job did not reach its slowdown"
                (alert,) = firing
                labels = alert["labels"]
                assert labels["rank"] == "1" and labels["severity"] == "warning", labels
                assert labels["instance"] == f"127.0.0.1:{sidecar.port}", labels  # the rank's node
                assert "Straggler: straggling rank 1 on" in alert["annotations"]["summary"], alert
                assert float(alert["value"]) > 0.05, alert  # its lateness, above the floor
                assert seen_rank0 == [], seen_rank0
            finally:
                job.close()
