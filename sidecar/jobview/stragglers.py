"""Stragglers across nodes: lateness per rank judged by the job's coordinator over the whole job.

On one node, sidecar/ranks/lateness.py compares its own ranks' entry times (one clock). A job's
straggler is usually alone on its node, so the job view carries the entry times to the job's
coordinator, which judges every rank of the job with the same rule (`lateness.judge`) and answers
every node with the job's stragglers and that node's ranks' lateness.

On the wire (both optional: a peer that predates them neither sends nor reads them; absent = none):

- a report's `lateness`: per local rank, per process group, the newest REPORT_RECENT entry times
  (`[[seq, unix seconds], ...]`, ascending), sent only when a rank's newest sequence moved since the
  coordinator last took them (the hooks read their entries once per 10 s slot: about one report in
  two carries them). `[[12345,1764870000.1234],...]`: about 24 bytes per entry, ~420 bytes per group
  and rank (measured in tests/jobview/test_stragglers.py);
- the answer's `lateness`: when the coordinator judged, the job's stragglers (at most
  MAX_STRAGGLERS: rank, node, lateness, group, the group's interval and threshold), this node's
  ranks' lateness and this node's clock offset estimate. Its size does not grow with the job.

Clocks. Entry times are each node's wall clock. The coordinator corrects each node's times by an
offset estimate (`ClockOffset`). Each report gives one sample: its `time` minus the coordinator's
wall clock when it took it. With `d` the report's one-way delay (send to take, including any wait in
a busy event loop), a sample is offset - d, d >= 0: never above the true offset. The estimate is the
greatest sample over the node's last OFFSET_REPORTS reports, the least-delayed report's: below the
true offset by that report's one-way delay (LAN: well under a millisecond; the coordinator's own
node: 0), however late the others came. So a rank's lateness judged across nodes is off by at most
the larger of the two nodes' least one-way delays, far below the 20 ms floor; one report held up
on a loaded node moves nothing. How far, the coordinator knows: each report carries its node's round
trip of the report before (`rtt`, measured from the moment it stamped `time` to the answer), a bound
on that report's delay, so the true offset lies in [sample, sample + rtt]; the estimate's error bound
is the least such upper end minus the estimate (`JobLateness.clock_offset_error`, shown in status as
`clock_offset_error_seconds`). A node's clock that steps forward is followed at its next report
(a greater sample); one that steps or slews back shows as STEP_REPORTS reports in a row all below
the estimate by more than STEP_SECONDS (the lateness floor), and the window starts again from them
(a busy coordinator that delays as many reports so much does the same: the estimate is then off by
their least delay until the next quick report, never more).

What a peer can do with it (docs/security.md): a node holding the job's key can make its own ranks
look late or early, and so name one of its own ranks, or hide it, as the job's straggler; nothing is
ever killed or signalled for lateness, and every field is bounded and validated like the rest of a
report (ProtocolError naming the field).
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.ranks import lateness
from sidecar.ranks.collectives import Collectives, parse_recent
from sidecar.ranks.model import Rank
from sidecar.ranks.protocol import CONTROL_RE, ProtocolError
from trainer_hooks.wire import COLLECTIVES_MAX_GROUP_RANKS, MAX_RANK, MAX_TIME

log = logging.getLogger(__name__)

REPORT_RECENT = 16  # entry times per rank and group a report carries (the hooks send 32)
REPORT_GROUPS = 4  # groups per rank a report carries (data x tensor x pipeline parallel: 3)
KEPT = lateness.WINDOW  # entry times the coordinator keeps per rank and group (what it judges over)
MAX_STRAGGLERS = 8  # named in an answer, however many ranks are late
MAX_ANSWER_RANKS = 4096  # a node's ranks' lateness in an answer
OFFSET_REPORTS = 64  # reports a node's clock offset is the greatest sample over (~5 minutes at 5 s)
STEP_REPORTS = 3  # ... in a row, all below the estimate by more than STEP_SECONDS: the clock stepped back
STEP_SECONDS = 0.02  # the lateness floor: a clock stepped or slewed back by more is followed
JUDGE_EVERY_SECONDS = 1.0  # a job's lateness is judged at most this often (when new entries came)
JUDGE_SHARE = 20  # ... and no sooner than this many times what its last judgement took
STALE_SECONDS = 60.0  # a rank whose entries have not moved this long is left out (it left, or its node did)
ROUND = 4  # decimals of an entry time on the wire (0.1 ms)

GroupKey = lateness.GroupKey


@dataclass
class RankEntries:
    """One rank's entry times as a report carries them: group -> ((seq, unix seconds), ...)."""

    rank: int
    groups: dict[GroupKey, tuple[tuple[int, float], ...]]

    def to_wire(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "groups": [
                {"pg": pg, "ranks": list(members) if members is not None else None,
                 "recent": [[s, round(t, ROUND)] for s, t in recent]}
                for (pg, members), recent in self.groups.items()
            ],
        }  # fmt: skip

    @property
    def signature(self) -> tuple:
        """What says the entries moved: each group's newest sequence."""
        return tuple(sorted((key[0], recent[-1][0]) for key, recent in self.groups.items() if recent))


