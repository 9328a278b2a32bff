"""Tuning the rules and dashboards without a checkout (issue 31): `sidecar deploy-gen --config FILE
--write DIR` renders the rules, the dashboards and the deploy tree with an operator's settings,
from the generators of the installed package (sidecar/mixin); a bad file fails naming the key and
writes nothing; `--print-config` is a file to start from."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest
import setuptools
import tomllib
import yaml

from sidecar import cli
from sidecar.mixin import config as mixin_config
from sidecar.mixin.promql import relabel
from tests.support import PYTHON, ROOT

PROMTOOL = shutil.which("promtool")
RUNBOOK = "https://wiki.example.com/sidecar/runbook"
CONFIG = f"""
thresholds:
  rank_stalled_for: 7m
  goodput_low_ratio: 0.65
  thermal_margin_celsius: 5
selectors:
  sidecar_targets: 'job="gpu-sidecars"'
runbook_base_url: {RUNBOOK}
cluster_label: k8s_cluster
dashboards:
  refresh: 1m
  folder: ML platform
scale:
  shards: 3
  store_url: http://vm.example:8428
"""


def _render(tmp_path: Path, text: str = CONFIG) -> tuple[int, Path]:
    (tmp_path / "mixin.yaml").write_text(text)
    out = tmp_path / "out"
    return cli.main(["deploy-gen", "--config", str(tmp_path / "mixin.yaml"), "--write", str(out)]), out


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    rc, out = _render(tmp_path_factory.mktemp("mixin"))
    assert rc == 0
    return out


def _rules(path: Path) -> dict[str, dict]:
    return {r.get("alert") or r["record"]: r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]}


def _objects(out: Path, kind: str) -> list[dict]:
    docs = [yaml.safe_load(p.read_text()) for p in sorted((out / "kubernetes/base/generated").rglob("*.yaml"))]
    return [d for d in docs if d["kind"] == kind]


def test_the_configured_threshold_selector_and_runbook_url_are_in_the_rule_files(rendered):
    training = _rules(rendered / "alerts" / "training.rules.yml")
    assert training["SidecarRankStalled"]["for"] == "7m"
    assert "job_id:sidecar_goodput:ratio1h < 0.65" in training["SidecarJobGoodputLow"]["expr"]
    assert "less than 65%" in training["SidecarJobGoodputLow"]["annotations"]["description"]
    assert training["SidecarJobHungOnRank"]["annotations"]["runbook_url"] == f"{RUNBOOK}#sidecarjobhungonrank"
    assert _rules(rendered / "alerts" / "overlap.rules.yml")["SidecarDown"]["expr"] == 'up{job="gpu-sidecars"} == 0'
    thermal = _rules(rendered / "alerts" / "gpu.rules.yml")["SidecarGpuThermalSlowdown"]["expr"]
    assert "gpu:sidecar_gpu_slowdown_temperature_celsius - 5" in thermal


def test_the_configured_cluster_label_replaces_cluster_in_every_query(rendered):
    texts = [p.read_text() for p in sorted((rendered / "alerts").rglob("*.rules.yml"))]
    assert all("k8s_cluster" in t for t in texts)
    exprs = [r["expr"] for p in sorted((rendered / "alerts").rglob("*.rules.yml")) for r in _rules(p).values()]
    assert not [e for e in exprs if re.search(r"(?<![\w$])cluster(?!\w)", e)]
    assert (
        "max by (namespace, k8s_cluster, job_id, rank, node)"
        in _rules(rendered / "alerts" / "training.rules.yml")["SidecarJobHungOnRank"]["expr"]
    )
    board = (rendered / "dashboards" / "training-job.json").read_text()
    assert 'k8s_cluster=~\\"$cluster\\"' in board and "label_values(sidecar_build_info, k8s_cluster)" in board
    assert not re.search(r"(?<![\w$])cluster=~", board)


def test_the_dashboards_and_their_configmaps_carry_the_dashboard_settings(rendered):
    board = json.loads((rendered / "dashboards" / "node-hardware.json").read_text())
    assert board["refresh"] == "1m"
    temperature = next(p for p in board["panels"] if p["title"] == "Temperature against slowdown threshold")
    assert "- 5" in temperature["targets"][2]["expr"] and "within 5 degrees" in temperature["description"]
    maps = _objects(rendered, "ConfigMap")
    assert maps and {m["metadata"]["annotations"]["grafana_folder"] for m in maps} == {"ML platform"}
    embedded = next(m for m in maps if "training-job.json" in m["data"])["data"]["training-job.json"]
    assert embedded == (rendered / "dashboards" / "training-job.json").read_text()


def test_the_scale_stack_follows_the_configured_shards_store_and_rules(rendered):
    scale = rendered / "scale"
    assert sorted(p.name for p in scale.glob("scrape-shard-*.yml")) == [f"scrape-shard-{n}.yml" for n in range(3)]
    shard = yaml.safe_load((scale / "scrape-shard-2.yml").read_text())
    assert shard["remote_write"][0]["url"] == "http://vm.example:8428/api/v1/write"
    assert shard["scrape_configs"][0]["job_name"] == "gpu-sidecars"  # the configured selector's job
    assert shard["scrape_configs"][0]["relabel_configs"][0]["modulus"] == 3
    assert _rules(scale / "shard.rules.yml")["SidecarRankStalled"]["for"] == "7m"
    assert "k8s_cluster" in _rules(scale / "global.rules.yml")["SidecarJobHungOnRank"]["expr"]


def test_the_prometheus_rule_objects_carry_the_configured_rules(rendered):
    rules = {r["metadata"]["name"]: r["spec"]["groups"] for r in _objects(rendered, "PrometheusRule")}
    (stalled,) = [r for g in rules["sidecar-training"] for r in g["rules"] if r.get("alert") == "SidecarRankStalled"]
    assert stalled["for"] == "7m" and stalled["annotations"]["runbook_url"].startswith(RUNBOOK)
    (down,) = [r for g in rules["sidecar-overlap"] for r in g["rules"] if r.get("alert") == "SidecarDown"]
    assert down["expr"] == 'up{job="gpu-sidecars"} == 0'
    assert "k8s_cluster" in rules["sidecar-gpu-source-dcgm"][0]["rules"][0]["expr"]
    # The rest of the deploy tree comes along, and the checkout's own files are left alone.
    assert (rendered / "kubernetes" / "kustomization.yaml").is_file()
    assert (rendered / "alertmanager" / "alertmanager.yml").is_file()
    assert "7m" not in (ROOT / "deploy/kubernetes/base/generated/prometheusrule-training.yaml").read_text()


ROW_REMAP_TEST = f"""
rule_files: [gpu.rules.yml]
evaluation_interval: 1m
tests:
- interval: 1m
  input_series:
  - series: 'gpu:sidecar_gpu_remapped_rows_failed{{k8s_cluster="east",instance="n1",gpu="0"}}'
    values: '1x5'
  alert_rule_test:
  - eval_time: 2m
    alertname: SidecarGpuRowRemapFailed
    exp_alerts:
    - exp_labels: {{severity: critical, k8s_cluster: east, instance: n1, gpu: "0"}}
      exp_annotations:
        summary: "Memory row remap failed on GPU 0 on n1"
        description: "The GPU ran out of spare rows or failed to remap one: the GPU needs replacing (RMA)."
        runbook_url: "{RUNBOOK}#sidecargpurowremapfailed"
