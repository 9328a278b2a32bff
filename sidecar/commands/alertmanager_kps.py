"""The sidecar's Alertmanager routing and inhibit rules for kube-prometheus-stack, derived from
deploy/alertmanager/alertmanager.yml (the one source: its route, receivers and inhibit rules):

- `values-sidecar.yaml`: Helm values that put them into the chart's Alertmanager configuration
  (`alertmanager.config`). Helm merges maps key by key and replaces lists, so the three lists this
  sets (`route.routes`, `receivers`, `inhibit_rules`) repeat the chart's own entries
  (CHART_ROUTES, CHART_RECEIVERS, CHART_INHIBIT_RULES) before the sidecar's. The sidecar's routing
  tree is one child route that takes every `Sidecar*` alert.
- `alertmanagerconfig.yaml`: the same as a Prometheus Operator AlertmanagerConfig
  (monitoring.coreos.com/v1alpha1) in the Alertmanager's namespace. The operator adds
  `namespace="<the object's namespace>"` to an AlertmanagerConfig's route and to both sides of its
  inhibit rules, unless the Alertmanager's `alertmanagerConfigMatcherStrategy.type` is
  `OnNamespaceExceptForAlertmanagerNamespace` (operator 0.84+, for objects in the Alertmanager's
  own namespace) or `None` (pkg/alertmanager/amcfg.go, its enforcers). The sidecar's alerts carry
  the training pods' namespace or none, so with that matcher they would match nothing.

`sidecar deploy-gen --write` writes both into deploy/kube-prometheus-stack/; `--check` names them
when stale.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

SOURCE = Path("deploy/alertmanager/alertmanager.yml")
OUTPUT = Path("deploy/kube-prometheus-stack")
VALUES = "values-sidecar.yaml"
ALERTMANAGER_CONFIG = "alertmanagerconfig.yaml"
# Every alert the rules of alerts/ raise is named so (tests/alerts/test_kube_prometheus_stack.py).
SIDECAR_ALERTS = 'alertname=~"Sidecar.*"'
# The namespace of kube-prometheus-stack's Alertmanager as the guide installs it.
ALERTMANAGER_NAMESPACE = "monitoring"

# kube-prometheus-stack's own entries of the lists the values replace: `alertmanager.config` in the
# chart's values.yaml (chart 88.5.3). The Watchdog goes nowhere ("null"); severity inhibition within
# an alert and namespace; InfoInhibitor holds back `severity=info` alerts of a namespace where no
# warning or critical fires: not the sidecar's, which the routing sends to tickets (the one change).
CHART_ROUTES: list[dict[str, Any]] = [{"receiver": "null", "matchers": ['alertname = "Watchdog"']}]
CHART_RECEIVERS: list[dict[str, Any]] = [{"name": "null"}]
CHART_INHIBIT_RULES: list[dict[str, Any]] = [
    {
        "source_matchers": ["severity = critical"],
        "target_matchers": ["severity =~ warning|info"],
        "equal": ["namespace", "alertname"],
    },
    {
        "source_matchers": ["severity = warning"],
        "target_matchers": ["severity = info"],
        "equal": ["namespace", "alertname"],
    },
    {
        "source_matchers": ["alertname = InfoInhibitor"],
        "target_matchers": ["severity = info", 'alertname !~ "Sidecar.*"'],
        "equal": ["namespace"],
    },
    {"target_matchers": ["alertname = InfoInhibitor"]},
]


class SourceError(Exception):
    """alertmanager.yml holds something these files cannot carry; the message names it."""


def _source(root: Path) -> dict:
    doc = yaml.safe_load((root / SOURCE).read_text())
    if not isinstance(doc, dict) or not {"route", "receivers", "inhibit_rules"} <= set(doc):
        raise SourceError(f"{SOURCE}: expected route, receivers and inhibit_rules")
    return doc


def sidecar_route(source: dict) -> dict:
    """alertmanager.yml's routing tree as a child route that takes the sidecar's alerts."""
    return {"matchers": [SIDECAR_ALERTS], **source["route"]}


def values(source: dict) -> dict:
    return {
        "alertmanager": {
            "config": {
                "route": {"routes": [*CHART_ROUTES, sidecar_route(source)]},
                "receivers": [*CHART_RECEIVERS, *source["receivers"]],
                "inhibit_rules": [*CHART_INHIBIT_RULES, *source["inhibit_rules"]],
            }
        }
    }


_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*')
_ROUTE_KEYS = {
    "receiver": "receiver",
    "group_by": "groupBy",
    "group_wait": "groupWait",
    "group_interval": "groupInterval",
    "repeat_interval": "repeatInterval",
    "continue": "continue",
}


def _matcher(text: str, where: str) -> dict:
    m = _MATCHER.fullmatch(text)
    if not m:
        raise SourceError(f'{SOURCE}: {where}: {text!r}: expected name, operator and a quoted value (a="b")')
    value = re.sub(r"\\(.)", r"\1", m[3])
    return {"name": m[1], "value": value, "matchType": m[2]}


def _route(route: dict, where: str) -> dict:
    out: dict[str, Any] = {}
    for key, value in route.items():
        if key in _ROUTE_KEYS:
            out[_ROUTE_KEYS[key]] = value
        elif key == "matchers":
            out["matchers"] = [_matcher(m, f"{where}.matchers") for m in value]
        elif key == "routes":
            out["routes"] = [_route(r, f"{where}.routes[{i}]") for i, r in enumerate(value)]
        else:
            raise SourceError(f"{SOURCE}: {where}.{key}: no AlertmanagerConfig form here (use matchers)")
    return out


def _receiver(receiver: dict) -> dict:
    name = receiver["name"]
    out: dict[str, Any] = {"name": name}
    for key, value in receiver.items():
        if key == "webhook_configs":
            out["webhookConfigs"] = [
                {"url": hook["url"], **({"sendResolved": hook["send_resolved"]} if "send_resolved" in hook else {})}
                for hook in value
            ]
        elif key != "name":
            raise SourceError(
                f"{SOURCE}: receivers[{name}].{key}: only webhook_configs are carried into the AlertmanagerConfig "
                "(other integrations take their secrets from Secrets there)"
            )
    return out


def _inhibit_rule(rule: dict, i: int) -> dict:
    out: dict[str, Any] = {}
    for key, value in rule.items():
        if key in ("source_matchers", "target_matchers"):
            side = "sourceMatch" if key == "source_matchers" else "targetMatch"
            out[side] = [_matcher(m, f"inhibit_rules[{i}].{key}") for m in value]
        elif key == "equal":
            out["equal"] = value
        else:
            raise SourceError(f"{SOURCE}: inhibit_rules[{i}].{key}: no AlertmanagerConfig form here (use *_matchers)")
    return out


def alertmanager_config(source: dict, namespace: str = ALERTMANAGER_NAMESPACE) -> dict:
    route = _route(sidecar_route(source), "route")
    return {
        "apiVersion": "monitoring.coreos.com/v1alpha1",
        "kind": "AlertmanagerConfig",
        "metadata": {
            "name": "training-sidecar",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "training-sidecar", "app.kubernetes.io/component": "alerts"},
        },
        "spec": {
            "route": route,
            "receivers": [_receiver(r) for r in source["receivers"]],
            "inhibitRules": [_inhibit_rule(r, i) for i, r in enumerate(source["inhibit_rules"])],
        },
    }


VALUES_NOTE = f"""\
# kube-prometheus-stack: the sidecar's alert routing and its inhibit rules (one hang, one page) in
# the chart's Alertmanager configuration (docs/operator-guide.md#kube-prometheus-stack-alertmanager):
#   helm upgrade RELEASE prometheus-community/kube-prometheus-stack -n {ALERTMANAGER_NAMESPACE} \\
#     --reuse-values -f {VALUES}
# Helm merges maps key by key but replaces lists: route.routes, receivers and inhibit_rules below
# replace the chart's, so they repeat its defaults first (chart 88.5.3: the Watchdog to "null",
# its severity and InfoInhibitor rules; InfoInhibitor no longer holds back the sidecar's info
# alerts, which go to tickets). Where your own values set any of these three lists, append the
# sidecar's entries (after the first ones) to yours instead of adding this file. Set the
# receivers' URLs (or other integrations) as in alertmanager.yml.
"""

ALERTMANAGER_CONFIG_NOTE = f"""\
# The same routing and inhibit rules as a Prometheus Operator AlertmanagerConfig, for
# kube-prometheus-stack's Alertmanager in `{ALERTMANAGER_NAMESPACE}`
# (docs/operator-guide.md#kube-prometheus-stack-alertmanager). Use it instead of {VALUES},
# not with it. It works only where the operator adds no namespace matcher: set the Alertmanager's
# alertmanagerConfigMatcherStrategy.type to OnNamespaceExceptForAlertmanagerNamespace (Prometheus
# Operator 0.84+, kube-prometheus-stack 76+: Helm value
# alertmanager.alertmanagerSpec.alertmanagerConfigMatcherStrategy) and keep this object in the
# Alertmanager's namespace, or to None. With the default, OnNamespace, the operator adds
# namespace="{ALERTMANAGER_NAMESPACE}" to its route and inhibit rules, which the sidecar's alerts (the
# training pods' namespace, or none) never carry: nothing is routed or inhibited. The operator
# names the receivers {ALERTMANAGER_NAMESPACE}/training-sidecar/<name> and continues past the
# route, so a catch-all route of your own notifies the sidecar's alerts too.
"""


def generate(root: Path) -> dict[str, tuple[dict, str]]:
    """{file name: (object, note)} for deploy/kube-prometheus-stack/; none without alertmanager.yml."""
    if not (root / SOURCE).is_file():
        return {}
    source = _source(root)
    return {
        VALUES: (values(source), VALUES_NOTE),
        ALERTMANAGER_CONFIG: (alertmanager_config(source), ALERTMANAGER_CONFIG_NOTE),
    }
