"""What every collector shares: the one-method interface and the runner that samples
collectors in the background and keeps the latest snapshot (metric specifications are
`sidecar/metric.py`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest

from sidecar.config import Settings
from sidecar.metric import MetricSpec, spec

log = logging.getLogger(__name__)


class Collector(Protocol):
    """A collector reads one data source and maps it to metric families. `collect` runs in an
    executor thread (it may block on files or NVML); it returns no family for absent hardware
    and raises only when the collection as a whole failed."""

    name: str

    @property
    def metrics(self) -> Sequence[MetricSpec]:
        """Every family the collector can export (read-only: collectors declare a tuple)."""
        ...

    def collect(self) -> Iterable[Metric]: ...


@dataclass
class CollectorResult:
    families: list[Metric] = field(default_factory=list)
    success: bool = False
    duration_seconds: float = 0.0
    finished_at: float = 0.0  # time.time() of the last run, 0 before the first
    error: str | None = None
    text: bytes = b""  # the families in Prometheus text format, rendered once per run
    series: int = 0  # samples in `families` (what they add to /metrics)


class _Families:
    """A fixed list of families with the `collect()` that prometheus-client's encoders call."""

    def __init__(self, families: Iterable[Metric]):
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def render_text(families: Iterable[Metric]) -> bytes:
    return generate_latest(_Families(families))


