"""deploy/alertmanager/alertmanager.yml: valid for amtool; training quality to the job's owners,
hardware and nodes to the platform, the jobs' health: critical pages, the rest tickets.
(Its inhibit rules, one page per hang, are test_inhibition.py's.)"""

from __future__ import annotations

import subprocess

import pytest

from alerts import build
from tests.support import ROOT

CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
AMTOOL = "/usr/bin/amtool"

pytestmark = pytest.mark.system


def route(*labels: str) -> str:
    out = subprocess.run(
        [AMTOOL, "config", "routes", "test", f"--config.file={CONFIG}", *labels],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_amtool_accepts_the_config():
    out = subprocess.run([AMTOOL, "check-config", str(CONFIG)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("severity, receiver", [("critical", "pager"), ("warning", "ticket"), ("info", "ticket")])
def test_severity_picks_the_receiver(severity, receiver):
    assert route(f"severity={severity}", "alertname=SidecarRankStalled", "job_id=j1") == receiver


# Training quality: the job's own code or data, for its owners (issue 31).
JOB_OWNERS = {
    "SidecarTrainingLossNonFinite",
    "SidecarGradNormExplosion",
    "SidecarLearningRateZero",
    "SidecarLearningRateJump",
    "SidecarStragglerRank",
}
# Hardware and nodes: the platform's.
PLATFORM = {a.name for a in [*build.GPU.rules, *build.NETWORK.rules, *build.OVERLAP.rules]} | {
    "SidecarNodeUnfit",
    "SidecarRankGpuError",
    "SidecarCollectorFailing",
    "SidecarWatchdogObserveOnly",
}


def expected_receiver(alert: build.Alert) -> str:
    if alert.name in JOB_OWNERS:
        return "job-owners"
    if alert.name in PLATFORM:
        return "platform-pager" if alert.severity == "critical" else "platform"
    return "pager" if alert.severity == "critical" else "ticket"


def test_every_shipped_alert_reaches_its_receiver():
    assert JOB_OWNERS | PLATFORM <= {a.name for a in build.all_alerts()}
    for alert in build.all_alerts():
        labels = [f"severity={alert.severity}", f"alertname={alert.name}", "namespace=team-a", "job_id=j1"]
        assert route(*labels) == expected_receiver(alert), alert.name


def test_notifications_are_grouped_by_alert_and_job_in_its_namespace_and_cluster():
    import yaml

    config = yaml.safe_load(CONFIG.read_text())
    assert set(config["route"]["group_by"]) == {"alertname", "cluster", "namespace", "job_id"}