"""


@pytest.mark.system
@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
def test_promtool_accepts_the_rendered_rules_and_they_aggregate_by_the_configured_label(rendered, tmp_path):
    files = sorted(str(p) for p in (rendered / "alerts").rglob("*.rules.yml"))
    assert len(files) == 8
    out = subprocess.run([PROMTOOL, "check", "rules", *files], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    shutil.copy(rendered / "alerts" / "gpu.rules.yml", tmp_path / "gpu.rules.yml")
    (tmp_path / "remap.test.yml").write_text(ROW_REMAP_TEST)
    out = subprocess.run([PROMTOOL, "test", "rules", "remap.test.yml"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    "text, message",
    [
        ("thresholds: {rank_stalled_after: 5m}", "thresholds.rank_stalled_after: unknown key (known: rank_stalled_for"),
        ("colour: red", "colour: unknown key (known: thresholds, selectors"),
        ("thresholds: {rank_stalled_for: 300}", "thresholds.rank_stalled_for: expected a Prometheus duration"),
        ("thresholds: {goodput_low_ratio: high}", "thresholds.goodput_low_ratio: expected a number"),
        ("thresholds: {goodput_low_ratio: true}", "thresholds.goodput_low_ratio: expected a number"),
        ("cluster_label: my-cluster", "cluster_label: expected a Prometheus label name"),
        ("selectors: {sidecar_targets: 3}", "selectors.sidecar_targets: expected PromQL label matchers"),
        ("runbook_base_url: docs/runbook.md", "runbook_base_url: expected an http(s) URL"),
        ("dashboards: {tags: one}", "dashboards.tags: expected a non-empty list"),
        ("thresholds: [1, 2]", "thresholds: expected a mapping"),
        ("thresholds: {a: [1}", "line 1: not valid YAML"),
        ("scale: {shards: 0}", "scale.shards: expected a whole number from 1 to 256"),
        ("scale: {replicas: 2}", "scale.replicas: unknown key (known: shards"),
        ("scale: {scrape_interval: 15}", "scale.scrape_interval: expected a Prometheus duration"),
        ("scale: {store_url: vm:8428}", "scale.store_url: expected http(s)://HOST:PORT"),
        ("scale: {targets_file: targets.yml}", "scale.targets_file: expected an absolute path"),
    ],
)
def test_a_bad_config_fails_naming_the_file_and_key_and_writes_nothing(tmp_path, capsys, text, message):
    rc, out = _render(tmp_path, text)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"sidecar deploy-gen: {tmp_path / 'mixin.yaml'}") and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_print_config_is_a_commented_file_that_loads_to_the_defaults(tmp_path, capsys):
    assert cli.main(["deploy-gen", "--print-config"]) == 0
    text = capsys.readouterr().out
    assert text.count("\n  # ") >= len(mixin_config.THRESHOLD_DOCS)
    (tmp_path / "defaults.yaml").write_text(text)
    assert mixin_config.load(tmp_path / "defaults.yaml") == mixin_config.DEFAULT
    (tmp_path / "mixin.yaml").write_text(CONFIG)
    assert cli.main(["deploy-gen", "--config", str(tmp_path / "mixin.yaml"), "--print-config"]) == 0
    (tmp_path / "merged.yaml").write_text(capsys.readouterr().out)
    assert mixin_config.load(tmp_path / "merged.yaml") == mixin_config.load(tmp_path / "mixin.yaml")


def test_config_refuses_to_touch_the_checkouts_generated_files(tmp_path, capsys):
    (tmp_path / "mixin.yaml").write_text(CONFIG)
    for mode in (["--check"], ["--write"]):
        assert cli.main(["deploy-gen", "--config", str(tmp_path / "mixin.yaml"), *mode]) == 2
        assert "give --write DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # one mode at a time
        cli.main(["deploy-gen", "--print-config", "--check"])
    assert e.value.code == 2


def test_relabel_renames_the_cluster_label_only():
    expr = (
        'sum by (cluster, instance) (x{cluster=~"$cluster", job="cluster"}) * on (cluster) group_left (node) y\n'
        "and label_values(z, cluster) and cluster_info"
    )
    assert relabel(expr, "k") == (
        'sum by (k, instance) (x{k=~"$cluster", job="cluster"}) * on (k) group_left (node) y\n'
        "and label_values(z, k) and cluster_info"
    )
    assert relabel(expr, "cluster") == expr


def test_the_generators_ship_in_the_wheel_and_need_no_checkout(tmp_path):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = setuptools.find_packages(str(ROOT), include=project["include"], exclude=project["exclude"])
    assert "sidecar.mixin" in packages
    from sidecar import mixin

    assert Path(mixin.__file__).resolve().parent == ROOT / "sidecar" / "mixin"
    # The checkout's generator wrappers made unimportable: the package renders alone.
    (tmp_path / "mixin.yaml").write_text(CONFIG)
    script = (
        "import sys; sys.modules['alerts'] = sys.modules['dashboards'] = None\n"
        "from sidecar import cli\n"
        "rc = cli.main(['deploy-gen', '--config', 'mixin.yaml', '--write', 'out'])\n"
        "assert 'alerts' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
        "sys.exit(rc)\n"
    )
    out = subprocess.run([PYTHON, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert 'up{job="gpu-sidecars"} == 0' in (tmp_path / "out" / "alerts" / "overlap.rules.yml").read_text()


def test_the_operator_guide_documents_every_setting():
    guide = (ROOT / "docs" / "operator-guide.md").read_text()
    start = guide.index("### Tuning rules and dashboards without a checkout")
    section = guide[start : guide.index("\n### ", start + 4)]
    keys = [
        *(f.name for f in fields(mixin_config.MixinConfig)),
        *mixin_config.THRESHOLD_DOCS,
        *mixin_config.SELECTOR_DOCS,
        *mixin_config.DASHBOARD_DOCS,
        *mixin_config.SCALE_DOCS,
    ]
    assert not [k for k in keys if not re.search(rf"\b{k}\b", section)]


def test_the_operator_guides_table_gives_each_thresholds_default():
    """The table is written by hand: a changed default must change it too."""
    guide = (ROOT / "docs" / "operator-guide.md").read_text()
    rows = {k: v.replace("\\|", "|") for k, v in re.findall(r"^\| `thresholds\.(\w+)` \| `([^`]*)` \|", guide, re.M)}
    stale = {k: (rows.get(k), v) for k, (v, _) in mixin_config.THRESHOLD_DOCS.items() if rows.get(k) != str(v)}
    assert not stale, f"docs/operator-guide.md: threshold defaults (table, config): {stale}"
