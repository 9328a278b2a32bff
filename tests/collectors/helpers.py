"""Helpers for the collector tests: run a collector as the daemon does, read its families."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from sidecar.collectors.base import CollectorResult, CollectorRunner

FAKE = "sidecar.testing.fake_nvml_lib"  # the real pynvml over a fake libnvidia-ml
FAKE_MODULE = "sidecar.testing.fake_nvml"  # the pure-Python stand-in (pynvml's API only)
FIXTURE_SYSFS = Path(__file__).parent / "fixtures" / "sys"


def run(collector) -> CollectorResult:
    """One collector run, wrapped exactly as the daemon wraps it (success, error, families)."""
    return CollectorRunner([collector], interval=1.0).run_once_sync(collector)


def series(families: Iterable[Metric], name: str) -> dict[tuple, float]:
    """Samples named `name` (the exposed name, e.g. with `_total`), keyed by sorted label pairs."""
    out = {}
    for family in families:
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def by_label(families: Iterable[Metric], name: str, label: str) -> dict[str, float]:
    """Samples named `name` keyed by one label's value."""
    return {dict(k)[label]: v for k, v in series(families, name).items()}


def exposition(families: Iterable[Metric]) -> str:
    class Snapshot:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot())
    return generate_latest(registry).decode()
