"""The metric primitive every concern shares: a `MetricSpec` names one metric family (name,
type, help, labels) once, and builds its family at export time. Each module that exports
metrics lists its specs in `METRICS`; docs/metrics.md is generated from them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

PREFIX = "sidecar_"

if TYPE_CHECKING:

    class Family(Metric):
        """What `MetricSpec.family` returns: a gauge, counter, info or histogram family. Their
        `add_metric` signatures differ (an info family takes a dict, a histogram buckets and a
        sum); the spec's `type` says which the caller holds, which a type checker cannot see."""

        def add_metric(self, labels: Sequence[str], value: Any, *args: Any, **kwargs: Any) -> None: ...
else:
    Family = Metric


@dataclass(frozen=True)
class MetricSpec:
    """A metric family's name (without `_total` for counters, as prometheus-client wants it),
    type, help and label names. `collector` names the collector that exports it."""

    name: str
    type: str  # "gauge" | "counter" | "info" | "histogram" (exposed as _bucket, _sum, _count)
    help: str
    labels: tuple[str, ...] = ()
    collector: str = ""

    def family(self) -> Family:
        family: Metric
        if self.type == "gauge":
            family = GaugeMetricFamily(self.name, self.help, labels=self.labels)
        elif self.type == "counter":
            family = CounterMetricFamily(self.name, self.help, labels=self.labels)
        elif self.type == "info":
            family = InfoMetricFamily(self.name, self.help, labels=self.labels)
        elif self.type == "histogram":
            family = HistogramMetricFamily(self.name, self.help, labels=self.labels)
        else:
            raise ValueError(f"unknown metric type {self.type}")
        return cast("Family", family)

    @property
    def exposed_name(self) -> str:
        if self.type == "counter":
            return self.name + "_total"
        if self.type == "info":
            return self.name + "_info"
        return self.name


def spec(collector: str, name: str, type_: str, help_: str, labels: Sequence[str] = ()) -> MetricSpec:
    return MetricSpec(PREFIX + name, type_, help_, tuple(labels), collector)
