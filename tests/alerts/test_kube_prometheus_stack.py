"""One hang, one page with kube-prometheus-stack's Alertmanager. The sidecar's routing and inhibit
rules reach it two ways (deploy/kube-prometheus-stack/, generated from
deploy/alertmanager/alertmanager.yml):

- values-sidecar.yaml, merged by Helm into the chart's `alertmanager.config`. The merge is Helm's
  (maps key by key, lists and scalars replaced) onto the chart's default `alertmanager.config`
  (fixtures/kube-prometheus-stack-alertmanager-config.yaml, verbatim from the chart); the result is
  what the chart writes into the Alertmanager's Secret: amtool checks it, and a real Alertmanager
  sends one notification per hung job;
- alertmanagerconfig.yaml, an AlertmanagerConfig object: valid for the CRD's schema
  (fixtures/alertmanagerconfig-v1alpha1-spec.schema.yaml), and added to the chart's default
  configuration as the Prometheus Operator adds it (operator_amcfg.py follows its code; no operator
  runs here): one page per hang with the matcher strategy the file asks for, no page at all with
  the operator's default strategy.
"""

from __future__ import annotations

import contextlib
import copy
import subprocess
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import yaml

from alerts import build
from tests.alerts import operator_amcfg
from tests.alerts.realstack import Alertmanager, Webhook
from tests.alerts.test_alertmanager import expected_receiver
from tests.alerts.test_inhibition import POSTED, alert, delivered, hang, short_timings
from tests.support import ROOT

pytestmark = pytest.mark.system

FIXTURES = Path(__file__).parent / "fixtures"
CHART_CONFIG = yaml.safe_load((FIXTURES / "kube-prometheus-stack-alertmanager-config.yaml").read_text())
CRD_SPEC_SCHEMA = yaml.safe_load((FIXTURES / "alertmanagerconfig-v1alpha1-spec.schema.yaml").read_text())
KPS = ROOT / "deploy" / "kube-prometheus-stack"
VALUES = yaml.safe_load((KPS / "values-sidecar.yaml").read_text())
ALERTMANAGER_CONFIG = yaml.safe_load((KPS / "alertmanagerconfig.yaml").read_text())
ALERTMANAGER_NAMESPACE = "monitoring"  # kube-prometheus-stack's release namespace in the guide
AMTOOL = "/usr/bin/amtool"


def helm_merge(chart: dict, user: dict) -> dict:
    """User-supplied values over a chart's, as Helm coalesces them (helm.sh/helm/v3/pkg/chartutil,
    coalesce.go): a map merges into the chart's map key by key; any other value, a list too,
    replaces the chart's; null removes the key."""
    out = copy.deepcopy(chart)
    for key, value in user.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = helm_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def merged_config() -> dict:
    """The Alertmanager configuration the chart writes with values-sidecar.yaml added."""
    return helm_merge({"alertmanager": {"config": CHART_CONFIG}}, VALUES)["alertmanager"]["config"]


def operator_config(strategy: str) -> dict:
    """The chart's configuration with alertmanagerconfig.yaml added by the operator."""
    return operator_amcfg.apply(CHART_CONFIG, ALERTMANAGER_CONFIG, strategy, ALERTMANAGER_NAMESPACE)


