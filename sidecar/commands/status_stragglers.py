"""`sidecar status`'s "Stragglers" section: per local job, the rank that enters its collectives
last, as the job's coordinator judged it over the whole job and as this node judged its own ranks
(`/v1/status` `stragglers`, sidecar/jobview/stragglers.py), and for a straggler of this node with an
open incident its cause (`throttled`: its CPU cgroup throttles it or its GPU's clocks are held
down; else `unknown`;
sidecar/ranks/straggler_cause.py). A straggler is reported, never killed.

Rows are (text, style) pairs; status.py turns them into its cells.
"""

from __future__ import annotations

from typing import Any

from sidecar.commands.verdict import dicts_at

TITLE = "Stragglers (late to collectives; never killed)"
COLUMNS = ["JOB", "RANK", "NODE", "LATENESS", "GROUP (INTERVAL)", "JUDGED BY", "CAUSE"]
EMPTY = "none judged (no job with collective entry times here)"

Row = list[tuple[str, str]]


def _ms(value: Any) -> str:
    return f"{value * 1000:.1f} ms" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _judged_by(j: dict) -> str:
    who = "the job's coordinator" if j.get("judged_by") == "coordinator" else "this node"
    where = j.get("judged_on")
    count = j.get("ranks_judged")
    return f"{who} ({where}, {count} ranks)" if where else f"{who} ({count} ranks)"


def rows(status: Any) -> list[Row]:
    out: list[Row] = []
    for j in dicts_at(status, "stragglers") if isinstance(status, dict) else []:
        job, by = str(j.get("job_id")), _judged_by(j)
        named = dicts_at(j, "stragglers")
        if not named:
            out.append([(job, ""), ("-", ""), ("-", ""), ("none", "green"), ("-", ""), (by, ""), ("-", "")])
        for s in named:
            group = f"pg {s.get('pg')} ({_ms(s.get('interval_seconds'))})"
            out.append(
                [(job, ""), (str(s.get("rank")), "bold yellow"), (str(s.get("node")), ""),
                 (_ms(s.get("lateness_seconds")), "bold yellow"), (group, ""), (by, ""),
                 (str(s.get("cause") or "-"), "bold red" if s.get("cause") == "throttled" else "")]
            )  # fmt: skip
    return out
