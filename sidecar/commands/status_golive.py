"""`sidecar status`'s "Go-live checks" section: per job with ranks here, each check of
`/v1/status` `golive` (sidecar/ranks/golive.py): ranks joined, first batch, GPU memory and
throughput balanced across the ranks, loss falling over the first steps. A warning says what
differs, in bold, and is repeated under the table so that it shows at a glance.

Rows are (text, style) pairs; status_screen.py turns them into its cells.
"""

from __future__ import annotations

from typing import Any

TITLE = "Go-live checks (new jobs: watchdog.golive_steps, golive_imbalance_ratio)"
COLUMNS = ["JOB", "CHECK", "STATE", "WHAT IT SAYS"]
EMPTY = "no job here"
STYLES = {"ok": "green", "pending": "yellow", "warning": "bold red", "unavailable": "dim"}

Row = list[tuple[str, str]]


def _jobs(status: Any) -> list[tuple[str, dict]]:
    jobs = status.get("golive") if isinstance(status, dict) else None
    if not isinstance(jobs, dict):
        return []
    return [(str(job_id), job) for job_id, job in sorted(jobs.items()) if isinstance(job, dict)]


def rows(status: Any) -> list[Row]:
    out: list[Row] = []
    for job_id, job in _jobs(status):
        checks = job.get("checks")
        for name, check in checks.items() if isinstance(checks, dict) else []:
            if not isinstance(check, dict):
                continue
            state = str(check.get("state"))
            style = STYLES.get(state, "")
            out.append([(job_id, ""), (str(name), ""), (state.upper(), style), (str(check.get("text") or "-"), style)])
    return out


def notes(status: Any) -> list[str]:
    """One line per warning: what differs, visible without reading the table."""
    out = []
    for job_id, job in _jobs(status):
        checks = job.get("checks")
        for name, check in checks.items() if isinstance(checks, dict) else []:
            if isinstance(check, dict) and check.get("state") == "warning":
                out.append(f"WARNING job {job_id} {name}: {check.get('text')}")
    return out
