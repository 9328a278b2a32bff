"""A rank's Kubernetes identity: `namespace`, `pod` and `container` labels on its series.

The hooks read them from downward-API variables the job's pod sets (SIDECAR_POD_NAMESPACE,
SIDECAR_POD_NAME, SIDECAR_CONTAINER_NAME; docs/operator-guide.md) and send them in the
registration's `kubernetes` object. They are a rank's claim like everything else it sends: the
sidecar checks them against Kubernetes' own rules for these names (DNS-1123 labels of at most
63 characters for the namespace and the container, a DNS-1123 subdomain of at most 253 for the
pod) and refuses anything else with 400. A variable that is not set means no label: outside
Kubernetes the series carry none of the three, never empty values.

The labels add no series: a rank has one pod at a time, and a rank registering again from
another pod replaces its registration (and its series) rather than adding to them.

A job's own series (labelled `job_id` but no `rank`: `sidecar_training_world_size`,
`sidecar_job_failures_total`, the watchdog's stall and verdict counters, ...) carry `namespace` too,
when the job's ranks on this node name one namespace (a Kubernetes job runs in one); ranks that
name several, or none, leave it off. So alerts and recording rules keep the tenant for job-level
alerts as for rank-level ones (issue 31, item 3). Never `pod` or `container`: a job has many.

A Slurm job's ranks carry its `slurm_job_id`, `slurm_user`, `slurm_account` and `slurm_partition`
(sidecar/ranks/slurmjob.py: where each comes from) the same way: on the rank's series, and each on the
job's own series when its ranks here name one value of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import Metric

from sidecar.ranks.slurmjob import LABELS as SLURM_LABELS
from trainer_hooks.wire import POD_LABEL_KEYS as KEYS
from trainer_hooks.wire import POD_LABEL_RULES as RULES


class PodLabelError(ValueError):
    """The `kubernetes` object of a registration is not what Kubernetes would name."""


def parse(value: Any) -> dict[str, str]:
    """The validated labels of a registration's `kubernetes` field (None or absent: none)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PodLabelError("kubernetes: expected an object with namespace, pod and container")
    out = {}
    for key, text in value.items():
        if key not in RULES:
            raise PodLabelError(f"kubernetes: unknown key {str(key)[:40]!r}; known: {', '.join(KEYS)}")
        if text is None:
            continue
        pattern, max_len, what = RULES[key]
        if not isinstance(text, str) or len(text) > max_len or not pattern.match(text):
            shown = repr(text[:64]) if isinstance(text, str) else type(text).__name__
            chars = "lower-case letters, digits, '-' and '.'" if key == "pod" else "lower-case letters, digits and '-'"
            raise PodLabelError(
                f"kubernetes.{key}: expected {what} ({chars}, at most {max_len} characters), got {shown}"
            )
        out[key] = text
    return out


# The rank labels a job's own series carry too, each where the job's ranks here name one value of it.
JOB_LABELS = ("namespace", *SLURM_LABELS)


def job_labels(lookup: dict[tuple[str, str], dict[str, str]]) -> dict[str, dict[str, str]]:
    """job_id -> its job-level labels (JOB_LABELS): each that its ranks here name exactly one value of."""
    seen: dict[str, dict[str, set[str]]] = {}
    for (job_id, _), labels in lookup.items():
        for key in JOB_LABELS:
            if key in labels:
                seen.setdefault(job_id, {}).setdefault(key, set()).add(labels[key])
    out = {job_id: {k: v.pop() for k, v in keys.items() if len(v) == 1} for job_id, keys in seen.items()}
    return {job_id: labels for job_id, labels in out.items() if labels}


def attach(families: Iterable[Metric], labels_of: Callable[[], dict[tuple[str, str], dict[str, str]]]) -> list[Metric]:
    """`families` with each rank's labels added to its samples (those labelled job_id and rank), and
    its job's (JOB_LABELS) to the job's own samples (labelled job_id, no rank), never over a label a
    sample has. `labels_of()` maps (job_id, rank as text) to the labels; it is called once, only when
    needed."""
    families = list(families)
    lookup: dict[tuple[str, str], dict[str, str]] | None = None
    of_job: dict[str, dict[str, str]] = {}
    for family in families:
        if not family.samples or "job_id" not in family.samples[0].labels:
            continue
        if lookup is None:
            lookup = labels_of()
            if not lookup:
                return families
            of_job = job_labels(lookup)
        if "rank" in family.samples[0].labels:
            family.samples = [
                s._replace(labels={**s.labels, **extra})
                if (extra := lookup.get((s.labels.get("job_id", ""), s.labels.get("rank", ""))))
                else s
                for s in family.samples
            ]
        elif of_job:
            family.samples = [
                s._replace(labels={**s.labels, **{k: v for k, v in extra.items() if k not in s.labels}})
                if (extra := of_job.get(s.labels.get("job_id", "")))
                else s
                for s in family.samples
            ]
    return families
