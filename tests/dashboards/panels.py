"""Reading the dashboards the way Grafana does: every panel's queries with the template
variables replaced by concrete values."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from tests.support import ROOT

DASHBOARD_FILES = sorted((ROOT / "dashboards").glob("*.json"))

# What Grafana substitutes for its built-in interval variables.
BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(where, expr) for every panel target, annotation and variable query."""
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            yield f"{dashboard['uid']}: panel {panel['title']!r} {t['refId']}", t["expr"]
    for ann in dashboard["annotations"]["list"]:
        if "expr" in ann:
            yield f"{dashboard['uid']}: annotation {ann['name']!r}", ann["expr"]


def variable_queries(dashboard: dict) -> Iterator[tuple[str, str, str]]:
    """(name, metric selector, label) of every label_values() variable."""
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["definition"])
            assert m, v["definition"]
            yield v["name"], m.group(1), m.group(2)


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace $var, ${var} and [[var]] like Grafana; unknown variables stay (and fail the query)."""
    merged = {**BUILTINS, **values}

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return merged.get(name, m.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)
