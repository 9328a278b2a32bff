"""The dashboards' building blocks: panels, variables and the dashboard around them, and the
selectors every panel uses.

Panels select with the template variables `$cluster` and `$namespace` (kube-prometheus-stack's
conventions), `$job_id`, `$instance` (the node), `$rank`, `$gpu` and `$device`, and query the
`${datasource}` variable (any Prometheus). Every selector names `$cluster` (the label a
multi-cluster setup adds, Thanos/Mimir external labels, `cluster_label` in the config; its All
value also matches series without it, as on a single cluster). `$namespace` is the training pods'
namespace: every selector of a job's series names it (they carry it,
docs/operator-guide.md#pod-labels; a job id may repeat in another namespace), and the node's
series, which carry none, are picked by a `$instance` (and `$gpu`) whose query names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sidecar.mixin.config import MixinConfig
from sidecar.mixin.promql import relabel

SCHEMA_VERSION = 39
DS = {"type": "prometheus", "uid": "${datasource}"}

# Selectors used throughout: one place to change how a cluster, job, node, rank or GPU is picked.
CLUSTER = 'cluster=~"$cluster"'
NAMESPACE = 'namespace=~"$namespace"'
# A job is its id in its namespace: every series labelled job_id carries the namespace (the ranks'
# pod labels, the job's own series, the recording rules'), and ids repeat across teams.
JOB = f'{CLUSTER}, {NAMESPACE}, job_id="$job_id"'
NODES = 'instance=~"$instance"'
RANKS = f'{JOB}, {NODES}, rank=~"$rank"'
NODE = f'{CLUSTER}, instance="$instance"'
GPUS = f'{NODE}, gpu=~"$gpu"'
RANK = f'{JOB}, rank="$rank"'


# ------------------------------------------------------------------ building blocks


def target(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> dict:
    t = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ref, "range": not instant}
    if instant:
        t["instant"] = True
        t["format"] = "table"
    return t


def _targets(queries: list[tuple[str, str]] | str, instant: bool = False) -> list[dict]:
    if isinstance(queries, str):
        queries = [(queries, "")]
    return [target(q, legend, chr(ord("A") + i), instant) for i, (q, legend) in enumerate(queries)]


def _thresholds(steps: list[tuple[float | None, str]]) -> dict:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


def timeseries(
    title: str,
    queries,
    unit: str = "short",
    description: str = "",
    *,
    w: int = 12,
    h: int = 8,
    min_: float | None = None,
    max_: float | None = None,
    stack: bool = False,
    bars: bool = False,
    threshold: float | None = None,
) -> dict:
    custom: dict[str, Any] = {
        "drawStyle": "bars" if bars else "line",
        "lineWidth": 1,
        "fillOpacity": 10,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
    }
    defaults: dict[str, Any] = {"unit": unit, "custom": custom, "color": {"mode": "palette-classic"}}
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    if threshold is not None:
        custom["thresholdsStyle"] = {"mode": "dashed"}
        defaults["thresholds"] = _thresholds([(None, "transparent"), (threshold, "red")])
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _targets(queries),
        "_size": (w, h),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(
    title: str,
    query: str,
    unit: str = "short",
    description: str = "",
    *,
    w: int = 4,
    h: int = 4,
    steps: list[tuple[float | None, str]] | None = None,
) -> dict:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _targets(query),
        "_size": (w, h),
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "color": {"mode": "thresholds"},
                "thresholds": _thresholds(steps or [(None, "green")]),
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background" if steps else "value",
            "graphMode": "none",
            "textMode": "auto",
            "justifyMode": "auto",
            "orientation": "auto",
        },
    }


def table(title: str, query: str, description: str = "", *, w: int = 12, h: int = 8) -> dict:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _targets(query, instant=True),
        "_size": (w, h),
        "fieldConfig": {"defaults": {}, "overrides": []},
        "transformations": [
            {
                "id": "organize",
                "options": {"excludeByName": {"Time": True, "Value": True, "__name__": True, "job": True}},
            }
        ],
        "options": {"showHeader": True},
    }


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "_size": (24, 1)}


def layout(panels: list[dict]) -> list[dict]:
    """Give every panel an id and a gridPos, filling rows of 24 columns left to right."""
    x = y = row_h = 0
    out = []
    for i, p in enumerate(panels, start=1):
        w, h = p.pop("_size")
        if p["type"] == "row" or x + w > 24:
            x, y, row_h = 0, y + row_h, 0
        p["id"] = i
        p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
        x += w
        row_h = max(row_h, h)
        if p["type"] == "row":
            x, y, row_h = 0, y + h, 0
        out.append(p)
    return out


def query_var(
    name: str, label: str, query: str, *, multi: bool = False, include_all: bool = False, hide: int = 0
) -> dict:
    v = {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DS,
        "hide": hide,
        "definition": query,
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery", "qryType": 1},
        "refresh": 2,
        "sort": 3 if name in ("rank", "gpu") else 1,
        "regex": "",
        "multi": multi,
        "includeAll": include_all,
        "current": {},
        "options": [],
    }
    if include_all:
        v["allValue"] = ".*"
    return v


def cluster_var() -> dict:
    """Every cluster's sidecars by default: All also matches series without a `cluster` label."""
    return query_var("cluster", "Cluster", "label_values(sidecar_build_info, cluster)", include_all=True)