def _written(config: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _amtool(*args: str) -> str:
    out = subprocess.run([AMTOOL, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip()


@contextlib.contextmanager
def alertmanager(workdir: Path, config: dict) -> Iterator[tuple[Alertmanager, Webhook]]:
    """A real Alertmanager with `config`, every receiver's webhook pointed at the test's
    (/<receiver name without the operator's namespace/name prefix>), timings shortened."""
    config = copy.deepcopy(config)
    with contextlib.ExitStack() as stack:
        webhook = stack.enter_context(Webhook())
        for receiver in config["receivers"]:
            for hook in receiver.get("webhook_configs", []):
                hook["url"] = f"{webhook.url}/{receiver['name'].rsplit('/', 1)[-1]}"
        short_timings(config["route"], *POSTED)
        am = stack.enter_context(Alertmanager(workdir, config).running())
        yield am, webhook


# ---------------------------------------------------------------- values-sidecar.yaml


def test_the_merged_configuration_passes_amtool(tmp_path):
    _amtool("check-config", str(_written(merged_config(), tmp_path / "alertmanager.yaml")))


def test_the_merged_configuration_keeps_the_charts_own_settings_and_entries():
    merged = merged_config()
    assert merged["global"] == CHART_CONFIG["global"] and merged["templates"] == CHART_CONFIG["templates"]
    root = {k: v for k, v in merged["route"].items() if k != "routes"}
    assert root == {k: v for k, v in CHART_CONFIG["route"].items() if k != "routes"}
    assert merged["route"]["routes"][: len(CHART_CONFIG["route"]["routes"])] == CHART_CONFIG["route"]["routes"]
    assert merged["receivers"][: len(CHART_CONFIG["receivers"])] == CHART_CONFIG["receivers"]
    # The chart's inhibit rules, the InfoInhibitor's narrowed to leave the sidecar's info alerts alone.
    chart_rules = copy.deepcopy(CHART_CONFIG["inhibit_rules"])
    (info,) = [r for r in chart_rules if r.get("source_matchers") == ["alertname = InfoInhibitor"]]
    info["target_matchers"].append('alertname !~ "Sidecar.*"')
    assert merged["inhibit_rules"][: len(chart_rules)] == chart_rules
    source = yaml.safe_load((ROOT / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    assert merged["inhibit_rules"][len(chart_rules) :] == source["inhibit_rules"]


def test_every_shipped_alert_reaches_its_receiver_through_the_merged_configuration(tmp_path):
    config = _written(merged_config(), tmp_path / "alertmanager.yaml")
    for a in build.all_alerts():
        labels = [f"severity={a.severity}", f"alertname={a.name}", "namespace=team-a", "job_id=j1"]
        got = _amtool("config", "routes", "test", f"--config.file={config}", *labels)
        assert got == expected_receiver(a), a.name
    assert _amtool("config", "routes", "test", f"--config.file={config}", "alertname=Watchdog") == "null"


def test_one_hung_job_pages_once_through_the_merged_configuration(tmp_path):
    with alertmanager(tmp_path, merged_config()) as (am, webhook):
        am.post(hang("j1") + hang("j2", namespace="team-b"))
        got = delivered(webhook, 2)
        assert sorted((r, names, g.get("namespace"), g["job_id"]) for r, names, g in got) == [
            ("pager", ["SidecarJobHungOnRank"], "team-a", "j1"),
            ("pager", ["SidecarJobHungOnRank"], "team-b", "j2"),
        ]


def test_the_sidecars_info_alerts_reach_tickets_while_the_charts_info_inhibitor_fires(tmp_path):
    """kube-prometheus-stack's InfoInhibitor fires in a namespace whose only alerts are info ones,
    and holds them back; the sidecar's routing sends its info alerts to tickets."""
    with alertmanager(tmp_path, merged_config()) as (am, webhook):
        am.post(
            [
                alert("InfoInhibitor", "none", namespace="team-a"),
                alert("SidecarHooksDroppingRecords", "info", namespace="team-a", job_id="j1", instance="n0", rank="0"),
            ]
        )
        assert [(r, names) for r, names, _ in delivered(webhook, 1)] == [("ticket", ["SidecarHooksDroppingRecords"])]


# ---------------------------------------------------------------- alertmanagerconfig.yaml


def _strict(schema: dict) -> dict:
    """The schema refusing unknown fields, as `kubectl apply --validate=strict` does (the API
    server would drop them silently otherwise)."""
    out = {k: _strict(v) if isinstance(v, dict) else v for k, v in schema.items()}
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        if not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


def test_the_alertmanagerconfig_is_valid_for_the_crd_schema():
    obj = ALERTMANAGER_CONFIG
    assert (obj["apiVersion"], obj["kind"]) == ("monitoring.coreos.com/v1alpha1", "AlertmanagerConfig")
    assert obj["metadata"]["namespace"] == ALERTMANAGER_NAMESPACE
    schema = _strict(CRD_SPEC_SCHEMA)
    jsonschema.validate(obj["spec"], schema)
    # Child routes are kept as raw JSON by the CRD and decoded by the operator as routes, unknown
    # fields refused (Route.ChildRoutes): the route's own schema, at every depth.
    route_schema = schema["properties"]["route"]
    pending = list(obj["spec"]["route"].get("routes", []))
    while pending:
        child = pending.pop()
        jsonschema.validate(child, route_schema)
        pending += child.get("routes", [])
    names = {r["name"] for r in obj["spec"]["receivers"]}

    def receivers(route: dict) -> set[str]:
        return {route["receiver"]} | set().union(*(receivers(r) for r in route.get("routes", [])))

    assert receivers(obj["spec"]["route"]) <= names


@pytest.mark.parametrize("strategy", ["OnNamespaceExceptForAlertmanagerNamespace", "None"])
def test_with_the_matcher_strategy_it_asks_for_one_hung_job_pages_once(tmp_path, strategy):
    config = operator_config(strategy)
    _amtool("check-config", str(_written(config, tmp_path / "alertmanager.yaml")))
    with alertmanager(tmp_path / "am", config) as (am, webhook):
        am.post(hang("j1") + hang("j2", namespace="team-b"))
        got = delivered(webhook, 2)
        assert sorted((r, names, g.get("namespace"), g["job_id"]) for r, names, g in got) == [
            ("pager", ["SidecarJobHungOnRank"], "team-a", "j1"),
            ("pager", ["SidecarJobHungOnRank"], "team-b", "j2"),
        ]


def test_with_the_operators_default_matcher_strategy_it_pages_nobody(tmp_path):
    """OnNamespace: its route and inhibit rules ask for namespace="monitoring", which the sidecar's
    alerts (the training pods' namespace, or none) never carry: they fall to the chart's root route
    and its receiver "null". Why the file asks for another strategy."""
    config = operator_config("OnNamespace")
    _amtool("check-config", str(_written(config, tmp_path / "alertmanager.yaml")))
    with alertmanager(tmp_path / "am", config) as (am, webhook):
        am.post(hang("j1"))
        assert delivered(webhook, 0) == []
