"""What `/metrics` answers: every family, within a node-wide series budget, rendered off the
event loop.

The hardware families (gpu, nic, node) are rendered by their collector round and bounded by
the hardware. What grows with what local users do is per rank: the training and watchdog
families, the process collector's, and the custom metrics. `limits.max_series` caps the whole
answer: ranks are admitted in a fair order (round robin over jobs, each job's ranks in rank
order, live ranks before gone ones) while their series fit, then their custom metrics while
those fit. What is left out is counted (`sidecar_metrics_series_dropped`,
`sidecar_metrics_ranks_dropped`) and logged once each time dropping starts. The plan is made
from counts (no family is built for a rank that will not be shown), then checked against the
families actually built, so the answer never exceeds the budget.

Rendering runs in one dedicated thread (`executor`): a scrape of any size never holds the
event loop, so health checks, registrations, pushes and the watchdog go on meanwhile, and
scrapes queue behind each other instead of taking the default executor's threads. A body
rendered less than `metrics_reuse_seconds` ago is answered again, so scraping in a loop (any
local process may) costs at most one rendering per that interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest

from sidecar.collectors.base import CollectorRunner, render_text
from sidecar.metric import spec
from sidecar.ranks.model import Rank, RankKey
from sidecar.ranks.registry import Registry
from sidecar.ranks.training_metrics import TrainingCollector
from sidecar.watchdog.machine import Watchdog

log = logging.getLogger(__name__)

PER_RANK_COLLECTORS = frozenset({"process"})  # their series are budgeted with the rank's
WATCHDOG_SERIES_PER_RANK = 8  # rank_state (6 states) + watchdog_timeout_seconds + rank_waiting_in_collective

SERIES_DROPPED = spec(
    "daemon",
    "metrics_series_dropped",
    "gauge",
    "Series the last /metrics answer left out to stay within limits.max_series "
    "(per-rank series and custom metrics beyond it).",
)
RANKS_DROPPED = spec(
    "daemon",
    "metrics_ranks_dropped",
    "gauge",
    "Ranks whose series the last /metrics answer left out (limits.max_series).",
)
SERIES_LIMIT = spec("daemon", "metrics_series_limit", "gauge", "limits.max_series: the most series /metrics answers.")
METRICS = (SERIES_DROPPED, RANKS_DROPPED, SERIES_LIMIT)
OWN_SERIES = len(METRICS)

Cost = tuple[int, int]  # (a rank's own series, its custom metrics)


@dataclass(frozen=True)
class Plan:
    ranks: frozenset  # admitted rank keys
    custom: frozenset  # admitted with their custom metrics
    dropped_ranks: int
    dropped_series: int


def fair_order(ranks: Iterable[Rank]) -> list[Rank]:
    """Live ranks before gone ones; within each, round robin over jobs (the job registered
    first goes first), each job's ranks in rank order: a job of thousands of ranks cannot
    crowd another job's out."""
    out: list[Rank] = []
    for gone in (False, True):
        jobs: dict[str, list[Rank]] = {}
        for r in sorted((r for r in ranks if r.gone is gone), key=lambda r: (r.rank, r.registered_at)):
            jobs.setdefault(r.job_id, []).append(r)
        queues = sorted(jobs.values(), key=lambda rs: min(r.registered_at for r in rs))
        for i in range(max((len(q) for q in queues), default=0)):
            out.extend(q[i] for q in queues if i < len(q))
    return out


def plan(order: list[RankKey], cost: dict[RankKey, Cost], room: int) -> Plan:
    """Admit ranks in `order` while their own series fit in `room`, then their custom metrics
    (in the same order) while those fit."""
    admitted, used = [], 0
    for key in order:
        own = cost[key][0]
        if used + own > room:
            break
        admitted.append(key)
        used += own
    with_custom = set()
    for key in admitted:
        extra = cost[key][1]
        if used + extra <= room:
            with_custom.add(key)
            used += extra
    shown = set(admitted)
    dropped = sum(own + extra for key, (own, extra) in cost.items() if key not in shown)
    dropped += sum(cost[key][1] for key in admitted if key not in with_custom)
    return Plan(frozenset(admitted), frozenset(with_custom), len(cost) - len(admitted), dropped)


