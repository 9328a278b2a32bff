"""The Prometheus rule files: generated from alerts/build.py, valid for promtool, and every
alert specified by a firing and a quiet unit test in alerts/tests/."""
from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from alerts import build
from tests.support import ROOT

ALERTS_DIR = ROOT / "alerts"
RULE_FILES = sorted(ALERTS_DIR.glob("*.rules.yml"))
UNIT_TESTS = sorted((ALERTS_DIR / "tests").glob("*.test.yml"))
PROMTOOL = "/usr/bin/promtool"


def test_rule_files_are_current_with_their_source():
    expected = build.rendered_files()
    assert sorted(p.name for p in RULE_FILES) == sorted(expected)
    stale = [name for name, text in expected.items() if (ALERTS_DIR / name).read_text() != text]
    assert not stale, f"regenerate with `python -m alerts.build`: {stale}"


def test_promtool_accepts_every_rule_file():
    out = subprocess.run([PROMTOOL, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_unit_tests_pass():
    out = subprocess.run([PROMTOOL, "test", "rules", *map(str, UNIT_TESTS)], capture_output=True, text=True,
                         cwd=ALERTS_DIR / "tests")
    assert out.returncode == 0, out.stdout + out.stderr


def _unit_cases() -> list[dict]:
    cases = []
    for path in UNIT_TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            cases.extend(test.get("alert_rule_test", []))
    return cases


@pytest.mark.parametrize("alert", [a.name for a in build.all_alerts()])
def test_every_alert_has_a_firing_and_a_quiet_case(alert):
    cases = [c for c in _unit_cases() if c["alertname"] == alert]
    assert any(c.get("exp_alerts") for c in cases), f"{alert}: no unit test where it fires"
    assert any(not c.get("exp_alerts") for c in cases), f"{alert}: no unit test where it stays quiet"


def _runbook_anchors() -> set[str]:
    text = (ROOT / "docs" / "runbook.md").read_text()
    return {h.strip().lower() for h in re.findall(r"^##+ (.+)$", text, re.M)}


def test_every_alert_has_severity_annotations_and_a_runbook_section():
    anchors = _runbook_anchors()
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" not in rule:
                    continue
                assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
                ann = rule["annotations"]
                assert ann["summary"] and ann["description"], rule["alert"]
                assert ann["runbook_url"].endswith("#" + rule["alert"].lower())
                assert rule["alert"].lower() in anchors, f"docs/runbook.md has no section {rule['alert']}"


def test_alert_names_are_unique():
    names = [a.name for a in build.all_alerts()]
    assert len(names) == len(set(names))


def test_for_override_shortens_every_alert_and_keeps_expressions(tmp_path):
    build.write(tmp_path, for_override="5s")
    for path in tmp_path.glob("*.rules.yml"):
        short = yaml.safe_load(path.read_text())["groups"]
        real = yaml.safe_load((ALERTS_DIR / path.name).read_text())["groups"]
        for g_short, g_real in zip(short, real):
            for r_short, r_real in zip(g_short["rules"], g_real["rules"]):
                assert r_short["expr"] == r_real["expr"]
                if "alert" in r_short:
                    assert r_short["for"] == "5s"
