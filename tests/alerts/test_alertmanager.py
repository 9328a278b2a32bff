"""deploy/alertmanager/alertmanager.yml: valid for amtool, critical pages, the rest tickets."""

from __future__ import annotations

import subprocess

import pytest

from alerts.build import all_alerts
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


def test_every_shipped_alert_reaches_a_receiver():
    expected = {"critical": "pager", "warning": "ticket", "info": "ticket"}
    for alert in all_alerts():
        assert route(f"severity={alert.severity}", f"alertname={alert.name}") == expected[alert.severity], alert.name


def test_notifications_are_grouped_by_alert_and_job():
    import yaml

    config = yaml.safe_load(CONFIG.read_text())
    assert set(config["route"]["group_by"]) == {"alertname", "job_id"}