def _rank_key(labels: dict) -> RankKey | None:
    job, rank = labels.get("job_id"), labels.get("rank")
    if job is None or rank is None:
        return None
    try:
        return job, int(rank)
    except ValueError:
        return None


def _count(families: Iterable[Metric]) -> tuple[dict, dict, int]:
    """Per rank key: own samples and custom samples; and the samples of no rank."""
    own: dict = {}
    custom: dict = {}
    other = 0
    for family in families:
        table = custom if family.name == "sidecar_training_custom" else own
        for sample in family.samples:
            key = _rank_key(sample.labels)
            if key is None:
                other += 1
            else:
                table[key] = table.get(key, 0) + 1
    return own, custom, other


def _filtered(families: Iterable[Metric], keep: Callable[[Metric, dict], bool]) -> list[Metric]:
    out = []
    for family in families:
        copy = Metric(family.name, family.documentation, family.type, family.unit)
        copy.samples = [s for s in family.samples if keep(family, s.labels)]
        out.append(copy)
    return out


class MetricsEndpoint:
    """The families of `/metrics`, within `limit` series."""

    def __init__(
        self,
        runner: CollectorRunner,
        registry: Registry,
        training: TrainingCollector,
        watchdog: Watchdog,
        other_sources: Iterable[Callable[[], Iterable[Metric]]],
        limit: int,
        relabel: Callable[[Iterable[Metric]], list[Metric]] = list,
        reuse_seconds: float = 0.0,
    ):
        self.runner, self.registry, self.training, self.watchdog = runner, registry, training, watchdog
        self.relabel = relabel  # adds each rank's pod labels (podlabels.py)
        self.reuse_seconds = reuse_seconds
        self._cache: tuple[float, Callable, bytes] | None = None  # (when, encoder, body)
        self.other_sources = list(other_sources)  # the daemon's own families
        self.limit = limit
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics-render")
        self.last = Plan(frozenset(), frozenset(), 0, 0)
        self._other_series = 64  # series of no rank besides the hardware: refined by each render
        self._warned = False

    # ------------------------------------------------------------ planning

    def _process_counts(self) -> dict:
        out: dict = {}
        for name in PER_RANK_COLLECTORS:
            result = self.runner.results.get(name)
            if result is not None:
                own, _, _ = _count(result.families)
                for key, n in own.items():
                    out[key] = out.get(key, 0) + n
        return out

    def _fixed_series(self) -> int:
        return sum(r.series for name, r in list(self.runner.results.items()) if name not in PER_RANK_COLLECTORS)

    def plan(self, ranks: list[Rank] | None = None) -> Plan:
        """Which ranks fit now, from counts alone (cheap: no family is built). `ranks`: the
        registry's, in `fair_order`."""
        ranks = fair_order(self.registry.ranks()) if ranks is None else ranks
        process = self._process_counts()
        cost: dict = {}
        for r in ranks:
            own, custom = self.training.series(r)
            cost[r.key] = (own + WATCHDOG_SERIES_PER_RANK + process.get(r.key, 0), custom)
        room = self.limit - self._fixed_series() - self._other_series - OWN_SERIES
        return plan([r.key for r in ranks], cost, max(0, room))

    def watched_pids(self, source: Callable[[], list[tuple[str, int, int]]]) -> Callable[[], list]:
        """`source` (the registry's live ranks) narrowed to the ranks /metrics shows: what the
        per-rank collectors look at, so their cost follows the budget, not the registry."""

        def ranks() -> list[tuple[str, int, int]]:
            admitted = self.plan().ranks
            return [entry for entry in source() if (entry[0], entry[1]) in admitted]

        return ranks

    # ------------------------------------------------------------ rendering

    def families(self) -> tuple[list[Metric], list[Metric]]:
        """(the hardware families, the budgeted rest), within the budget."""
        ranks = fair_order(self.registry.ranks())
        first = self.plan(ranks)
        per_rank = [
            f
            for name in PER_RANK_COLLECTORS
            for f in (self.runner.results[name].families if name in self.runner.results else [])
        ]
        built = [
            *_filtered(per_rank, lambda f, labels: _rank_key(labels) in first.ranks),
            *self.runner.health_families(),
            *self.relabel(self.training.collect(only=first.ranks, custom=first.custom)),
            *self.relabel(self.watchdog.families(only=first.ranks)),
        ]
        for source in self.other_sources:
            try:
                built.extend(self.relabel(source()))  # a job's own series: its namespace (podlabels.py)
            except Exception:  # one broken source never breaks the endpoint
                log.exception("metric source %s failed", getattr(source, "__qualname__", source))
        own, custom, other = _count(built)
        self._other_series = other
        # The exact check: the same admission over what was built, in the same order.
        order = [r.key for r in ranks if r.key in own or r.key in custom]
        cost = {k: (own.get(k, 0), custom.get(k, 0)) for k in order}
        room = max(0, self.limit - self._fixed_series() - other - OWN_SERIES)
        final = plan(order, cost, room)
        final = Plan(
            final.ranks,
            final.custom,
            first.dropped_ranks + final.dropped_ranks,
            first.dropped_series + final.dropped_series,
        )
        built = _filtered(built, lambda f, labels: self._shown(final, f, labels))
        self._note(final)
        hardware = [
            f for name, r in list(self.runner.results.items()) if name not in PER_RANK_COLLECTORS for f in r.families
        ]
        return hardware, built + self._own_families(final)

    @staticmethod
    def _shown(p: Plan, family: Metric, labels: dict) -> bool:
        key = _rank_key(labels)
        if key is None:
            return True
        if family.name == "sidecar_training_custom":
            return key in p.custom
        return key in p.ranks

    def _own_families(self, p: Plan) -> list[Metric]:
        dropped, ranks, limit = (m.family() for m in METRICS)
        dropped.add_metric([], p.dropped_series)
        ranks.add_metric([], p.dropped_ranks)
        limit.add_metric([], self.limit)
        return [dropped, ranks, limit]

    def _note(self, p: Plan) -> None:
        self.last = p
        if p.dropped_series and not self._warned:
            log.warning(
                "/metrics is over limits.max_series (%d): leaving out %d series (%d ranks' own, and custom "
                "metrics); see sidecar_metrics_series_dropped",
                self.limit,
                p.dropped_series,
                p.dropped_ranks,
            )
        self._warned = bool(p.dropped_series)

    def render(self, encoder: Callable | None = None) -> bytes:
        """The answer's body: Prometheus text (the hardware part as its collectors rendered it),
        or `encoder`'s format over every family. Runs in `executor`. A body rendered less than
        `reuse_seconds` ago is answered again: scraping in a loop costs at most one rendering
        per `reuse_seconds`, and scrapes queued meanwhile share it."""
        encoder = generate_latest if encoder is None else encoder
        cached = self._cache
        if cached is not None and cached[1] is encoder and time.monotonic() - cached[0] < self.reuse_seconds:
            return cached[2]
        hardware, rest = self.families()
        if encoder is generate_latest:
            body = self.runner.rendered_text(exclude=PER_RANK_COLLECTORS) + render_text(rest)
        else:
            body = encoder(_Registry(hardware + rest))
        self._cache = (time.monotonic(), encoder, body)
        return body

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class _Registry:
    """A fixed list of families with the `collect()` that prometheus-client's encoders call."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families
