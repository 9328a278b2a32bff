"""Which rules may run on a scraping shard and which only where every node is visible (the global
ruler), for clusters scraped by several Prometheus servers or agents (docs/operator-guide.md,
"Past one Prometheus").

A rule is per node when its answer for a node depends only on that node's series: every
aggregation keeps `instance` (`by (..., instance, ...)`), every vector match joins `on` it, it calls
no function that judges the absence of a series (`absent`, `absent_over_time`) or turns a vector
into one number (`scalar`), and every recorded series it reads is itself per node. Everything else
is job- or cluster-level and runs at the global ruler; so does a rule that is per node but reads
nothing but the output of a job-level rule (none do today). The test of this module re-checks every
per-node rule's expression on its own.

`split(groups)` keeps each group's order (a group evaluates its rules in turn, and a later rule
reads the records of an earlier one), giving each group a `-global` and a `-node` part.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from sidecar.mixin.promql import Alert, Group, Record

NODE_LABEL = "instance"
AGGREGATIONS = (
    "sum",
    "avg",
    "max",
    "min",
    "count",
    "group",
    "quantile",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "count_values",
)
# An aggregation (`max by (a, b) (`, `max without (a) (`, or bare `max(`); `max_over_time(` and
# other per-series functions do not match (the name must end there).
_AGGREGATION = re.compile(r"\b(" + "|".join(AGGREGATIONS) + r")\s*(?:(by|without)\s*\(([^()]*)\)\s*)?\(")
# A vector match's label list; `group_left (node)` and `group_right ()` only name copied labels.
_MATCHING = re.compile(r"\b(on|ignoring)\s*\(([^()]*)\)")
_WHOLE_VECTOR = re.compile(r"\b(absent|absent_over_time|scalar)\s*\(")
_NAME = re.compile(r"(?<![\w{\"'])([a-zA-Z_:][a-zA-Z0-9_:]*)")


def _labels(text: str) -> set[str]:
    return {label.strip() for label in text.split(",") if label.strip()}


def not_per_node(expr: str) -> str | None:
    """Why `expr` may judge more than one node at a time, or None when every result is one node's."""
    for m in _AGGREGATION.finditer(expr):
        name, how, labels = m[1], m[2], _labels(m[3] or "")
        if how is None:
            return f"`{name}(...)` aggregates every node into one"
        if how == "by" and NODE_LABEL not in labels:
            return f"`{name} by ({m[3].strip()})` aggregates across nodes"
        if how == "without" and NODE_LABEL in labels:
            return f"`{name} without ({m[3].strip()})` drops the node"
    for m in _MATCHING.finditer(expr):
        labels = _labels(m[2])
        if (m[1] == "on") != (NODE_LABEL in labels):
            return f"`{m[1]} ({m[2].strip()})` matches series of different nodes"
    whole = _WHOLE_VECTOR.search(expr)
    if whole:
        return f"`{whole[1]}` judges every node's series at once"
    return None


def reads(expr: str, records: Iterable[str]) -> set[str]:
    """The recorded series among `records` that `expr` reads."""
    names = {m[1] for m in _NAME.finditer(expr)}
    return names & set(records)


def global_rules(groups: list[Group]) -> set[str]:
    """The names (record or alert) of the rules that must run at the global ruler."""
    rules = [r for g in groups for r in g.rules]
    recorded = {r.record for r in rules if isinstance(r, Record)}
    out = {_name(r) for r in rules if not_per_node(r.expr)}
    changed = True
    while changed:  # a rule that reads a global record is global too
        changed = False
        for r in rules:
            if _name(r) not in out and reads(r.expr, recorded) & out:
                out.add(_name(r))
                changed = True
    return out


def _name(rule: Alert | Record) -> str:
    return rule.record if isinstance(rule, Record) else rule.name


def split(groups: list[Group]) -> tuple[list[Group], list[Group]]:
    """(the global ruler's groups, the shards' groups), each group's rules in their order; empty parts
    are left out."""
    judged = global_rules(groups)
    at_global, at_shard = [], []
    for g in groups:
        top = [r for r in g.rules if _name(r) in judged]
        node = [r for r in g.rules if _name(r) not in judged]
        if top:
            at_global.append(Group(f"{g.name}-global", top))
        if node:
            at_shard.append(Group(f"{g.name}-node", node))
    return at_global, at_shard
