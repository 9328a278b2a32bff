"""Training metrics, read live from the rank registry at scrape time (no sampling: the
registry already holds the latest pushed values, and reading it is cheap).

Ranks that are gone stay exported until the registry drops them
(limits.gone_retention_seconds), so the last values of a crashed rank remain visible. A rank's
lateness (lateness.py) is shown only while it runs: it is judged against its live peers.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from prometheus_client.core import Metric

from sidecar.metric import MetricSpec, spec
from sidecar.ranks import lateness
from sidecar.ranks.model import Rank, RankKey
from sidecar.ranks.registry import Registry

RANK = ("job_id", "rank")


def _s(name: str, type_: str, help_: str, labels=RANK) -> MetricSpec:
    return spec("training", name, type_, help_, labels)


STEP = _s("training_step", "gauge", "The last step the rank reported.")
# Gauges that mirror a well-known pushed (or derived) metric key.
VALUE_GAUGES: tuple[tuple[str, MetricSpec], ...] = (
    ("loss", _s("training_loss", "gauge", "The rank's last reported loss (NaN when it was not finite).")),
    ("grad_norm", _s("training_grad_norm", "gauge", "The rank's last reported gradient norm.")),
    ("lr", _s("training_learning_rate", "gauge", "The rank's last reported learning rate.")),
    (
        "iterations_per_second",
        _s(
            "training_iterations_per_second",
            "gauge",
            "Steps per second (sent by the rank, or derived from its step times).",
        ),
    ),
    (
        "samples_per_second",
        _s("training_samples_per_second", "gauge", "Samples per second (sent, or samples per step / step time)."),
    ),
    (
        "tokens_per_second",
        _s("training_tokens_per_second", "gauge", "Tokens per second (sent, or tokens per step / step time)."),
    ),
    (
        "step_time_seconds",
        _s(
            "training_step_time_seconds",
            "gauge",
            "Duration of the rank's last step (sent, or derived from step report times).",
        ),
    ),
)
PHASE = _s(
    "training_phase",
    "gauge",
    "1 for the phase the rank declared it is in (no series outside phases).",
    ("job_id", "rank", "phase"),
)
RESTARTS = _s(
    "training_restarts",
    "gauge",
    "The worker group's restart count when the rank registered (TORCHELASTIC_RESTART_COUNT).",
)
CKPT_STEP = _s("training_last_checkpoint_step", "gauge", "Step of the rank's last saved checkpoint.")
CKPT_TIME = _s("training_last_checkpoint_timestamp_seconds", "gauge", "Unix time of the rank's last saved checkpoint.")
PROGRESS_TIME = _s(
    "training_last_progress_timestamp_seconds",
    "gauge",
    "Unix time the rank's step last advanced (registration time before the first step).",
)
NONFINITE = _s(
    "training_nonfinite",
    "counter",
    "Non-finite (NaN or infinite) values the rank reported, per metric.",
    ("job_id", "rank", "metric"),
)
CUSTOM = _s(
    "training_custom",
    "gauge",
    "The last value of a custom metric the rank pushed (bounded by limits.max_custom_metrics per job).",
    ("job_id", "rank", "name"),
)
DROPPED = _s(
    "hooks_dropped_records", "counter", "Records the rank's hooks had to drop (sidecar unreachable or buffer full)."
)
# Counters and a histogram Prometheus can rate() (sidecar/ranks/stepcounters.py): they continue across
# a rank's re-registrations while the registry keeps it.
STEPS = _s("training_steps", "counter", "Steps the rank advanced (a resumed run's repeated steps count again).")
SAMPLES = _s("training_samples", "counter", "Samples the rank trained on (the per-step `samples` it sent x steps).")
TOKENS = _s("training_tokens", "counter", "Tokens the rank trained on (the per-step `tokens` it sent x steps).")
STEP_DURATION = _s(
    "training_step_duration_seconds",
    "histogram",
    "Step times of the rank (sent, or derived from step report times), in buckets from 5 ms to 10 min.",
)
RATE_SPECS = (STEPS, SAMPLES, TOKENS, STEP_DURATION)
RANKS = _s("training_ranks_registered", "gauge", "Ranks of the job registered on this node and not gone.", ("job_id",))
WORLD = _s("training_world_size", "gauge", "The job's world size, as its ranks registered it.", ("job_id",))

METRICS: tuple[MetricSpec, ...] = (
    STEP,
    *(s for _, s in VALUE_GAUGES),
    PHASE,
    RESTARTS,
    CKPT_STEP,
    CKPT_TIME,
    PROGRESS_TIME,
    NONFINITE,
    CUSTOM,
    DROPPED,
    *RATE_SPECS,
    RANKS,
    WORLD,
    lateness.LATENESS,
)


class TrainingCollector:
    """Maps the registry's ranks onto the training families. Runs on the event loop."""

    name = "training"
    metrics = METRICS

    def __init__(
        self, registry: Registry, job_lateness: lateness.JobLevel | None = None, tracker: lateness.Tracker | None = None
    ):
        self.registry = registry
        # the ranks' collective entry times, judged per job: the daemon's one tracker, which /v1/status reads too
        self.lateness = tracker if tracker is not None else lateness.Tracker()
        self.job_lateness = job_lateness  # job -> this node's ranks' lateness judged across nodes (the job view)

    def collect(
        self, only: Collection[RankKey] | None = None, custom: Collection[RankKey] | None = None
    ) -> Iterable[Metric]:
        """The families; per-rank series only of the ranks in `only`, custom metrics only of
        those in `custom` (None: every rank), as /metrics' series budget decides."""
        all_ranks = sorted(self.registry.ranks(), key=lambda r: (r.job_id, r.rank))
        ranks = all_ranks if only is None else [r for r in all_ranks if r.key in only]
        step = STEP.family()
        values = [(key, s.family()) for key, s in VALUE_GAUGES]
        phase, restarts, ckpt_step, ckpt_time, progress, nonfinite, custom_family, dropped = (
            s.family() for s in (PHASE, RESTARTS, CKPT_STEP, CKPT_TIME, PROGRESS_TIME, NONFINITE, CUSTOM, DROPPED)
        )
        steps, samples, tokens, durations = (s.family() for s in RATE_SPECS)
        for r in ranks:
            labels = [r.job_id, str(r.rank)]
            if r.step is not None:
                step.add_metric(labels, r.step)
            for key, family in values:
                if key in r.metrics:
                    family.add_metric(labels, r.metrics[key])
            if r.phase is not None:
                phase.add_metric(labels + [r.phase], 1)
            restarts.add_metric(labels, r.restart_count)
            if r.last_checkpoint_step is not None:
                ckpt_step.add_metric(labels, r.last_checkpoint_step)
            if r.last_checkpoint_time is not None:
                ckpt_time.add_metric(labels, r.last_checkpoint_time)
            progress.add_metric(labels, r.last_progress_wall)
            for metric, count in sorted(r.nonfinite.items()):
                nonfinite.add_metric(labels + [metric], count)
            if custom is None or r.key in custom:
                for name, value in sorted(r.custom.items()):
                    custom_family.add_metric(labels + [name], value)
            dropped.add_metric(labels, r.dropped)
            c = r.counters
            if c.steps:
                steps.add_metric(labels, c.steps)
            if c.samples:
                samples.add_metric(labels, c.samples)
            if c.tokens:
                tokens.add_metric(labels, c.tokens)
            if c.step_time_count:
                durations.add_metric(labels, c.buckets(), c.step_time_sum)
        yield step
        yield from (f for _, f in values)
        yield from (phase, restarts, ckpt_step, ckpt_time, progress, nonfinite, custom_family, dropped)
        yield from (steps, samples, tokens, durations)
        yield from lateness.families(self.lateness, all_ranks, only, self.job_lateness)
        yield from self._job_families(all_ranks)

    @staticmethod
    def series(r: Rank) -> tuple[int, int]:
        """How many series `collect` gives one rank: (its own, its custom metrics)."""
        own = (
            2
            + (r.step is not None)
            + sum(1 for key, _ in VALUE_GAUGES if key in r.metrics)
            + (r.phase is not None)
            + (r.last_checkpoint_step is not None)
            + (r.last_checkpoint_time is not None)
            + len(r.nonfinite)
            + 1
            + (r.counters.steps > 0)
            + (r.counters.samples > 0)
            + (r.counters.tokens > 0)
            + (len(r.counters.step_time_counts) + 2 if r.counters.step_time_count else 0)
            + lateness.series(r)
        )
        return own, len(r.custom)

    @staticmethod
    def _job_families(ranks: list[Rank]) -> Iterable[Metric]:
        registered, world = RANKS.family(), WORLD.family()
        by_job: dict[str, list[Rank]] = {}
        for r in ranks:
            by_job.setdefault(r.job_id, []).append(r)
        for job, rs in by_job.items():
            registered.add_metric([job], sum(1 for r in rs if not r.gone))
            # The newest registration knows the current world size (elastic jobs change it).
            world.add_metric([job], max(rs, key=lambda r: r.registered_at).world_size)
        yield registered
        yield world
