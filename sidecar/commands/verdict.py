"""The verdict on a `/v1/status` document: healthy (0) or degraded (1), with the problems
that say why. It is `sidecar status`'s exit status and `sidecar preflight`'s sidecar check.
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
    problems = reported or derived
    if status.get("health") not in (None, "healthy") and not problems:
        problems = [f"the sidecar reports health {status.get('health')!r}"]
    return Verdict(EXIT_DEGRADED if problems else EXIT_HEALTHY, problems)
