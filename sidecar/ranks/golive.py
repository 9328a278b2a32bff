"""A new job's go-live checks (the operations guide's "上线验证"): what `sidecar status`, `/v1/status`
(`golive`) and `sidecar_job_golive_check` say of each job with ranks on this node.

    ranks_joined  every local rank registered (the local world size the ranks gave)
    first_batch   every local rank finished its first step (its first batch loaded)
    gpu_memory    the ranks' GPU memory (NVML's per-process lists) balanced within the imbalance share
    throughput    the ranks' tokens/s, samples/s or step times balanced within the same share
    loss          the loss fell over the job's first N steps (watchdog.golive_steps)

Each check is `ok`, `pending` (not known yet), `warning` (with a sentence of what differs: the guide's
sign of conflicting memory-saving or gradient-accumulation settings between ranks) or `unavailable`
(nothing on this node reports it: no GPU memory per process, a job that pushes no loss).

Here only this node's ranks are judged. `figures` gives each rank's few figures (and rank 0's node
the first steps' loss) that the job view carries to the job's coordinator, which judges the same
checks over every rank of every node (sidecar/jobview/golive.py); `/v1/status` shows its judgement
while fresh (`judged_by: coordinator`), this node's otherwise. The metric is always this node's.
The loss of the first N steps is the one thing kept beyond what the registry holds: per job, the mean
loss of its local ranks at each step of its first N (bounded: N steps, MAX_JOBS jobs).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.core import Metric

from sidecar.metric import MetricSpec, spec
from sidecar.ranks.model import Rank

CHECKS = ("ranks_joined", "first_batch", "gpu_memory", "throughput", "loss")
OK, PENDING, WARNING, UNAVAILABLE = "ok", "pending", "warning", "unavailable"
VALUES = {OK: 1.0, WARNING: 0.0, PENDING: -1.0}  # `unavailable`: no series
MAX_JOBS = 256  # jobs whose first steps' loss is kept (the registry bounds live jobs far below)
MIN_STEP_TIMES = 3  # step intervals per rank before its throughput is compared
GIB = float(1 << 30)
MIB = 1 << 20

GOLIVE_CHECK = spec(
    "training",
    "job_golive_check",
    "gauge",
    "A job's go-live checks on this node (check: ranks_joined, first_batch, gpu_memory, throughput, loss): "
    "1 ok, 0 warning (the ranks' GPU memory or throughput differ by more than watchdog.golive_imbalance_ratio, "
    "or the loss did not fall over the first watchdog.golive_steps steps), -1 pending. No series for a check "
    "nothing here reports (no per-process GPU memory, no loss). `sidecar status` says what differs.",
    ["job_id", "check"],
)
METRICS: tuple[MetricSpec, ...] = (GOLIVE_CHECK,)


@dataclass
class Check:
    state: str
    text: str

    def as_dict(self) -> dict[str, str]:
        return {"state": self.state, "text": self.text}


@dataclass
class _LossWindow:
    """The mean loss of a job's local ranks at each of its first N steps."""

    first_step: int
    last_step: int
    sums: dict[int, list[float]] = field(default_factory=dict)  # step -> [sum, count]
    nonfinite: int = 0


@dataclass
class RankFigures:
    """What the go-live checks read of one rank, as its node sends them to the job's coordinator
    (sidecar/jobview/golive.py): rounded, so that a report carries them only when they changed."""

    rank: int
    stepped: bool  # its first step seen (its first batch loaded)
    memory: int | None = None  # GPU memory bytes (NVML's per-process lists, to the MiB)
    tokens_per_second: float | None = None
    samples_per_second: float | None = None
    step_seconds: float | None = None  # its median step time, once MIN_STEP_TIMES are known

    def to_wire(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class JobFigures:
    """A node's figures of one job: each local rank's, the local world size its ranks gave, and
    the job's loss over its first N steps when the job's rank 0 is here."""

    expected: int
    steps: int  # its watchdog.golive_steps and golive_imbalance_ratio (the coordinator takes rank 0's node's)
    share: float
    ranks: list[RankFigures]
    loss: LossFigures | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"expected": self.expected, "steps": self.steps, "share": self.share}
        out["ranks"] = [r.to_wire() for r in self.ranks]
        if self.loss is not None:
            out["loss"] = {k: v for k, v in asdict(self.loss).items() if v is not None}
        return out


