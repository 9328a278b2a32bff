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


@pytest.mark.system
def test_promtool_accepts_every_rule_file():
    out = subprocess.run([PROMTOOL, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.system
def test_promtool_unit_tests_pass():
    out = subprocess.run(
        [PROMTOOL, "test", "rules", *map(str, UNIT_TESTS)], capture_output=True, text=True, cwd=ALERTS_DIR / "tests"
    )
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
        for g_short, g_real in zip(short, real, strict=True):
            for r_short, r_real in zip(g_short["rules"], g_real["rules"], strict=True):
                assert r_short["expr"] == r_real["expr"]
                if "alert" in r_short:
                    assert r_short["for"] == "5s"


# ---------------------------------------------------------------- GPU sources (docs/dcgm.md)

SOURCE_FILES = sorted((ALERTS_DIR / "gpu-source").glob("*.rules.yml"))


@pytest.mark.system
def test_gpu_source_files_are_current_and_pass_promtool():
    expected = build.source_files()
    assert sorted(f"gpu-source/{p.name}" for p in SOURCE_FILES) == sorted(expected)
    stale = [name for name, text in expected.items() if (ALERTS_DIR / name).read_text() != text]
    assert not stale, f"regenerate with `python -m alerts.build`: {stale}"
    out = subprocess.run([PROMTOOL, "check", "rules", *map(str, SOURCE_FILES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_both_gpu_sources_record_every_gpu_name_the_alerts_and_dashboards_read():
    from alerts import gpu_source
    from tests.dashboards.panels import DASHBOARD_FILES, load, queries

    read = set()
    for group in build.FILES.values():
        for g in group:
            read |= {n for r in g.rules for n in re.findall(r"gpu:sidecar_gpu_\w+", r.expr)}
    for path in DASHBOARD_FILES:
        read |= {n for _, e in queries(load(path)) for n in re.findall(r"gpu:sidecar_gpu_\w+", e)}
    sidecar = {r for r, _ in gpu_source.sidecar_source()}
    dcgm = {r for r, _, _ in gpu_source.dcgm_source()}
    assert read and read <= sidecar, sorted(read - sidecar)
    assert read - dcgm == {gpu_source.recorded(m) for m in gpu_source.SIDECAR_ONLY} & read
    # No panel or alert reads a GPU series of one source directly.
    for path in [*RULE_FILES, *DASHBOARD_FILES]:
        text = re.sub(r"gpu:sidecar_gpu_\w+|job_id(_instance)?:sidecar_gpu_\w+:\w+", "", path.read_text())
        assert not re.search(r"sidecar_gpu_\w+|DCGM_FI_\w+", text), path.name


def test_every_gpu_alert_but_nvlink_down_fires_through_dcgm_series_in_a_unit_test():
    dcgm_tests = yaml.safe_load((ALERTS_DIR / "tests" / "gpu-dcgm.test.yml").read_text())
    assert dcgm_tests["rule_files"] == ["../gpu-source/dcgm.rules.yml", "../gpu.rules.yml"]
    cases = [c for t in dcgm_tests["tests"] for c in t.get("alert_rule_test", [])]
    for alert in build.GPU.rules:
        fires = any(c["alertname"] == alert.name and c.get("exp_alerts") for c in cases)
        assert fires == (alert.name != "SidecarGpuNvlinkDown"), alert.name  # dcgm-exporter has no link state


def test_docs_dcgm_carries_the_mapping_table():
    from alerts import gpu_source

    mapped = {f for m in gpu_source.DCGM for f in m.dcgm}
    assert set(gpu_source.DEFAULT_COUNTERS) <= mapped | set(gpu_source.NOT_MAPPED)
    assert all(m.default == all(f in gpu_source.DEFAULT_COUNTERS for f in m.dcgm) for m in gpu_source.DCGM)
    assert gpu_source.markdown_table() in (ROOT / "docs" / "dcgm.md").read_text(), (
        "paste alerts.gpu_source.markdown_table() into docs/dcgm.md"
    )


# ---------------------------------------------------------------- selectors (SidecarDown)

SELECTED_DOWN_TEST = """
rule_files: [overlap.rules.yml]
evaluation_interval: 1m
tests:
- interval: 1m
  input_series:
  - series: 'up{job="gpu-sidecars",instance="n1"}'
    values: '0x5'
  - series: 'up{job="sidecar",instance="n2"}'
    values: '0x5'
  alert_rule_test:
  - eval_time: 5m
    alertname: SidecarDown
    exp_alerts:
    - exp_labels: {severity: warning, job: gpu-sidecars, instance: n1}
      exp_annotations:
        summary: "Sidecar on n1 is down"
        description: "Prometheus cannot scrape the sidecar: this node has no metrics and no stall watchdog."
        runbook_url: "https://github.com/training-sidecar/training-sidecar/blob/main/docs/runbook.md#sidecardown"
"""


@pytest.mark.system
def test_sidecar_down_fires_on_the_configured_selector_only(tmp_path):
    assert build.main(["--out", str(tmp_path), "--selector", 'sidecar_targets=job="gpu-sidecars"']) == 0
    assert 'up{job="gpu-sidecars"} == 0' in (tmp_path / "overlap.rules.yml").read_text()
    (tmp_path / "down.test.yml").write_text(SELECTED_DOWN_TEST)
    out = subprocess.run([PROMTOOL, "test", "rules", "down.test.yml"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_default_selector_is_the_scrape_job_the_deploy_files_give_the_sidecars():
    (down,) = [a for a in build.all_alerts() if a.name == "SidecarDown"]
    assert down.expr == f"up{{{build.SELECTORS['sidecar_targets']}}} == 0" == 'up{job="sidecar"} == 0'
    scrape = yaml.safe_load((ROOT / "deploy" / "baremetal" / "prometheus.yml").read_text())["scrape_configs"]
    assert [s["job_name"] for s in scrape] == ["sidecar"]  # Kubernetes: tests/ops/test_overlays.py (jobLabel)


def test_an_unknown_selector_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        build.main(["--selector", 'sidecar_target=job="x"'])
    assert e.value.code == 2 and "sidecar_targets" in capsys.readouterr().err


# ---------------------------------------------------------------- alert names in texts

# An alert's name as the texts write it: a Sidecar... word (every alert has the prefix); `Name*` stands
# for every alert whose name starts with Name.
MENTION = re.compile(r"\b(Sidecar[A-Z][A-Za-z]*)(\*?)")


def test_every_alert_is_named_with_the_sidecar_prefix():
    assert not [a.name for a in build.all_alerts() if not re.fullmatch(r"Sidecar[A-Z][A-Za-z]+", a.name)]


def _unknown_mentions(text: str) -> set[str]:
    names = {a.name for a in build.all_alerts()}
    unknown = set()
    for name, star in MENTION.findall(text):
        if not (any(n.startswith(name) for n in names) if star else name in names):
            unknown.add(name + star)
    return unknown


def test_every_alert_an_alert_text_names_exists():
    for alert in build.all_alerts():
        assert not _unknown_mentions(f"{alert.summary}\n{alert.description}"), alert.name


def test_every_alert_the_runbook_names_exists():
    assert not _unknown_mentions((ROOT / "docs" / "runbook.md").read_text())


def test_a_misnamed_alert_is_found():
    assert _unknown_mentions("see SidecarRankStraggler and SidecarCheckpointDisk* or SidecarGpuFoo*") == {
        "SidecarRankStraggler",
        "SidecarGpuFoo*",
    }
