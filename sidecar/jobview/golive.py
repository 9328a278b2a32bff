"""The go-live checks over the whole job: judged by the job's coordinator from every node's figures.

On one node, sidecar/ranks/golive.py judges its own ranks. The job's checks need every rank: every
rank of the job's world size joined, each past its first batch, GPU memory and throughput balanced
across all ranks of the job (a rank on another node using 40% more memory is the sign the guide
names), the loss of the job's rank 0 falling. So each node's report carries its ranks' few figures
and the coordinator answers every node with the job-wide checks.

On the wire (both optional: a peer that predates them neither sends nor reads them; absent = none):

- a report's `golive`: `{"expected": local world size, "steps": N, "share": ratio, "ranks": [{"rank",
  "stepped", "memory" (bytes, to the MiB), "tokens_per_second", "samples_per_second", "step_seconds"},
  ...], "loss": {"first_step", "last_step", "points", "head", "tail", "nonfinite", ...}}` (the loss only
  from the node hosting rank 0), sent when the figures changed since the coordinator last took them,
  and again at least every REFRESH_SECONDS (a coordinator that restarted learns them);
- the answer's `golive`: `{"time", "age_seconds", "ranks", "nodes", "world_size", "checks": {name:
  {"state", "text"}}}`: five short sentences, whatever the job's size.

What a peer can do with it (docs/security.md): a holder of the job's key can make the job's go-live
checks say what it likes (a rank that differs, a loss that falls); nothing else reads them, nothing is
ever signalled for them, and every field is bounded and validated (ProtocolError naming the field).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.ranks import golive as local
from sidecar.ranks.golive import (
    CHECKS,
    GIB,
    MIN_STEP_TIMES,
    OK,
    PENDING,
    UNAVAILABLE,
    WARNING,
    Check,
    JobFigures,
    LossFigures,
    RankFigures,
)
from sidecar.ranks.protocol import CONTROL_RE, ProtocolError
from trainer_hooks.wire import MAX_RANK, MAX_TIME

STATES = (OK, PENDING, WARNING, UNAVAILABLE)
MAX_BYTES = float(1 << 50)  # a rank's GPU memory (1 PiB)
MAX_RATE = 1e12  # tokens or samples per second
MAX_STEP = (1 << 63) - 1
MAX_LOSS = 1e30
MAX_CHECK_TEXT = 480  # a check's sentence in an answer
MAX_CHECKS = 8
NAMED = 4  # ranks named with their node in one sentence
JUDGE_EVERY_SECONDS = 1.0  # a job's checks are judged at most this often (when new figures came) ...
REJUDGE_SECONDS = 10.0  # ... and at least this often while nodes report (a silent node drops out)
REFRESH_SECONDS = 60.0  # a node sends unchanged figures again this often
FRESH_SECONDS = 45.0  # a node shows the job-wide checks while their judgement is younger than this


# ---------------------------------------------------------------- parsing (a peer's input)


def _num(obj: dict, key: str, where: str, hi: float, lo: float = 0.0, positive: bool = False) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    ok = type(value) in (int, float) and math.isfinite(value) and lo <= value < hi and (value > 0 or not positive)
    if not ok:
        raise ProtocolError(f"{where}.{key}: expected a number in [{lo:g}, {hi:g})" + (", above 0" if positive else ""))
    return float(value)


def _count(obj: dict, key: str, where: str, hi: int, lo: int = 0, default: int | None = None) -> int:
    value = obj.get(key, default)
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"{where}.{key}: expected an integer in [{lo}, {hi}]")
    return value


def _array(value: Any, where: str, limit: int) -> list:
    if type(value) is not list:
        raise ProtocolError(f"{where}: expected an array")
    if len(value) > limit:
        raise ProtocolError(f"{where}: at most {limit} entries, got {len(value)}", code="too_large", status=413)
    return value


def _loss(raw: Any, where: str) -> LossFigures | None:
    if raw is None:
        return None
    if type(raw) is not dict:
        raise ProtocolError(f"{where}: expected an object or null")
    first = _count(raw, "first_step", where, MAX_STEP)
    spans = {k: raw.get(k) for k in ("first_loss_step", "last_loss_step")}
    return LossFigures(
        first_step=first,
        last_step=_count(raw, "last_step", where, MAX_STEP, lo=first),
        points=_count(raw, "points", where, 100_000, default=0),
        head=_num(raw, "head", where, MAX_LOSS, lo=-MAX_LOSS),
        tail=_num(raw, "tail", where, MAX_LOSS, lo=-MAX_LOSS),
        nonfinite=_count(raw, "nonfinite", where, 1 << 31, default=0),
        **{k: None if v is None else _count(raw, k, where, MAX_STEP) for k, v in spans.items()},
    )


def parse_figures(raw: Any, max_ranks: int, where: str = "golive") -> JobFigures | None:
    """A report's `golive` (absent: none); ProtocolError names the first bad field."""
    if raw is None:
        return None
    if type(raw) is not dict:
        raise ProtocolError(f"{where}: expected an object or null")
    ranks: list[RankFigures] = []
    seen: set[int] = set()
    for i, obj in enumerate(_array(raw.get("ranks"), f"{where}.ranks", max_ranks)):
        here = f"{where}.ranks[{i}]"
        if type(obj) is not dict:
            raise ProtocolError(f"{here}: expected an object")
        rank = _count(obj, "rank", here, MAX_RANK)
        if rank in seen:
            raise ProtocolError(f"{here}.rank: rank {rank} is named twice")
        seen.add(rank)
        stepped = obj.get("stepped")
        if type(stepped) is not bool:
            raise ProtocolError(f"{here}.stepped: expected true or false")
        memory = _num(obj, "memory", here, MAX_BYTES)
        ranks.append(
            RankFigures(
                rank, stepped, None if memory is None else int(memory),
                _num(obj, "tokens_per_second", here, MAX_RATE, positive=True),
                _num(obj, "samples_per_second", here, MAX_RATE, positive=True),
                _num(obj, "step_seconds", here, MAX_TIME, positive=True),
            )
        )  # fmt: skip
    share = _num(raw, "share", where, 10.0 + 1e-9, positive=True)
    if share is None:
        raise ProtocolError(f"{where}.share: expected a number in (0, 10]")
    return JobFigures(
        expected=_count(raw, "expected", where, MAX_RANK + 1, lo=1),
        steps=_count(raw, "steps", where, 100_000, lo=2),
        share=share,
        ranks=ranks,
        loss=_loss(raw.get("loss"), f"{where}.loss"),
    )