def _rounded(v: Any) -> float | None:
    return float(f"{v:.4g}") if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None


def rank_figures(r: Rank, memory: float | None) -> RankFigures:
    median = statistics.median(r.step_times) if len(r.step_times) >= MIN_STEP_TIMES else None
    return RankFigures(
        r.rank, r.step is not None, None if memory is None else int(round(memory / MIB)) * MIB,
        _rounded(r.metrics.get("tokens_per_second")), _rounded(r.metrics.get("samples_per_second")), _rounded(median),
    )  # fmt: skip


class GoLive:
    """Keeps each job's first steps' loss (`observe`, from the push API) and judges the checks
    (`evaluate`) from the registry's ranks, their GPU memory and the settings."""

    def __init__(self) -> None:
        self._windows: dict[str, _LossWindow] = {}

    def observe(self, job_id: str, steps: Iterable[tuple[int, float | None]], window: int) -> None:
        """A rank's step reports (step, loss or None), in order, as the push API accepted them."""
        for step, loss in steps:
            w = self._windows.get(job_id)
            if w is None:
                if len(self._windows) >= MAX_JOBS:
                    del self._windows[next(iter(self._windows))]
                w = self._windows[job_id] = _LossWindow(step, step)
            if step < w.first_step or step >= w.first_step + window:
                w.last_step = max(w.last_step, step)
                continue
            w.last_step = max(w.last_step, step)
            if loss is None:
                continue
            if not math.isfinite(loss):
                w.nonfinite += 1
                continue
            acc = w.sums.setdefault(step, [0.0, 0])
            acc[0] += loss
            acc[1] += 1

    def forget(self, live_jobs: Iterable[str]) -> None:
        keep = set(live_jobs)
        for job_id in [j for j in self._windows if j not in keep]:
            del self._windows[job_id]

    def evaluate(
        self, ranks: Iterable[Rank], memory: Mapping[tuple[str, int], float], window: int, share: float
    ) -> dict[str, dict]:
        """Per job with live ranks here: its overall state and each check's state and sentence."""
        by_job: dict[str, list[Rank]] = {}
        for r in ranks:
            if not r.gone:
                by_job.setdefault(r.job_id, []).append(r)
        out = {}
        for job_id, job_ranks in sorted(by_job.items()):
            job_ranks.sort(key=lambda r: r.rank)
            mem = {r.rank: memory[(job_id, r.rank)] for r in job_ranks if (job_id, r.rank) in memory}
            checks = judge(job_ranks, mem, self._windows.get(job_id), window, share)
            states = {c.state for c in checks.values()}
            overall = WARNING if WARNING in states else PENDING if PENDING in states else OK
            out[job_id] = {
                "state": overall,
                "steps": window,
                "imbalance_ratio": share,
                "checks": {name: c.as_dict() for name, c in checks.items()},
            }
        return out

    def figures(
        self, job_id: str, ranks: Iterable[Rank], memory: Mapping[tuple[str, int], float], window: int, share: float
    ) -> JobFigures | None:
        """This node's figures of the job for its coordinator (None: no live rank of it here)."""
        mine = sorted((r for r in ranks if r.job_id == job_id and not r.gone), key=lambda r: r.rank)
        if not mine:
            return None
        w = self._windows.get(job_id)
        return JobFigures(
            max(r.local_world_size for r in mine),
            window,
            share,
            [rank_figures(r, memory.get((job_id, r.rank))) for r in mine],
            loss_figures(w) if w is not None and mine[0].rank == 0 else None,
        )

    def families(self, judged: Mapping[str, dict]) -> list[Metric]:
        family = GOLIVE_CHECK.family()
        for job_id, job in sorted(judged.items()):
            for name, check in job["checks"].items():
                if check["state"] in VALUES:
                    family.add_metric([job_id, name], VALUES[check["state"]])
        return [family]


# ---------------------------------------------------------------- the checks


def judge(
    ranks: list[Rank], memory: Mapping[int, float], loss: _LossWindow | None, window: int, share: float
) -> dict[str, Check]:
    """The checks of one job's live local ranks (sorted by rank)."""
    joined = ranks_joined(ranks)
    first = first_batch(ranks)
    started = first.state == OK
    return {
        "ranks_joined": joined,
        "first_batch": first,
        "gpu_memory": gpu_memory(ranks, memory, share) if started else _waiting(first),
        "throughput": throughput(ranks, share) if started else _waiting(first),
        "loss": loss_check(loss, window),
    }


