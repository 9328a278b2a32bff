"""Whether this node can run a job: one verdict (fit or unfit) from plain findings.

A node is unfit when something on it would make the next job (or the restart of this one) fail
or hang whatever the job does: processes that outlived SIGKILL (the watchdog's,
sidecar/watchdog/unkillable.py), GPU memory still held by processes of no live rank, fewer GPUs
than the node should have, or no usable NVML where GPUs are expected (the GPU collector's,
sidecar/collectors/gpu_fitness.py). Each source hands over `Finding`s as plain values; `judge`
makes the verdict, which returns to fit as soon as no source reports a finding. `/metrics`
(`families`), `/v1/status`, `sidecar status`, `sidecar preflight` and the node-problem-detector
check all read this one verdict, so they never disagree.

A stalled or slow rank does not make a node unfit (the watchdog and its alerts handle jobs); only
what outlives the job does, and, opt-in, a straggler whose cause is in the node's hardware
(sidecar/jobview/straggler_incidents.py: `job_view.straggler_exclude_after_seconds`). A finding
names a process only from what the sidecar verified: remediation signals verified ranks only, and
GPU ownership comes from verified ranks only, so an unverified TCP registration (which names any
pid it likes) can never make a node unfit nor get another user's process named as what holds it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.core import Metric

from sidecar.metric import spec


class Reason(enum.Enum):
    """Why a node is unfit: the bounded values of the `reason` label."""

    UNKILLABLE = "unkillable"  # processes alive after SIGKILL (D state, frozen, ...)
    GPU_HELD = "gpu_held"  # GPU memory held by processes of no live rank, past budget and grace
    GPU_MISSING = "gpu_missing"  # fewer usable GPUs than collectors.expected_gpus
    NVML_UNAVAILABLE = "nvml_unavailable"  # no usable NVML on a node that expects GPUs
    STRAGGLER = "straggler"  # opt-in: a rank here its job's straggler with a hardware cause, long enough


@dataclass(frozen=True)
class Finding:
    """One cause of unfitness: its reason, one line for people, and the processes it names."""

    reason: Reason
    text: str
    pids: tuple[int, ...] = ()

    def as_dict(self) -> dict:
        return {"reason": self.reason.value, "text": self.text, "pids": list(self.pids)}


@dataclass(frozen=True)
class Fitness:
    findings: tuple[Finding, ...] = ()

    @property
    def fit(self) -> bool:
        return not self.findings

    @property
    def reasons(self) -> list[str]:
        """The reasons that hold, each once, in the order of `Reason`."""
        held = {f.reason for f in self.findings}
        return [r.value for r in Reason if r in held]

    def as_dict(self) -> dict:
        """The node's verdict as `/v1/status` carries it (`fitness`)."""
        return {"fit": self.fit, "reasons": self.reasons, "findings": [f.as_dict() for f in self.findings]}


def judge(*sources: Iterable[Finding]) -> Fitness:
    """The verdict on everything the sources report now."""
    return Fitness(tuple(f for source in sources for f in source))


NODE_FIT = spec(
    "node_fitness",
    "node_fit",
    "gauge",
    "1 when this node can run a job, 0 when something outlives the jobs on it "
    "(sidecar_node_unfit_reason says what; drain it: docs/runbook.md#sidecarnodeunfit).",
)
NODE_UNFIT_REASON = spec(
    "node_fitness",
    "node_unfit_reason",
    "gauge",
    "1 for each reason that makes the node unfit now, 0 for the others: unkillable (processes alive after "
    "SIGKILL), gpu_held (GPU memory held by processes of no live rank past collectors.gpu_held_budget_bytes "
    "and gpu_held_grace_seconds), gpu_missing (fewer usable GPUs than collectors.expected_gpus), "
    "nvml_unavailable (no usable NVML on a node that expects GPUs), straggler (opt-in: a rank here its job's "
    "straggler with a cause in the node's hardware for job_view.straggler_exclude_after_seconds; leave the node "
    "out at the job's next restart).",
    ["reason"],
)
METRICS = (NODE_FIT, NODE_UNFIT_REASON)


def families(fitness: Fitness) -> list[Metric]:
    fit, reason = NODE_FIT.family(), NODE_UNFIT_REASON.family()
    fit.add_metric([], 1.0 if fitness.fit else 0.0)
    held = set(fitness.reasons)
    for r in Reason:
        reason.add_metric([r.value], 1.0 if r.value in held else 0.0)
    return [fit, reason]