@dataclass
class JobGoLive:
    """The coordinator's go-live checks of a job, as every node is told them."""

    time: float  # the coordinator's wall clock when it judged
    age: float  # seconds since, when it answered
    ranks: int  # distinct ranks judged
    nodes: int  # nodes whose figures were judged
    world_size: int
    checks: dict[str, Check] = field(default_factory=dict)

    @property
    def state(self) -> str:
        states = {c.state for c in self.checks.values()}
        return WARNING if WARNING in states else PENDING if PENDING in states else OK

    def to_wire(self) -> dict[str, Any]:
        return {
            "time": self.time, "age_seconds": round(self.age, 3), "ranks": self.ranks, "nodes": self.nodes,
            "world_size": self.world_size, "checks": {name: c.as_dict() for name, c in self.checks.items()},
        }  # fmt: skip


def parse_answer(raw: Any, where: str = "golive") -> JobGoLive | None:
    """The coordinator's `golive` in its answer (absent: None); ProtocolError names the first bad
    field. Checks this node does not know are left out (a newer coordinator's)."""
    if raw is None:
        return None
    if type(raw) is not dict:
        raise ProtocolError(f"{where}: expected an object or null")
    checks_raw = raw.get("checks")
    if type(checks_raw) is not dict or len(checks_raw) > MAX_CHECKS:
        raise ProtocolError(f"{where}.checks: expected an object of at most {MAX_CHECKS} checks")
    checks: dict[str, Check] = {}
    for name, c in checks_raw.items():
        here = f"{where}.checks.{str(name)[:32]}"
        if type(c) is not dict:
            raise ProtocolError(f"{here}: expected an object")
        state, text = c.get("state"), c.get("text")
        if state not in STATES:
            raise ProtocolError(f"{here}.state: expected one of {', '.join(STATES)}")
        if type(text) is not str or len(text) > MAX_CHECK_TEXT or CONTROL_RE.search(text):
            raise ProtocolError(f"{here}.text: expected at most {MAX_CHECK_TEXT} printable characters")
        if name in CHECKS:
            checks[name] = Check(state, text)
    return JobGoLive(
        time=_num(raw, "time", where, MAX_TIME) or 0.0,
        age=_num(raw, "age_seconds", where, MAX_TIME) or 0.0,
        ranks=_count(raw, "ranks", where, MAX_RANK + 1, default=0),
        nodes=_count(raw, "nodes", where, 1 << 20, default=0),
        world_size=_count(raw, "world_size", where, MAX_RANK + 1, default=0),
        checks=checks,
    )