class TextCache:
    """Renders families to Prometheus text, reusing the bytes of a family whose samples are
    unchanged since the last round (slow-moving families: NVLink and ECC counters refreshed
    every few rounds, link speeds, info metrics). Comparing samples costs a fraction of
    formatting them. One cache per collector; a collector runs in one thread at a time."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[list, bytes]] = {}

    def render(self, families: Sequence[Metric]) -> bytes:
        out, seen = [], {}
        for family in families:
            key = family.name
            cached = self._last.get(key)
            if cached is not None and cached[0] == family.samples:
                text = cached[1]
            else:
                text = render_text([family])
            seen[key] = (family.samples, text)
            out.append(text)
        self._last = seen
        return b"".join(out)


RUNNER_METRICS = (
    spec(
        "runner",
        "scrape_collector_success",
        "gauge",
        "1 if the collector's last run succeeded (a partial failure, such as one GPU lost, is 0).",
        ["collector"],
    ),
    spec(
        "runner", "scrape_collector_duration_seconds", "gauge", "Duration of the collector's last run.", ["collector"]
    ),
)


class PartialFailure(Exception):
    """Raised by a collector *after* producing its families: some fields or devices failed.
    The runner keeps the families and reports success 0 with this message."""

    def __init__(self, message: str, families: Sequence[Metric]):
        super().__init__(message)
        self.families = list(families)


class CollectorRunner:
    """Runs each collector every `interval` seconds in the default executor and keeps the
    latest result. A scrape reads `results`; it never waits on a collector."""

    def __init__(self, collectors: Sequence[Collector], interval: float):
        self.collectors = list(collectors)
        self.interval = interval
        self.results: dict[str, CollectorResult] = {c.name: CollectorResult() for c in self.collectors}
        self._text = {c.name: TextCache() for c in self.collectors}
        self._running_since: dict[str, float] = {}
        self.hung_after_seconds: float | None = None  # default: 3 intervals, at least 10 s
        self.first_round = asyncio.Event()
        # Applied to each run's families before they are rendered (the ranks' pod labels).
        self.relabel: Callable[[list[Metric]], list[Metric]] | None = None

    def run_once_sync(self, collector: Collector) -> CollectorResult:
        start = time.perf_counter()
        try:
            families = list(collector.collect())
            if self.relabel is not None:
                families = self.relabel(families)
            result = CollectorResult(families, True)
        except PartialFailure as e:
            families = list(e.families)
            result = CollectorResult(self.relabel(families) if self.relabel else families, False, error=str(e))
        except Exception as e:  # one failing collector never breaks the endpoint
            log.warning("collector %s failed: %s", collector.name, e, exc_info=log.isEnabledFor(logging.DEBUG))
            result = CollectorResult([], False, error=f"{type(e).__name__}: {e}")
        result.duration_seconds = time.perf_counter() - start
        result.finished_at = time.time()
        # Rendering here, in the worker thread, once per round, keeps a scrape from paying for
        # it: the hardware families are the bulk of the exposition.
        try:
            result.text = self._text.setdefault(collector.name, TextCache()).render(result.families)
        except Exception as e:
            log.warning("collector %s produced families that cannot be rendered: %s", collector.name, e)
            result.families, result.text, result.success = [], b"", False
            result.error = f"render: {e}"
        result.series = sum(len(f.samples) for f in result.families)
        return result

    async def run_round(self) -> None:
        """Run every collector once, concurrently (tests and start-up use this)."""
        await asyncio.gather(*(self._run_one(c) for c in self.collectors))
        self.first_round.set()

    async def _run_one(self, collector: Collector) -> None:
        loop = asyncio.get_running_loop()
        self._running_since[collector.name] = time.monotonic()
        try:
            self.results[collector.name] = await loop.run_in_executor(None, self.run_once_sync, collector)
        finally:
            self._running_since.pop(collector.name, None)
        if all(r.finished_at for r in self.results.values()):
            self.first_round.set()

    async def run_forever(self) -> None:
        """Each collector on its own schedule: a collector stuck in a driver call (NVML can
        block for minutes when a GPU falls off the bus) delays only itself, and is reported
        as failing once it has run for longer than `hung_after` seconds."""
        if not self.collectors:
            self.first_round.set()
        await asyncio.gather(*(self._loop(c) for c in self.collectors))

    async def _loop(self, collector: Collector) -> None:
        while True:
            started = time.monotonic()
            await self._run_one(collector)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    @property
    def hung_after(self) -> float:
        return self.hung_after_seconds or max(3 * self.interval, 10.0)

    def hung(self) -> dict[str, float]:
        """Collectors whose current run has lasted longer than `hung_after`: name -> seconds."""
        now = time.monotonic()
        # a copy (one C call under the GIL): /metrics renders in an executor thread while the loop's
        # collectors start and end (beside the busy suite: "dictionary changed size during iteration", a 500)
        running = list(self._running_since.items())
        return {name: now - since for name, since in running if now - since > self.hung_after}

    def families(self) -> Iterable[Metric]:
        """The latest families of every collector plus the runner's own success/duration."""
        for r in list(self.results.values()):
            yield from r.families
        yield from self.health_families()

    def rendered_text(self, exclude: Iterable[str] = ()) -> bytes:
        """The latest families of every collector (but those named in `exclude`), already in
        Prometheus text format."""
        skip = frozenset(exclude)
        return b"".join(r.text for name, r in list(self.results.items()) if name not in skip)

    def snapshot(self) -> dict[str, CollectorResult]:
        """The latest result per collector, a hung one marked failing (its families stay)."""
        out = dict(self.results)
        for name, seconds in self.hung().items():
            r = out[name]
            out[name] = CollectorResult(
                r.families,
                False,
                seconds,
                r.finished_at or time.time(),
                f"hung: its current run has lasted {seconds:.0f}s",
                r.text,
                r.series,
            )
        return out

    def health_families(self) -> Iterable[Metric]:
        """The runner's own per-collector success and duration."""
        success = RUNNER_METRICS[0].family()
        duration = RUNNER_METRICS[1].family()
        for name, r in self.snapshot().items():
            if r.finished_at:
                success.add_metric([name], 1.0 if r.success else 0.0)
                duration.add_metric([name], r.duration_seconds)
        yield success
        yield duration


@dataclass
class BuildContext:
    """What a collector's `build` may use. `ranks()` returns (job_id, rank, pid) of the live
    registered ranks whose series /metrics has room for, `live_ranks()` of every live verified
    rank (what GPU memory is owned by; default: `ranks`); `job_versions()` {job_id: {"torch":
    ..., "cuda": ..., "nccl": ...}} as the ranks reported them; all are called from executor
    threads. `built`: the collectors built so far, by name."""

    settings: Settings
    ranks: Callable[[], list[tuple[str, int, int]]]
    job_versions: Callable[[], dict[str, dict[str, str]]]
    built: dict[str, Collector] = field(default_factory=dict)
    live_ranks: Callable[[], list[tuple[str, int, int]]] | None = None