def _waiting(first: Check) -> Check:
    return Check(PENDING, "waiting for every rank's first step")


def ranks_text(numbers: Iterable[int]) -> str:
    items = sorted(numbers)
    return ", ".join(map(str, items[:8])) + (f" and {len(items) - 8} more" if len(items) > 8 else "")


def ranks_joined(ranks: list[Rank]) -> Check:
    expected = max(r.local_world_size for r in ranks)
    world = max(r.world_size for r in ranks)
    have = len({r.rank for r in ranks})
    text = f"{have} of {expected} local ranks registered (world size {world})"
    return Check(OK if have >= expected else PENDING, text)


def first_batch(ranks: list[Rank]) -> Check:
    waiting = [r.rank for r in ranks if r.step is None]
    if waiting:
        return Check(PENDING, f"rank {ranks_text(waiting)} not past its first batch yet")
    return Check(OK, f"every local rank finished its first step (now at steps {_span([r.step or 0 for r in ranks])})")


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def outlier(values: Mapping[int, float]) -> tuple[int, float, float, float] | None:
    """The rank furthest from the median of the others: (rank, its value, the others' min, max),
    or None with fewer than two ranks. Its relative difference is `difference(values, rank)`.
    O(n log n): a job's coordinator compares every rank of the job (8,000 and more)."""
    if len(values) < 2:
        return None
    order = sorted(values.values())
    m = len(order) - 1  # the others
    best: tuple[float, float, int] | None = None
    for rank, v in values.items():
        i = bisect.bisect_left(order, v)  # removing any copy of v leaves the same others

        def other(j: int, i: int = i) -> float:
            return order[j] if j < i else order[j + 1]

        med = other(m // 2) if m % 2 else (other(m // 2 - 1) + other(m // 2)) / 2
        dev = abs(v - med) / med if med > 0 else (0.0 if v == med else math.inf)
        key = (dev, v, -rank)
        if best is None or key > best:
            best = key
    assert best is not None
    rank = -best[2]
    i = bisect.bisect_left(order, values[rank])
    others = order[:i] + order[i + 1 :]
    return rank, values[rank], others[0], others[-1]


def difference(values: Mapping[int, float], rank: int) -> float:
    """The rank's value relative to the median of the others (+0.41: 41% above)."""
    med = statistics.median([w for r, w in values.items() if r != rank])
    return (values[rank] - med) / med if med > 0 else (0.0 if values[rank] == med else math.inf)


def balance(values: Mapping[int, float], share: float, unit: str, fmt, nodes: Mapping[int, str] | None = None) -> Check:
    """`nodes`: each rank's node, named with the rank that differs (the job-wide judgement)."""
    found = outlier(values)
    if found is None:
        ((rank, v),) = values.items()
        return Check(OK, f"only rank {rank} here: {fmt(v)} {unit} (nothing to compare)")
    rank, v, lo, hi = found
    diff = difference(values, rank)
    others = fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"
    if abs(diff) > share:
        pct = "+inf" if math.isinf(diff) else f"{diff:+.0%}"
        on = f" on {nodes[rank]}" if nodes and rank in nodes else ""
        return Check(WARNING, f"rank {rank}{on} {unit_text(unit, v, fmt)}, the others {others} {unit} ({pct})")
    all_lo, all_hi = min(values.values()), max(values.values())
    span = fmt(all_lo) if fmt(all_lo) == fmt(all_hi) else f"{fmt(all_lo)}-{fmt(all_hi)}"
    return Check(OK, f"ranks {ranks_text(values)}: {span} {unit} (within {share:.0%})")


def unit_text(unit: str, v: float, fmt) -> str:
    if unit == "GiB":
        return f"uses {fmt(v)} GiB"
    if unit == "s per step":
        return f"steps in {fmt(v)} s"
    return f"at {fmt(v)} {unit}"


def gpu_memory(ranks: list[Rank], memory: Mapping[int, float], share: float) -> Check:
    if not memory:
        return Check(UNAVAILABLE, "no per-rank GPU memory here (no NVML process list: no GPU, or gpu_source dcgm)")
    missing = [r.rank for r in ranks if r.rank not in memory]
    if missing:
        return Check(PENDING, f"GPU memory of rank {ranks_text(missing)} not seen yet")
    return balance({k: v / GIB for k, v in memory.items()}, share, "GiB", lambda v: f"{v:.1f}")


def throughput(ranks: list[Rank], share: float) -> Check:
    for key, unit in (("tokens_per_second", "tokens/s"), ("samples_per_second", "samples/s")):
        rates = {r.rank: r.metrics.get(key) for r in ranks}
        if all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in rates.values()):
            return balance({k: float(v or 0) for k, v in rates.items()}, share, unit, lambda v: f"{v:.4g}")
    short = [r.rank for r in ranks if len(r.step_times) < MIN_STEP_TIMES]
    if short:
        return Check(PENDING, f"rank {ranks_text(short)} has fewer than {MIN_STEP_TIMES} step times yet")
    times = {r.rank: statistics.median(r.step_times) for r in ranks}
    if any(t <= 0 for t in times.values()):
        return Check(PENDING, "step times not measurable yet")
    return balance(times, share, "s per step", lambda v: f"{v:.3g}")