# ---------------------------------------------------------------- the reporting side


class Sent:
    """What the coordinator last took of a job's figures: a report carries them when they changed
    since, or every REFRESH_SECONDS."""

    def __init__(self) -> None:
        self._taken: dict[str, Any] | None = None
        self._at = -1e18

    def due(self, figures: JobFigures | None, now: float) -> JobFigures | None:
        if figures is None:
            return None
        return None if figures.to_wire() == self._taken and now - self._at < REFRESH_SECONDS else figures

    def taken(self, figures: JobFigures | None, now: float) -> None:
        if figures is not None:
            self._taken, self._at = figures.to_wire(), now


# ---------------------------------------------------------------- the coordinator's side


@dataclass
class _Node:
    figures: JobFigures | None
    world: int  # the job's world size as its report said (or the coordinator's)
    at: float  # monotonic: its latest report


class JobChecks:
    """One job's figures from every node and the latest judgement. Bounded by the coordinator's
    own bounds on a job's nodes and ranks; ranks at or above the world size are left out."""

    def __init__(self) -> None:
        self.nodes: dict[str, _Node] = {}
        self.fresh = False
        self.judged_at = -1e18  # monotonic
        self.judged: JobGoLive | None = None

    def take(self, node: str, figures: JobFigures | None, world: int, now: float) -> None:
        """Every report of `node` (figures None: unchanged since it last sent them)."""
        known = self.nodes.get(node)
        if known is None:
            self.nodes[node] = _Node(figures, world, now)
            self.fresh = figures is not None
            return
        known.at, known.world = now, world
        if figures is not None:
            known.figures, self.fresh = figures, True

    def forget_node(self, node: str) -> None:
        if self.nodes.pop(node, None) is not None:
            self.fresh = True

    def answer(self, now: float, wall: float, lost_after: float) -> JobGoLive | None:
        """The job's checks as every node is told them (None: no node sent figures yet), judged
        again when new figures came (at most every JUDGE_EVERY_SECONDS) or REJUDGE_SECONDS passed."""
        since = now - self.judged_at
        if (self.fresh and since >= JUDGE_EVERY_SECONDS) or since >= REJUDGE_SECONDS:
            live = {n: v for n, v in self.nodes.items() if v.figures is not None and now - v.at <= lost_after}
            self.judged = judge(live, wall) if live else None
            self.fresh, self.judged_at = False, now
        if self.judged is None:
            return None
        j = self.judged
        return JobGoLive(j.time, max(0.0, wall - j.time), j.ranks, j.nodes, j.world_size, j.checks)


def judge(nodes: Mapping[str, _Node], wall: float) -> JobGoLive:
    """The job's checks over every node's latest figures (a rank named by two nodes: the newest)."""
    world = max(n.world for n in nodes.values())
    by_rank: dict[int, tuple[str, RankFigures]] = {}
    for name, n in sorted(nodes.items(), key=lambda item: item[1].at):
        assert n.figures is not None
        for f in n.figures.ranks:
            if f.rank < world:
                by_rank[f.rank] = (name, f)
    where = {rank: name for rank, (name, _) in by_rank.items()}
    figures = {rank: f for rank, (_, f) in by_rank.items()}
    home = nodes.get(where.get(0, ""))  # rank 0's node: its settings and its loss
    ref = (home or next(iter(nodes.values()))).figures
    assert ref is not None
    joined = ranks_joined(nodes, figures, world)
    first = first_batch(figures, where, world)
    waiting = Check(PENDING, "waiting for every rank's first step")
    checks = {
        "ranks_joined": joined,
        "first_batch": first,
        "gpu_memory": gpu_memory(figures, where, ref.share) if first.state == OK else waiting,
        "throughput": throughput(figures, where, ref.share) if first.state == OK else waiting,
        "loss": (
            local.loss_check(home.figures.loss if home and home.figures else None, ref.steps) if home is not None
            else Check(PENDING, "the node of rank 0 has not reported yet")
        ),
    }  # fmt: skip
    for c in checks.values():
        c.text = c.text if len(c.text) <= MAX_CHECK_TEXT else c.text[: MAX_CHECK_TEXT - 3] + "..."
    return JobGoLive(wall, 0.0, len(figures), len(nodes), world, checks)


