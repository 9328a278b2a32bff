"""Goodput of a job under faults, from its rank-0 step log: the healthy step time, the wall time and
where it went (bench_recovery's `--long` and `--faults mixed` share it), the CPU time the hypervisor
took meanwhile, and the sidecar's own goodput metric (sidecar_job_seconds_total)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from harness.job import SidecarClient

# A step slower than this (seconds) held a fault: a hang, a restart, or a pause.
FAULT_GAP_SECONDS = 1.0


@dataclass
class StepAccount:
    """Where the wall time from the first step to the last went."""

    healthy: float  # median step time
    wall: float
    fault_seconds: float  # the steps a fault delayed (and the first after each resume), beyond a healthy step
    slow_seconds: float  # every other step beyond the median (a slower machine, the snapshot writer)
    job_seconds: float  # the steps in `job_steps` (the job's own pauses), beyond a healthy step: useful time


def account(step_times: list[tuple[int, float]], job_steps: frozenset[int] = frozenset()) -> StepAccount:
    """`step_times`: (step, Unix time it ended), in log order; `job_steps`: steps whose length is the
    job's own work (a pause it computes), counted as useful, not as loss."""
    pairs = [(b[0], b[1] - a[1]) for a, b in zip(step_times, step_times[1:], strict=False) if b[0] == a[0] + 1]
    healthy = statistics.median(gap for _, gap in pairs)
    wall = step_times[-1][1] - step_times[0][1]
    # The steps a fault delays: the hung one, and the first after the resume (which waited for the restart).
    hung = {step for step, gap in pairs if gap > FAULT_GAP_SECONDS and step not in job_steps}
    hung |= {step + 1 for step in hung}
    fault = sum(gap - healthy for step, gap in pairs if step in hung)
    job = sum(gap - healthy for step, gap in pairs if step in job_steps and step not in hung)
    slow = sum(gap - healthy for step, gap in pairs if step not in hung and step not in job_steps and gap > healthy)
    return StepAccount(healthy, wall, fault, slow, job)


def cpu_times() -> list[int] | None:
    """The `cpu` line of /proc/stat (user nice system idle iowait irq softirq steal ...), in ticks."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    if not before or not after or len(before) < 8:
        return None
    spent = [b - a for a, b in zip(before, after, strict=False)]
    total = sum(spent[:8])  # guest time is already counted in user
    return spent[7] / total if total > 0 else None


def live_goodput(client: SidecarClient) -> dict[str, float]:
    """sidecar_job_seconds_total{state} from the sidecar's /metrics for the one job it saw (a
    --standalone torchrun names its job with a fresh id): the goodput the product reports, next
    to the benchmark's own measure."""
    from prometheus_client.parser import text_string_to_metric_families

    code, body = client.get("/metrics", timeout=10)
    if code != 200:
        return {}
    jobs: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == "sidecar_job_seconds_total":
                jobs.setdefault(sample.labels["job_id"], {})[sample.labels["state"]] = sample.value
    return max(jobs.values(), key=lambda states: sum(states.values()), default={})
