"""The rules' building blocks: `Alert`, `Record` and `Group`, PromQL helpers and the series names
several rule groups share, and the rendering of a rule file.

Every alert carries `labels.severity` (critical pages, warning and info open tickets, see
deploy/alertmanager/alertmanager.yml) and the annotations `summary`, `description` and
`runbook_url` (a section of docs/runbook.md named after the alert).

Label conventions: `job_id` is the training job, `rank` the rank, `gpu` the GPU index,
`device`/`port` a NIC or InfiniBand port; `instance` (from the scrape target) is the node.
Alerts aggregate `by` the labels that name what is broken, so they do not depend on the
scrape job's name or extra target labels.

Tenant and cluster: job ids repeat across namespaces and clusters, so every rule about a job
aggregates and joins by `namespace, cluster, job_id`, and every rule about a node or its
hardware by `cluster, instance` (a node belongs to the platform, not to a tenant).
`by` keeps a label only where the series carry it: `cluster` where a multi-cluster setup adds
it (Thanos/Mimir external labels, a ruler that sees it; `cluster_label` in the config names it
otherwise, `relabel`), `namespace` on the rank series in Kubernetes
(docs/operator-guide.md#pod-labels). The sidecar's job-level series (no `rank`:
`sidecar_training_world_size`, `sidecar_job_failures_total`, ...) carry the job's `namespace`
where its ranks on the node name one (sidecar/ranks/podlabels.py), so joins with them match `on
(namespace, cluster, job_id)` and alerts built on them alone keep the tenant too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import yaml


@dataclass
class Alert:
    name: str
    expr: str
    severity: str
    summary: str
    description: str
    for_: str = "0m"

    def rule(self, runbook_base_url: str, for_override: str | None, cluster_label: str = "cluster") -> dict:
        assert self.severity in ("critical", "warning", "info"), self.name
        return {
            "alert": self.name,
            "expr": relabel(_clean(self.expr), cluster_label),
            "for": for_override if for_override is not None else self.for_,
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook_url": f"{runbook_base_url}#{self.name.lower()}",
            },
        }


@dataclass
class Record:
    record: str
    expr: str
    labels: dict[str, str] = field(default_factory=dict)

    def rule(self, _url: object = None, _for: object = None, cluster_label: str = "cluster") -> dict:
        out = {"record": self.record, "expr": relabel(_clean(self.expr), cluster_label)}
        return {**out, "labels": self.labels} if self.labels else out


@dataclass
class Group:
    name: str
    rules: list = field(default_factory=list)


def _clean(expr: str) -> str:
    return "\n".join(line.rstrip() for line in expr.strip().splitlines())


def indent(expr: str, spaces: int) -> str:
    """A multi-line expression inside parentheses: its lines after the first indented."""
    return ("\n" + " " * spaces).join(expr.splitlines())


def increased(selector: str, window: str, by: str) -> str:
    """A counter went up within `window`. `increase` alone misses a series that first appears
    already at 1 (an XID the collector has never seen before), so a series that is new and
    non-zero counts as well."""
    return (
        f"sum by ({by}) (increase({selector}[{window}])) > 0\n"
        f"or sum by ({by}) ({selector} > 0 unless {selector} offset {window})"
    )


def counted(selector: str, window: str) -> str:
    """How much each series of a counter grew within `window`, one result per series: `increase`
    for a series that existed `window` ago, its highest value for one that is newer (a counter
    created at its first event, 1, grew by 1: `increase` alone would miss that first event)."""
    return (
        f"(\n  increase({selector}[{window}]) and {selector} offset {window}\n"
        f"  or max_over_time({selector}[{window}])\n)"
    )


# Label lists (`by (...)`, `on (...)`, ...), matchers (`cluster=~"..."`) and `label_values(..., cluster)`.
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)(\s*)\(([^()]*)\)")
_MATCHER = re.compile(r"(?<![\w$.])cluster(\s*(?:=~|!~|!=|=)\s*\")")
_WORD = re.compile(r"(?<![\w$])cluster(?!\w)")
_LABEL_VALUES = re.compile(r"(label_values\([^()]*?,\s*)cluster(\s*\))")


def relabel(expr: str, cluster_label: str) -> str:
    """`expr` with the label `cluster` named `cluster_label` (the label a multi-cluster setup adds,
    under its own name): in label lists, matchers and `label_values`. Metric names, strings and
    Grafana's `$cluster` variable are left alone."""
    if cluster_label == "cluster":
        return expr
    expr = _LABEL_LIST.sub(lambda m: f"{m[1]}{m[2]}({_WORD.sub(cluster_label, m[3])})", expr)
    expr = _MATCHER.sub(lambda m: cluster_label + m[1], expr)
    return _LABEL_VALUES.sub(lambda m: m[1] + cluster_label + m[2], expr)


# Series and phrases several groups share.
LABELS_RANK = "{{ $labels.job_id }} rank {{ $labels.rank }} on {{ $labels.instance }}"
LABELS_GPU = "GPU {{ $labels.gpu }} on {{ $labels.instance }}"
# The ranks' collective records (PyTorch's Flight Recorder, per rank and process group `pg`).
ENQUEUED = "sidecar_rank_collective_enqueued_seq"
COMPLETED = "sidecar_rank_collective_completed_seq"
FALSE_ALARMS = "sidecar_watchdog_false_alarms_total"
NOT_PROGRESSING = 'sidecar_rank_state{state=~"suspect|stalled|remediating"} == 1'
NODE = "max by (cluster, instance, node) (sidecar_node_info)"


# ------------------------------------------------------------------ rendering


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)

HEADER = "# Generated by alerts/build.py: edit that file, then run `python -m alerts.build`.\n"
# The header of a rendering with an operator's settings (not the defaults).
CONFIGURED_HEADER = "# Generated by `sidecar deploy-gen --config FILE`: edit FILE, then render again.\n"


def render(
    groups: list[Group],
    runbook_base_url: str,
    for_override: str | None = None,
    cluster_label: str = "cluster",
    header: str = HEADER,
) -> str:
    """One rule file (Prometheus's format) of `groups`."""
    doc = {
        "groups": [
            {"name": g.name, "rules": [r.rule(runbook_base_url, for_override, cluster_label) for r in g.rules]}
            for g in groups
        ]
    }
    return header + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)