def _named(ranks: list[int], where: Mapping[int, str]) -> str:
    shown = ", ".join(f"{r} on {where[r]}" for r in sorted(ranks)[:NAMED])
    return shown + (f" and {len(ranks) - NAMED} more" if len(ranks) > NAMED else "")


def ranks_joined(nodes: Mapping[str, _Node], figures: Mapping[int, RankFigures], world: int) -> Check:
    have = len(figures)
    text = f"{have} of {world} ranks reported by {len(nodes)} node{'s' if len(nodes) != 1 else ''}"
    if have >= world:
        return Check(OK, text)
    missing = [r for r in range(world) if r not in figures][: 2 * NAMED + 1]
    short = [
        f"{name} has {len(n.figures.ranks)} of its {n.figures.expected} local ranks"
        for name, n in sorted(nodes.items())
        if n.figures is not None and len(n.figures.ranks) < n.figures.expected
    ]
    extra = "; ".join(short[:3]) + (f" and {len(short) - 3} more nodes" if len(short) > 3 else "")
    return Check(PENDING, f"{text}; missing rank {local.ranks_text(missing)}" + (f"; {extra}" if extra else ""))


def first_batch(figures: Mapping[int, RankFigures], where: Mapping[int, str], world: int) -> Check:
    waiting = [r for r, f in figures.items() if not f.stepped]
    if waiting:
        return Check(PENDING, f"rank {_named(waiting, where)} not past its first batch yet")
    if len(figures) < world:
        return Check(PENDING, f"{world - len(figures)} of {world} ranks not reported yet")
    return Check(OK, f"every rank of the job finished its first step ({world} ranks)")


def gpu_memory(figures: Mapping[int, RankFigures], where: Mapping[int, str], share: float) -> Check:
    memory = {r: float(f.memory) for r, f in figures.items() if f.memory is not None}
    if not memory:
        return Check(UNAVAILABLE, "no node reports per-rank GPU memory (no NVML process list)")
    missing = [r for r in figures if r not in memory]
    if missing:
        return Check(PENDING, f"GPU memory of rank {_named(missing, where)} not seen yet")
    return local.balance({k: v / GIB for k, v in memory.items()}, share, "GiB", lambda v: f"{v:.1f}", where)


def throughput(figures: Mapping[int, RankFigures], where: Mapping[int, str], share: float) -> Check:
    for key, unit in (("tokens_per_second", "tokens/s"), ("samples_per_second", "samples/s")):
        rates = {r: getattr(f, key) for r, f in figures.items()}
        if all(v is not None for v in rates.values()):
            return local.balance(rates, share, unit, lambda v: f"{v:.4g}", where)
    short = [r for r, f in figures.items() if f.step_seconds is None]
    if short:
        return Check(PENDING, f"rank {_named(short, where)} has fewer than {MIN_STEP_TIMES} step times yet")
    times = {r: float(f.step_seconds or 0.0) for r, f in figures.items()}
    return local.balance(times, share, "s per step", lambda v: f"{v:.3g}", where)


# ---------------------------------------------------------------- what /v1/status shows


def shown(jobs: Mapping[str, dict], judged: Callable[[str], tuple[JobGoLive, float] | None] | None,
          coordinator: Callable[[str], tuple[str, str] | None] | None) -> dict[str, dict]:  # fmt: skip
    """Per local job, the go-live checks over the whole job when its coordinator's judgement is fresh
    (`judged_by: coordinator`), else this node's over its own ranks (`judged_by: node`)."""
    out: dict[str, dict] = {}
    for job_id, job in jobs.items():
        got = judged(job_id) if judged is not None else None
        where = coordinator(job_id) if coordinator is not None else None
        if got is None or not got[0].checks:
            out[job_id] = {**job, "judged_by": "node"}
            continue
        answer, age = got
        out[job_id] = {
            **job, "state": answer.state, "judged_by": "coordinator", "judged_on": where[0] if where else None,
            "age_seconds": round(age, 3), "ranks_judged": answer.ranks, "nodes_judged": answer.nodes,
            "world_size": answer.world_size, "checks": {name: c.as_dict() for name, c in answer.checks.items()},
            "node_checks": job.get("checks", {}),
        }  # fmt: skip
    return out


def age_now(answer: JobGoLive, received: float, clock: Callable[[], float] = time.monotonic) -> float:
    """How old the coordinator's judgement is now: its age when answered plus the time since."""
    return answer.age + max(0.0, clock() - received)
