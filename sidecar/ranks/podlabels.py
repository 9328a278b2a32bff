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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import Metric

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


def job_namespaces(lookup: dict[tuple[str, str], dict[str, str]]) -> dict[str, str]:
    """job_id -> its namespace, for the jobs whose ranks here name exactly one."""
    seen: dict[str, set[str]] = {}
    for (job_id, _), labels in lookup.items():
        if "namespace" in labels:
            seen.setdefault(job_id, set()).add(labels["namespace"])
    return {job_id: names.pop() for job_id, names in seen.items() if len(names) == 1}


def attach(families: Iterable[Metric], labels_of: Callable[[], dict[tuple[str, str], dict[str, str]]]) -> list[Metric]:
    """`families` with each rank's pod labels added to its samples (those labelled job_id and rank),
    and its job's namespace to the job's own samples (labelled job_id, no rank). `labels_of()` maps
    (job_id, rank as text) to the labels; it is called once, only when needed."""
    families = list(families)
    lookup: dict[tuple[str, str], dict[str, str]] | None = None
    namespaces: dict[str, str] = {}
    for family in families:
        if not family.samples or "job_id" not in family.samples[0].labels:
            continue
        if lookup is None:
            lookup = labels_of()
            if not lookup:
                return families
            namespaces = job_namespaces(lookup)
        if "rank" in family.samples[0].labels:
            family.samples = [
                s._replace(labels={**s.labels, **extra})
                if (extra := lookup.get((s.labels.get("job_id", ""), s.labels.get("rank", ""))))
                else s
                for s in family.samples
            ]
        elif namespaces:
            family.samples = [
                s._replace(labels={**s.labels, "namespace": ns})
                if "namespace" not in s.labels and (ns := namespaces.get(s.labels.get("job_id", ""))) is not None
                else s
                for s in family.samples
            ]
    return families
