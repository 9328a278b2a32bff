"""The verdict on a `/v1/status` document: healthy (0) or degraded (1), with the problems
that say why, and whether the node is unfit (sidecar/fitness.py: something outlives its jobs;
an unfit node is degraded too). It is `sidecar status`'s exit status, `sidecar status --check
node`'s answer and `sidecar preflight`'s sidecar check.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.problems import restart_trap

EXIT_HEALTHY, EXIT_DEGRADED, EXIT_UNREACHABLE = 0, 1, 2
DEGRADED_RANK_STATES = frozenset({"suspect", "stalled", "remediating"})


def dicts_at(doc: Mapping, key: str) -> list[dict]:
    value = doc.get(key)
    return [x for x in value if isinstance(x, dict)] if isinstance(value, list) else []


def dict_at(doc: Mapping, key: str) -> dict:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


@dataclass
class Verdict:
    exit_code: int
    problems: list[str] = field(default_factory=list)
    unfit: list[str] = field(default_factory=list)  # why the node is unfit ("reason: text"); empty: fit


def unfit_reasons(status: Mapping[str, Any]) -> list[str]:
    """Why the document says the node is unfit, one "reason: text" per finding; empty when fit
    (or from a sidecar too old to judge fitness)."""
    fitness = dict_at(status, "fitness")
    found = [f"{f.get('reason')}: {f.get('text')}" for f in dicts_at(fitness, "findings")]
    if fitness.get("fit") is False and not found:
        found = [", ".join(str(r) for r in fitness.get("reasons") or []) or "unfit, no reason given"]
    return found


def assess(status: Mapping[str, Any]) -> Verdict:
    """Healthy only if the daemon says so AND nothing in the document contradicts it: a
    daemon that is itself behind (or a rank state the daemon did not turn into a problem)
    must not make this command report green."""
    reported = [str(p) for p in status.get("problems") or [] if p]
    derived = []
    for r in dicts_at(status, "ranks"):
        if r.get("state") in DEGRADED_RANK_STATES:
            derived.append(f"rank {r.get('rank')} of job {r.get('job_id')} is {r.get('state')}")
    for name, c in sorted(dict_at(status, "collectors").items()):
        if isinstance(c, dict) and c.get("success") is False:
            derived.append(f"collector {name} is failing" + (f": {c['error']}" if c.get("error") else ""))
    unsafe: dict[str, list[int]] = {}
    for r in dicts_at(status, "ranks"):
        rank = r.get("rank")
        if r.get("restart_safe") is False and isinstance(rank, int):
            unsafe.setdefault(str(r.get("job_id")), []).append(rank)
    derived += [restart_trap(job_id, ranks).text for job_id, ranks in sorted(unsafe.items())]
    unfit = unfit_reasons(status)
    problems = reported or derived
    if unfit and not any(p.startswith("node unfit") for p in problems):
        problems += [f"node unfit ({u})" for u in unfit]
    if status.get("health") not in (None, "healthy") and not problems:
        problems = [f"the sidecar reports health {status.get('health')!r}"]
    return Verdict(EXIT_DEGRADED if problems else EXIT_HEALTHY, problems, unfit)