def namespace_var() -> dict:
    """The training pods' namespaces (the ranks' pod labels); All also matches ranks outside Kubernetes."""
    return query_var(
        "namespace", "Namespace", f"label_values(sidecar_rank_state{{{CLUSTER}}}, namespace)", include_all=True
    )


def job_var(include_all: bool = False) -> dict:
    """The jobs with ranks in the chosen cluster and namespace."""
    return query_var(
        "job_id",
        "Job",
        f"label_values(sidecar_rank_state{{{CLUSTER}, {NAMESPACE}}}, job_id)",
        include_all=include_all,
    )


DATASOURCE_VAR = {
    "type": "datasource",
    "name": "datasource",
    "label": "Data source",
    "query": "prometheus",
    "hide": 0,
    "refresh": 1,
    "regex": "",
    "current": {},
    "options": [],
}

BUILTIN_ANNOTATIONS = {
    "builtIn": 1,
    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
    "enable": True,
    "hide": True,
    "iconColor": "rgba(0, 211, 255, 1)",
    "name": "Annotations & Alerts",
    "type": "dashboard",
}


def annotation(name: str, expr: str, color: str, title: str, text: str) -> dict:
    return {
        "name": name,
        "datasource": DS,
        "enable": True,
        "hide": False,
        "iconColor": color,
        "expr": expr,
        "step": "30s",
        "titleFormat": title,
        "textFormat": text,
        "tagKeys": "instance",
        "useValueForTime": False,
    }


def _relabelled(node: Any, cluster_label: str) -> Any:
    """Every query of a dashboard (`expr`, a variable's `definition` and `query`) with the cluster
    label named `cluster_label`."""
    if isinstance(node, dict):
        return {
            k: relabel(v, cluster_label)
            if k in ("expr", "definition", "query") and isinstance(v, str)
            else _relabelled(v, cluster_label)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_relabelled(v, cluster_label) for v in node]
    return node


def dashboard(
    cfg: MixinConfig,
    uid: str,
    title: str,
    description: str,
    variables: list[dict],
    panels: list[dict],
    annotations: Sequence[dict] = (),
) -> dict:
    tags = list(cfg.dashboards.tags)
    board = {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": tags,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": cfg.dashboards.time_from, "to": "now"},
        "refresh": cfg.dashboards.refresh,
        "timezone": "",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "timepicker": {},
        "links": [
            {
                "type": "dashboards",
                "tags": tags,
                "asDropdown": True,
                "title": "Sidecar",
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "templating": {"list": [{**DATASOURCE_VAR, "regex": cfg.dashboards.datasource_regex}, *variables]},
        "annotations": {"list": [BUILTIN_ANNOTATIONS, *annotations]},
        "panels": layout(panels),
    }
    return _relabelled(board, cfg.cluster_label)
