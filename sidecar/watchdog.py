"""The progress watchdog: one explicit state machine per registered rank.

(Interface first; the state machine lands in the next commits.)
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Iterable

from prometheus_client.core import Metric

from sidecar.collectors.base import MetricSpec, spec
from sidecar.config import Settings

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.registry import Registry

METRICS: tuple[MetricSpec, ...] = (
    spec("watchdog", "rank_state", "gauge", "1 for the rank's current watchdog state.",
         ["job_id", "rank", "state"]),
    spec("watchdog", "watchdog_timeout_seconds", "gauge",
         "The rank's effective progress timeout now (depends on phase and step times).",
         ["job_id", "rank"]),
    spec("watchdog", "watchdog_stalls", "counter", "Stalls detected, per job.", ["job_id"]),
    spec("watchdog", "watchdog_remediations", "counter",
         "Remediations by outcome: killed, suppressed (storm cap), observe_only, failed.",
         ["job_id", "outcome"]),
    spec("watchdog", "watchdog_transitions", "counter", "Rank state transitions.",
         ["from_state", "to_state"]),
    spec("watchdog", "watchdog_last_incident_timestamp_seconds", "gauge",
         "Unix time of the latest incident (0 before the first)."),
    spec("watchdog", "watchdog_observe_only", "gauge",
         "1 when the watchdog only detects and reports, never signals."),
)


class Watchdog:
    def __init__(self, settings: Settings, registry: "Registry", clock=time.monotonic):
        self.settings = settings
        self.registry = registry
        self.clock = clock

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.watchdog.check_interval_seconds)

    def families(self) -> Iterable[Metric]:
        return []

    def status(self) -> dict:
        return {"observe_only": self.settings.watchdog.observe_only, "remediations_in_window": 0,
                "max_per_window": self.settings.remediation.max_per_window}

    def rank_state(self, rank) -> str:
        return "starting"

    def timeout_for(self, rank) -> float | None:
        return None

    def problems(self) -> list[str]:
        return []

    def incidents(self, limit: int = 5) -> list[dict]:
        return []
