"""`sidecar status`'s "Go-live checks" section: per job with ranks here, each check of
`/v1/status` `golive` (sidecar/ranks/golive.py): ranks joined, first batch, GPU memory and
throughput balanced across the ranks, loss falling over the first steps. A warning says what
differs, in bold, and is repeated under the table so that it shows at a glance. JUDGED BY says whether
the checks are the whole job's, as its coordinator judged them over every node (`judged_by:
coordinator`, sidecar/jobview/golive.py), or this node's over its own ranks.

Rows are (text, style) pairs; status_screen.py turns them into its cells.
"""

from __future__ import annotations

from typing import Any

TITLE = "Go-live checks (new jobs: watchdog.golive_steps, golive_imbalance_ratio)"
COLUMNS = ["JOB", "CHECK", "STATE", "WHAT IT SAYS", "JUDGED BY"]
EMPTY = "no job here"
STYLES = {"ok": "green", "pending": "yellow", "warning": "bold red", "unavailable": "dim"}

Row = list[tuple[str, str]]


def _jobs(status: Any) -> list[tuple[str, dict]]:
    jobs = status.get("golive") if isinstance(status, dict) else None
    if not isinstance(jobs, dict):
        return []
    return [(str(job_id), job) for job_id, job in sorted(jobs.items()) if isinstance(job, dict)]


def judged_by(job: dict) -> str:
    if job.get("judged_by") == "coordinator":
        ranks, world = job.get("ranks_judged"), job.get("world_size")
        return f"coordinator {job.get('judged_on') or '?'} ({ranks} of {world} ranks, whole job)"
    return "this node (its ranks)"


def rows(status: Any) -> list[Row]:
    out: list[Row] = []
    for job_id, job in _jobs(status):
        checks = job.get("checks")
        by = judged_by(job)
        for name, check in checks.items() if isinstance(checks, dict) else []:
            if not isinstance(check, dict):
                continue
            state = str(check.get("state"))
            style = STYLES.get(state, "")
            text = str(check.get("text") or "-")
            out.append([(job_id, ""), (str(name), ""), (state.upper(), style), (text, style), (by, "dim")])
            by = ""  # once per job
    return out


def notes(status: Any) -> list[str]:
    """One line per warning: what differs, visible without reading the table."""
    out = []
    for job_id, job in _jobs(status):
        checks = job.get("checks")
        for name, check in checks.items() if isinstance(checks, dict) else []:
            if isinstance(check, dict) and check.get("state") == "warning":
                where = " (whole job)" if job.get("judged_by") == "coordinator" else ""
                out.append(f"WARNING job {job_id}{where} {name}: {check.get('text')}")
    return out