def entries_of(rank: int, record: Collectives | None) -> RankEntries | None:
    """A rank's newest REPORT_RECENT entry times per group, from its latest record (None: none)."""
    if record is None:
        return None
    with_times = [g for g in record.groups if g.recent][:REPORT_GROUPS]
    groups = {(g.pg, g.ranks): tuple(g.recent[-REPORT_RECENT:]) for g in with_times}
    return RankEntries(rank, groups) if groups else None


@dataclass
class Straggler:
    rank: int
    node: str
    seconds: float  # its lateness (the least of its groups')
    pg: str  # the group it is latest in
    interval: float | None  # that group's median seconds between collectives
    threshold: float  # that group's threshold

    def to_wire(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "node": self.node, "seconds": round(self.seconds, 6), "pg": self.pg,
            "interval": None if self.interval is None else round(self.interval, 6),
            "threshold": round(self.threshold, 6),
        }  # fmt: skip


@dataclass
class JobLateness:
    """The coordinator's judgement of a job's lateness, as one node is told it."""

    time: float  # the coordinator's wall clock when it judged
    stragglers: list[Straggler] = field(default_factory=list)
    ranks: dict[int, float] = field(default_factory=dict)  # the asking node's ranks -> lateness
    clock_offset: float | None = None  # the asking node's clock offset estimate (its clock - the coordinator's)
    judged_ranks: int = 0  # ranks of the job judged
    clock_offset_error: float | None = None  # how far below the true offset the estimate may be (None: unknown)

    def to_wire(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "stragglers": [s.to_wire() for s in self.stragglers],
            "ranks": [[r, round(s, 6)] for r, s in sorted(self.ranks.items())],
            "clock_offset": None if self.clock_offset is None else round(self.clock_offset, 6),
            "judged_ranks": self.judged_ranks,
            **({} if self.clock_offset_error is None else {"clock_offset_error": round(self.clock_offset_error, 6)}),
        }


# ---------------------------------------------------------------- parsing (a peer's input)


