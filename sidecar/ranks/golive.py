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

Only this node's ranks are judged: the job view carries no memory or throughput of other nodes' ranks.
The loss of the first N steps is the one thing kept beyond what the registry holds: per job, the mean
loss of its local ranks at each step of its first N (bounded: N steps, MAX_JOBS jobs).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import Metric

from sidecar.metric import MetricSpec, spec
from sidecar.ranks.model import Rank

CHECKS = ("ranks_joined", "first_batch", "gpu_memory", "throughput", "loss")
OK, PENDING, WARNING, UNAVAILABLE = "ok", "pending", "warning", "unavailable"
VALUES = {OK: 1.0, WARNING: 0.0, PENDING: -1.0}  # `unavailable`: no series
MAX_JOBS = 256  # jobs whose first steps' loss is kept (the registry bounds live jobs far below)
MIN_STEP_TIMES = 3  # step intervals per rank before its throughput is compared
GIB = float(1 << 30)

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


def _ranks_text(numbers: Iterable[int]) -> str:
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
        return Check(PENDING, f"rank {_ranks_text(waiting)} not past its first batch yet")
    return Check(OK, f"every local rank finished its first step (now at steps {_span([r.step or 0 for r in ranks])})")


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def outlier(values: Mapping[int, float]) -> tuple[int, float, float, float] | None:
    """The rank furthest from the median of the others: (rank, its value, the others' min, max),
    or None with fewer than two ranks. Its relative difference is `difference(values, rank)`."""
    if len(values) < 2:
        return None
    best: tuple[float, float, int] | None = None
    for rank, v in values.items():
        others = [w for r, w in values.items() if r != rank]
        med = statistics.median(others)
        dev = abs(v - med) / med if med > 0 else (0.0 if v == med else math.inf)
        key = (dev, v, -rank)
        if best is None or key > best:
            best = key
    assert best is not None
    rank = -best[2]
    others = [w for r, w in values.items() if r != rank]
    return rank, values[rank], min(others), max(others)


def difference(values: Mapping[int, float], rank: int) -> float:
    """The rank's value relative to the median of the others (+0.41: 41% above)."""
    med = statistics.median([w for r, w in values.items() if r != rank])
    return (values[rank] - med) / med if med > 0 else (0.0 if values[rank] == med else math.inf)


def _balance(values: Mapping[int, float], share: float, unit: str, fmt) -> Check:
    found = outlier(values)
    if found is None:
        ((rank, v),) = values.items()
        return Check(OK, f"only rank {rank} here: {fmt(v)} {unit} (nothing to compare)")
    rank, v, lo, hi = found
    diff = difference(values, rank)
    others = fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"
    if abs(diff) > share:
        pct = "+inf" if math.isinf(diff) else f"{diff:+.0%}"
        return Check(WARNING, f"rank {rank} {unit_text(unit, v, fmt)}, the others {others} {unit} ({pct})")
    all_lo, all_hi = min(values.values()), max(values.values())
    span = fmt(all_lo) if fmt(all_lo) == fmt(all_hi) else f"{fmt(all_lo)}-{fmt(all_hi)}"
    return Check(OK, f"ranks {_ranks_text(values)}: {span} {unit} (within {share:.0%})")


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
        return Check(PENDING, f"GPU memory of rank {_ranks_text(missing)} not seen yet")
    return _balance({k: v / GIB for k, v in memory.items()}, share, "GiB", lambda v: f"{v:.1f}")


def throughput(ranks: list[Rank], share: float) -> Check:
    for key, unit in (("tokens_per_second", "tokens/s"), ("samples_per_second", "samples/s")):
        rates = {r.rank: r.metrics.get(key) for r in ranks}
        if all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in rates.values()):
            return _balance({k: float(v or 0) for k, v in rates.items()}, share, unit, lambda v: f"{v:.4g}")
    short = [r.rank for r in ranks if len(r.step_times) < MIN_STEP_TIMES]
    if short:
        return Check(PENDING, f"rank {_ranks_text(short)} has fewer than {MIN_STEP_TIMES} step times yet")
    times = {r.rank: statistics.median(r.step_times) for r in ranks}
    if any(t <= 0 for t in times.values()):
        return Check(PENDING, "step times not measurable yet")
    return _balance(times, share, "s per step", lambda v: f"{v:.3g}")


def loss_check(w: _LossWindow | None, window: int) -> Check:
    if w is None:
        return Check(PENDING, f"no step reported yet (judged over the first {window} steps)")
    end = w.first_step + window - 1
    if w.last_step < end:
        return Check(PENDING, f"at step {w.last_step} of {w.first_step}-{end}")
    points = [(s, acc[0] / acc[1]) for s, acc in sorted(w.sums.items()) if acc[1]]
    if len(points) < 2:
        if w.nonfinite:
            return Check(WARNING, f"loss not finite over steps {w.first_step}-{end} ({w.nonfinite} reports)")
        return Check(UNAVAILABLE, f"the job reported no loss over steps {w.first_step}-{end}")
    k = max(1, len(points) // 5)
    head = sum(v for _, v in points[:k]) / k
    tail = sum(v for _, v in points[-k:]) / k
    steps = f"steps {points[0][0]}-{points[-1][0]}"
    if w.nonfinite:
        return Check(WARNING, f"loss not finite {w.nonfinite} times over {steps}: {head:.4g} -> {tail:.4g}")
    if tail < head:
        return Check(OK, f"loss fell over {steps}: {head:.4g} -> {tail:.4g}")
    return Check(WARNING, f"loss did not fall over {steps}: {head:.4g} -> {tail:.4g}")


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