@dataclass
class LossFigures:
    """A job's loss over its first N steps, in the few numbers the loss check reads (and a node
    hosting the job's rank 0 sends its coordinator): the steps seen, the mean loss of the first
    and the last fifth of the steps with a loss (None: fewer than two), non-finite reports."""

    first_step: int
    last_step: int
    points: int = 0  # steps with a finite loss in the window
    head: float | None = None
    tail: float | None = None
    nonfinite: int = 0
    first_loss_step: int | None = None  # the first and last step with a loss (the text's span)
    last_loss_step: int | None = None


def loss_figures(w: _LossWindow) -> LossFigures:
    points = [(s, acc[0] / acc[1]) for s, acc in sorted(w.sums.items()) if acc[1]]
    out = LossFigures(w.first_step, w.last_step, len(points), nonfinite=w.nonfinite)
    if len(points) >= 2:
        k = max(1, len(points) // 5)
        out.head = sum(v for _, v in points[:k]) / k
        out.tail = sum(v for _, v in points[-k:]) / k
        out.first_loss_step, out.last_loss_step = points[0][0], points[-1][0]
    return out


def loss_check(w: _LossWindow | LossFigures | None, window: int) -> Check:
    if w is None:
        return Check(PENDING, f"no step reported yet (judged over the first {window} steps)")
    f = loss_figures(w) if isinstance(w, _LossWindow) else w
    end = f.first_step + window - 1
    if f.last_step < end:
        return Check(PENDING, f"at step {f.last_step} of {f.first_step}-{end}")
    if f.head is None or f.tail is None:
        if f.nonfinite:
            return Check(WARNING, f"loss not finite over steps {f.first_step}-{end} ({f.nonfinite} reports)")
        return Check(UNAVAILABLE, f"the job reported no loss over steps {f.first_step}-{end}")
    head, tail = f.head, f.tail
    steps = f"steps {f.first_loss_step}-{f.last_loss_step}"
    if f.nonfinite:
        return Check(WARNING, f"loss not finite {f.nonfinite} times over {steps}: {head:.4g} -> {tail:.4g}")
    if tail < head:
        return Check(OK, f"loss fell over {steps}: {head:.4g} -> {tail:.4g}")
    return Check(WARNING, f"loss did not fall over {steps}: {head:.4g} -> {tail:.4g}")


def memory_of(families: Iterable[Metric]) -> dict[tuple[str, int], float]:
    """memory_by_rank over the collectors' latest families."""
    return memory_by_rank(
        (s.labels, s.value) for f in families for s in f.samples if s.name == "sidecar_gpu_process_memory_bytes"
    )


def memory_by_rank(samples: Iterable[tuple[Mapping[str, str], float]]) -> dict[tuple[str, int], float]:
    """Per (job_id, rank), the GPU memory NVML lists for its processes, summed over GPUs, from the
    samples of sidecar_gpu_process_memory_bytes (labels, value)."""
    out: dict[tuple[str, int], float] = {}
    for labels, value in samples:
        job_id, rank = labels.get("job_id"), labels.get("rank")
        if job_id is None or rank is None or not rank.isdigit() or not math.isfinite(value):
            continue
        key = (job_id, int(rank))
        out[key] = out.get(key, 0.0) + value
    return out