def _number(value: Any, where: str, lo: float, hi: float, what: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value < hi:
        raise ProtocolError(f"{where}: expected {what}")
    return float(value)


def _array(value: Any, where: str, limit: int) -> list:
    if value is None:
        return []
    if type(value) is not list:
        raise ProtocolError(f"{where}: expected an array")
    if len(value) > limit:
        raise ProtocolError(f"{where}: at most {limit} entries, got {len(value)}", code="too_large", status=413)
    return value


def _rank(value: Any, where: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_RANK:
        raise ProtocolError(f"{where}: expected a global rank in [0, {MAX_RANK}]")
    return value


def _pg(value: Any, where: str) -> str:
    if type(value) is not str or not 0 < len(value) <= 64 or CONTROL_RE.search(value):
        raise ProtocolError(f"{where}: expected 1 to 64 printable characters")
    return value


def _recent(raw: Any, where: str) -> tuple[tuple[int, float], ...]:
    return parse_recent(_array(raw, where, REPORT_RECENT), where)


def parse_entries(raw: Any, max_ranks: int, where: str = "lateness") -> list[RankEntries]:
    """A report's `lateness` (absent: none); ProtocolError names the first bad field."""
    out: list[RankEntries] = []
    seen: set[int] = set()
    for i, obj in enumerate(_array(raw, where, max_ranks)):
        here = f"{where}[{i}]"
        if type(obj) is not dict:
            raise ProtocolError(f"{here}: expected an object")
        rank = _rank(obj.get("rank"), f"{here}.rank")
        if rank in seen:
            raise ProtocolError(f"{here}.rank: rank {rank} is named twice")
        seen.add(rank)
        groups: dict[GroupKey, tuple[tuple[int, float], ...]] = {}
        for j, g in enumerate(_array(obj.get("groups"), f"{here}.groups", REPORT_GROUPS)):
            gw = f"{here}.groups[{j}]"
            if type(g) is not dict:
                raise ProtocolError(f"{gw}: expected an object")
            pg = _pg(g.get("pg"), f"{gw}.pg")
            members = g.get("ranks")
            if members is not None:
                members = tuple(
                    _rank(m, f"{gw}.ranks[{k}]")
                    for k, m in enumerate(_array(members, f"{gw}.ranks", COLLECTIVES_MAX_GROUP_RANKS))
                )
            key = (pg, members)
            if key in groups:
                raise ProtocolError(f"{gw}.pg: group {pg!r} is named twice")
            groups[key] = _recent(g.get("recent"), f"{gw}.recent")
        out.append(RankEntries(rank, groups))
    return out


def parse_answer(raw: Any, where: str = "lateness") -> JobLateness | None:
    """The coordinator's `lateness` in its answer to a report (absent: None); ProtocolError names
    the first bad field."""
    if raw is None:
        return None
    if type(raw) is not dict:
        raise ProtocolError(f"{where}: expected an object or null")
    stragglers = []
    for i, s in enumerate(_array(raw.get("stragglers"), f"{where}.stragglers", MAX_STRAGGLERS)):
        here = f"{where}.stragglers[{i}]"
        if type(s) is not dict:
            raise ProtocolError(f"{here}: expected an object")
        node = s.get("node")
        if type(node) is not str or not 0 < len(node) <= 253 or CONTROL_RE.search(node):
            raise ProtocolError(f"{here}.node: expected a node name")
        interval = s.get("interval")
        stragglers.append(
            Straggler(
                rank=_rank(s.get("rank"), f"{here}.rank"),
                node=node,
                seconds=_number(s.get("seconds"), f"{here}.seconds", 0, MAX_TIME, "seconds >= 0"),
                pg=_pg(s.get("pg"), f"{here}.pg"),
                interval=None if interval is None else _number(interval, f"{here}.interval", 0, MAX_TIME, "seconds"),
                threshold=_number(s.get("threshold"), f"{here}.threshold", 0, MAX_TIME, "seconds >= 0"),
            )
        )
    ranks: dict[int, float] = {}
    for i, item in enumerate(_array(raw.get("ranks"), f"{where}.ranks", MAX_ANSWER_RANKS)):
        if type(item) is not list or len(item) != 2:
            raise ProtocolError(f"{where}.ranks[{i}]: expected [rank, seconds]")
        ranks[_rank(item[0], f"{where}.ranks[{i}]")] = _number(
            item[1], f"{where}.ranks[{i}]", 0, MAX_TIME, "seconds >= 0"
        )
    offset, error = raw.get("clock_offset"), raw.get("clock_offset_error")
    judged = raw.get("judged_ranks", 0)
    if type(judged) is not int or not 0 <= judged <= MAX_RANK + 1:
        raise ProtocolError(f"{where}.judged_ranks: expected a count of ranks")
    return JobLateness(
        time=_number(raw.get("time"), f"{where}.time", 0, MAX_TIME, "Unix seconds"),
        stragglers=stragglers,
        ranks=ranks,
        clock_offset=None if offset is None else _number(offset, f"{where}.clock_offset", -MAX_TIME, MAX_TIME, "s"),
        judged_ranks=judged,
        clock_offset_error=None if error is None else _number(error, f"{where}.clock_offset_error", 0, MAX_TIME, "s"),
    )


# ---------------------------------------------------------------- the reporting side


class Sent:
    """What a coordinator last took of each rank's entries: a report carries a rank's entries only
    when its newest sequence moved since (or the coordinator changed)."""

    def __init__(self) -> None:
        self._taken: dict[int, tuple] = {}

    def due(self, entries: Iterable[RankEntries]) -> list[RankEntries]:
        return [e for e in entries if self._taken.get(e.rank) != e.signature]

    def taken(self, entries: Iterable[RankEntries]) -> None:
        for e in entries:
            self._taken[e.rank] = e.signature


# ---------------------------------------------------------------- the coordinator's side


@dataclass
class _Rank:
    node: str
    groups: dict[GroupKey, dict[int, float]]
    moved: float  # monotonic: its entries last moved


class ClockOffset:
    """One node's clock offset estimate (its clock - the coordinator's), from its reports' samples
    (the report's `time` - the coordinator's wall clock when it took it): the module's "Clocks"."""

    def __init__(self) -> None:
        # [sample, its report's round trip or None]: the round trip comes with the node's next report
        self.samples: collections.deque[tuple[float, float | None]] = collections.deque(maxlen=OFFSET_REPORTS)
        self.estimate: float | None = None
        self.error: float | None = None  # the bound on how far below the true offset it is (None: unknown)
        self.below = 0  # the newest samples in a row below the estimate by more than STEP_SECONDS
        self.steps = 0  # times the window started again (the clock stepped back)

    def add(self, sample: float, previous_rtt: float | None = None) -> None:
        """A report's sample; `previous_rtt`: the round trip of the node's report before it (the
        bound on that report's one-way delay), as this one carries it."""
        if previous_rtt is not None and self.samples and self.samples[-1][1] is None:
            self.samples[-1] = (self.samples[-1][0], previous_rtt)
        below = self.estimate is not None and self.estimate - sample > STEP_SECONDS
        self.below = self.below + 1 if below else 0
        self.samples.append((sample, None))
        if self.below >= STEP_REPORTS:  # stepped back: what came before no longer holds
            recent = list(self.samples)[-STEP_REPORTS:]
            self.samples.clear()
            self.samples.extend(recent)
            self.below, self.steps = 0, self.steps + 1
        # each sample is offset - d with 0 <= d <= its round trip: the offset lies in [sample, sample + rtt]
        self.estimate = max(s for s, _ in self.samples)  # OFFSET_REPORTS pairs at most
        above = min((s + r for s, r in self.samples if r is not None), default=None)
        self.error = None if above is None else max(0.0, above - self.estimate)


class JobJudge:
    """One job's entry times from every node (each node's own clock), each node's clock offset
    estimate, and the latest judgement. Bounded: KEPT entries per rank and group, REPORT_GROUPS
    groups per rank (a report's), ranks numbered below the job's world size."""

    def __init__(self) -> None:
        self.ranks: dict[int, _Rank] = {}
        self.offsets: dict[str, ClockOffset] = {}
        self.fresh = False  # entries came since the last judgement
        self.judged_at = -1e9  # monotonic
        self.cost = 0.0
        self.verdict: lateness.Verdict | None = None
        self.since: dict[int, tuple[float, float]] = {}  # lateness.confirm's, per late rank
        self.wall: float = 0.0  # when it judged (the coordinator's wall clock)

    def take(
        self, node: str, sent_at: float, received_wall: float, entries: list[RankEntries], now: float, size: int,
        previous_rtt: float | None = None,
    ) -> None:  # fmt: skip
        """A report of `node` sent at its wall clock `sent_at`, taken at `received_wall` (`previous_rtt`:
        the round trip of the node's report before it); ranks of the job numbered below `size` (its
        world size, or the coordinator's bound) only."""
        self.offsets.setdefault(node, ClockOffset()).add(sent_at - received_wall, previous_rtt)
        for e in entries:
            if e.rank >= size:
                continue
            known = self.ranks.get(e.rank)
            if known is None or known.node != node:  # a rank that moved node (a restart) starts anew
                known = self.ranks[e.rank] = _Rank(node, {}, now)
            before = {k: max(v) for k, v in known.groups.items() if v}
            known.groups = lateness.merge(known.groups, {k: dict(v) for k, v in e.groups.items()}, KEPT)
            if {k: max(v) for k, v in known.groups.items() if v} != before:
                known.moved, self.fresh = now, True

    def offset(self, node: str) -> float | None:
        seen = self.offsets.get(node)
        return None if seen is None else seen.estimate

    def offset_error(self, node: str) -> float | None:
        seen = self.offsets.get(node)
        return None if seen is None else seen.error

    def forget_node(self, node: str) -> None:
        self.offsets.pop(node, None)
        for rank in [r for r, v in self.ranks.items() if v.node == node]:
            del self.ranks[rank]

    def judge(self, now: float, wall: float, own_node: str = "") -> bool:
        """Judge again when new entries came and enough time passed; True when it did."""
        if not self.fresh or now - self.judged_at < max(JUDGE_EVERY_SECONDS, JUDGE_SHARE * self.cost):
            return False
        started = time.perf_counter()
        for rank in [r for r, v in self.ranks.items() if now - v.moved > STALE_SECONDS]:
            del self.ranks[rank]
        entries: dict[int, Mapping[GroupKey, Mapping[int, float]]] = {}
        for rank, v in self.ranks.items():
            shift = 0.0 if v.node == own_node else (self.offset(v.node) or 0.0)
            entries[rank] = {k: {s: t - shift for s, t in times.items()} for k, times in v.groups.items()}
        self.verdict = lateness.confirm(lateness.judge(entries), self.since)
        self.fresh, self.judged_at, self.wall = False, now, wall
        self.cost = time.perf_counter() - started
        return True

    def log_changes(self, job_id: str, node: str, logged: set[int]) -> set[int]:
        """Log the job's stragglers when they changed from `logged`; returns the ones named now."""
        named = set(self.verdict.stragglers) if self.verdict is not None else set()
        if named != logged:
            answer = self.answer(node)
            said = ", ".join(
                f"rank {s.rank} on {s.node} {s.seconds * 1000:.1f} ms late (pg {s.pg})"
                for s in (answer.stragglers if answer is not None else [])
            )
            log.warning("job %s: straggler(s): %s", job_id, said or "none any more")
        return named

    def answer(self, node: str) -> JobLateness | None:
        """What `node` is told: the job's stragglers, its own ranks' lateness and its clock offset."""
        v = self.verdict
        if v is None:
            return None
        named = [_named(v, rank, self.ranks[rank].node if rank in self.ranks else "") for rank in v.stragglers]
        named.sort(key=lambda s: -s.seconds)
        mine = {rank: r.seconds for rank, r in v.ranks.items() if rank in self.ranks and self.ranks[rank].node == node}
        return JobLateness(
            self.wall, named[:MAX_STRAGGLERS], mine, self.offset(node), len(v.ranks), self.offset_error(node)
        )


def _named(v: lateness.Verdict, rank: int, node: str) -> Straggler:
    """A straggler of a judgement, with the group it is latest in."""
    r = v.ranks[rank]
    pg = max(r.groups, key=lambda name: r.groups[name])
    group = next(g for g in v.groups if g.pg == pg and rank in g.lateness)
    return Straggler(rank, node, r.seconds, pg, group.interval, group.threshold)


# ---------------------------------------------------------------- what /v1/status shows


def status(
    node: str,
    ranks: Iterable[Rank],
    judged: Callable[[str], tuple[JobLateness, float] | None],
    coordinator: Callable[[str], tuple[str, str] | None],
    tracker: lateness.Tracker,
) -> list[dict[str, Any]]:
    """Per local job, each judgement of its lateness: by the job's coordinator over the whole job
    (`judged`: the reporter's, fresh only) and by this node over its own ranks (`tracker`: the
    daemon's one judgement of them, which /metrics shows too; at least two ranks), each with the
    stragglers it names (an empty list: none)."""
    ranks = list(ranks)
    jobs = sorted(
        {r.job_id for r in ranks if not r.gone and r.collectives is not None and lateness.entries_of(r.collectives)}
    )
    mine = tracker.judged(ranks)
    out: list[dict[str, Any]] = []
    for job_id in jobs:
        got = judged(job_id)
        where = coordinator(job_id)
        if got is not None and where is not None:
            answer, age = got
            out.append({
                "job_id": job_id, "judged_by": "coordinator", "judged_on": where[0],
                "ranks_judged": answer.judged_ranks, "age_seconds": round(age, 3),
                "clock_offset_seconds": None if answer.clock_offset is None else round(answer.clock_offset, 6),
                "clock_offset_error_seconds": (
                    None if answer.clock_offset_error is None else round(answer.clock_offset_error, 6)
                ),
                "stragglers": [_shown(s) for s in answer.stragglers],
            })  # fmt: skip
        v = mine.get(job_id)
        if v is not None:
            named = [_shown(_named(v, rank, node)) for rank in v.stragglers]
            out.append({"job_id": job_id, "judged_by": "node", "judged_on": node, "ranks_judged": len(v.ranks),
                        "stragglers": sorted(named, key=lambda s: -s["lateness_seconds"])})  # fmt: skip
    return out


def _shown(s: Straggler) -> dict[str, Any]:
    return {
        "rank": s.rank, "node": s.node, "lateness_seconds": round(s.seconds, 4), "pg": s.pg,
        "interval_seconds": None if s.interval is None else round(s.interval, 4),
        "threshold_seconds": round(s.threshold, 4),
    }  # fmt: skip
