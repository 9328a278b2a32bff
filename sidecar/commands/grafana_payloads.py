"""What `sidecar provision` sends to Grafana, built from the shipped files: dashboards with
our datasource, and Grafana-managed alert rules translated from the Prometheus rule files.
Pure functions of their inputs (no HTTP): `sidecar/commands/provision.py` compares and writes them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

RULE_UID_PREFIX = "sidecar-"
EXPR_DATASOURCE = "__expr__"


class UsageError(Exception):
    """Bad flags or environment: exit status 2."""


class ProvisionError(Exception):
    """Grafana refused, failed or could not be reached: exit status 1. One line."""


# ------------------------------------------------------------------ sources


def load_dashboards(directory: Path) -> list[dict]:
    paths = sorted(Path(directory).glob("*.json"))
    if not paths:
        raise UsageError(f"no dashboards (*.json) in {directory}")
    out = []
    for p in paths:
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read dashboard {p}: {e}") from None
        if not isinstance(d, dict) or not d.get("uid") or not d.get("title"):
            raise UsageError(f"dashboard {p} needs a uid and a title")
        out.append(d)
    return out


def rule_files(directory: Path) -> list[Path]:
    paths = sorted(Path(directory).glob("*.rules.yml"))
    if not paths:
        raise UsageError(f"no rule files (*.rules.yml) in {directory}")
    return paths


def load_rule_groups(directory: Path, gpu_source: str | None = None) -> list[dict]:
    """Every Prometheus rule group of the directory's rule files, in file order; with
    `gpu_source`, first the recording rules of that GPU source (gpu-source/<source>.rules.yml)."""
    groups = []
    paths = rule_files(directory)
    if gpu_source is not None:
        source = Path(directory) / "gpu-source" / f"{gpu_source}.rules.yml"
        if not source.is_file():
            raise UsageError(f"no rule file for GPU source {gpu_source!r}: {source}")
        paths.insert(0, source)
    for p in paths:
        try:
            doc = yaml.safe_load(p.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise UsageError(f"cannot read rule file {p}: {e}") from None
        groups.extend(doc.get("groups", []))
    return groups


# ------------------------------------------------------------------ Prometheus rule -> Grafana rule


def rule_uid(alertname: str) -> str:
    """A stable Grafana uid from the alert name: SidecarRankStalled -> sidecar-rank-stalled."""
    base = re.sub(r"^Sidecar", "", alertname)
    kebab = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "-", base).lower()
    uid = (RULE_UID_PREFIX + kebab)[:40]
    return uid


def grafana_rule(rule: dict, group: str, folder_uid: str, datasource_uid: str) -> dict:
    """A Prometheus alerting rule as a Grafana-managed rule (the provisioning API's shape).

    A Prometheus alert fires for every series its expression returns, whatever the value (an
    `lr == 0` alert returns 0s). Grafana fires on a condition's value, so query A counts each
    returned series as 1 (`count without ()` keeps every label), B reduces it to the last
    value and C fires when that is above 0. No series means OK, as in Prometheus.
    """
    expr = f"count without () (\n{rule['expr'].strip()}\n)"
    return {
        "uid": rule_uid(rule["alert"]),
        "orgID": 1,
        "folderUID": folder_uid,
        "ruleGroup": group,
        "title": rule["alert"],
        "condition": "C",
        "data": [
            {
                "refId": "A",
                "queryType": "",
                "relativeTimeRange": {"from": 600, "to": 0},
                "datasourceUid": datasource_uid,
                "model": {
                    "refId": "A",
                    "expr": expr,
                    "instant": True,
                    "range": False,
                    "editorMode": "code",
                    "legendFormat": "__auto",
                },
            },
            {
                "refId": "B",
                "queryType": "",
                "relativeTimeRange": {"from": 0, "to": 0},
                "datasourceUid": EXPR_DATASOURCE,
                "model": {
                    "refId": "B",
                    "type": "reduce",
                    "expression": "A",
                    "reducer": "last",
                    "datasource": {"type": EXPR_DATASOURCE, "uid": EXPR_DATASOURCE},
                },
            },
            {
                "refId": "C",
                "queryType": "",
                "relativeTimeRange": {"from": 0, "to": 0},
                "datasourceUid": EXPR_DATASOURCE,
                "model": {
                    "refId": "C",
                    "type": "threshold",
                    "expression": "B",
                    "conditions": [{"evaluator": {"type": "gt", "params": [0]}}],
                    "datasource": {"type": EXPR_DATASOURCE, "uid": EXPR_DATASOURCE},
                },
            },
        ],
        "noDataState": "OK",
        "execErrState": "Error",
        "for": rule.get("for", "0s"),
        "labels": dict(rule.get("labels", {})),
        "annotations": dict(rule.get("annotations", {})),
        "isPaused": False,
    }


def grafana_rules(groups: list[dict], folder_uid: str, datasource_uid: str) -> list[dict]:
    rules = [
        grafana_rule(r, g["name"], folder_uid, datasource_uid)
        for g in groups
        for r in g.get("rules", [])
        if "alert" in r
    ]
    uids = [r["uid"] for r in rules]
    duplicates = sorted({u for u in uids if uids.count(u) > 1})
    if duplicates:
        raise UsageError(f"alert names map to the same Grafana uid: {', '.join(duplicates)}")
    return rules


# The API's placement of a rule, which Grafana's alerting provisioning file sets per group instead.
_API_PLACEMENT = ("orgID", "folderUID", "ruleGroup")
DEFAULT_GROUP_INTERVAL = "1m"


def grafana_alerting_file(groups: list[dict], folder_uid: str, folder_title: str, datasource_uid: str) -> dict:
    """The same Grafana-managed rules as the API path creates, as a Grafana alerting provisioning
    file (provisioning/alerting/*.yaml: apiVersion 1, groups with a folder title, an interval
    and their rules)."""
    by_group: dict[str, list[dict]] = {}
    for rule in grafana_rules(groups, folder_uid, datasource_uid):
        by_group.setdefault(rule["ruleGroup"], []).append({k: v for k, v in rule.items() if k not in _API_PLACEMENT})
    intervals = {g["name"]: g.get("interval", DEFAULT_GROUP_INTERVAL) for g in groups}
    return {
        "apiVersion": 1,
        "groups": [
            {"orgId": 1, "name": name, "folder": folder_title, "interval": intervals[name], "rules": rules}
            for name, rules in by_group.items()
        ],
    }


def recording_groups(groups: list[dict]) -> list[dict]:
    """The rule groups without their alerting rules (groups left empty are dropped): what
    Prometheus still evaluates when Grafana owns the alerts."""
    out = []
    for g in groups:
        records = [r for r in g.get("rules", []) if "record" in r]
        if records:
            out.append({**g, "rules": records})
    return out


def with_datasource(dashboard: dict, uid: str, name: str) -> dict:
    """The dashboard with its `datasource` variable preselecting the provisioned datasource
    (otherwise Grafana shows the default datasource, which may be another Prometheus)."""
    out = json.loads(json.dumps(dashboard))
    for var in out.get("templating", {}).get("list", []):
        if var.get("type") == "datasource":
            var["current"] = {"selected": True, "text": name, "value": uid}
    return out


def datasource_payload(uid: str, name: str, url: str) -> dict:
    return {
        "uid": uid,
        "name": name,
        "type": "prometheus",
        "access": "proxy",
        "url": url,
        "isDefault": False,
        "jsonData": {"httpMethod": "POST", "timeInterval": "15s"},
    }


def contains(actual: Any, wanted: Any) -> bool:
    """True when `actual` holds everything of `wanted` (Grafana adds fields of its own)."""
    if isinstance(wanted, dict):
        return isinstance(actual, dict) and all(k in actual and contains(actual[k], v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(wanted)
            and all(contains(a, w) for a, w in zip(actual, wanted, strict=True))
        )
    return actual == wanted


# ------------------------------------------------------------------ talking to Grafana
