"""Per-rank training counters and the step-time histogram: what Prometheus can `rate()`.

The gauges in the training collector hold a rank's last values; a scrape interval hides what
happened between two scrapes. These accumulate instead, per `(job_id, rank)`, across the rank's
re-registrations (a restarted attempt continues the same series), for as long as the registry
keeps the rank:

- steps: the steps the rank advanced (1 for the first report of a registration, else the step
  delta), so a resumed run that trains steps again counts them again;
- samples, tokens: the per-step `samples` / `tokens` the rank sent, times the steps advanced;
- step time: a histogram of the step times (sent as `step_time_seconds`, else derived from the
  report times), in buckets from 5 ms to 10 minutes.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

# Upper bounds in seconds: milliseconds for small models on many GPUs up to minutes for huge
# steps; +Inf follows. 15 buckets keep a rank at 18 series.
STEP_TIME_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    180.0,
    600.0,
)


@dataclass
class StepCounters:
    steps: float = 0.0
    samples: float = 0.0
    tokens: float = 0.0
    step_time_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_TIME_BUCKETS) + 1))
    step_time_sum: float = 0.0
    step_time_count: int = 0

    def observe(self, advanced: int, metrics: dict[str, float], step_time: float | None) -> None:
        """One accepted step report: `advanced` steps since the previous one (>= 1)."""
        self.steps += advanced
        for key in ("samples", "tokens"):
            value = metrics.get(key)
            if value is not None and math.isfinite(value) and value > 0:
                setattr(self, key, getattr(self, key) + value * advanced)
        if step_time is not None and math.isfinite(step_time) and step_time >= 0:
            self.step_time_counts[bisect.bisect_left(STEP_TIME_BUCKETS, step_time)] += 1
            self.step_time_sum += step_time
            self.step_time_count += 1

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative `(le, count)` pairs, +Inf last, as prometheus-client's histogram family wants."""
        out, total = [], 0
        for bound, count in zip((*STEP_TIME_BUCKETS, math.inf), self.step_time_counts, strict=True):
            total += count
            out.append(("+Inf" if math.isinf(bound) else repr(bound), total))
        return out
