"""Lateness: how long after its peers (the other members of its process group) each rank enters the
same collective, from the entry times its collective record carries (`recent`, trainer_hooks/collectives.py).

In a data-parallel job every rank's step time is the same: each waits for the slowest at every
all-reduce, so step times cannot name a straggler. The Flight Recorder can: the straggler is the
rank that enters each collective last. For each process group and each sequence number at least
two members entered, a member's lateness is its entry time minus the median of its peers' entry
times (for two members: its peer's); a rank's lateness in a group is the median over the group's last
WINDOW such sequences, and never below 0 (a rank that comes early is not late). Not the earliest
member's: the first of N members whose steps vary enters ever earlier as N grows (the least of N
draws), so measured against it every rank of a large noisy group is late: with 50 ms of step noise,
64 healthy ranks were each ~25 ms late and all named, against their peers' median at most 5 ms
(tests/ranks/test_lateness.py). The straggler is a minority of its group: in a group where more than
half the members are equally slow, the slow ones are its pace, and none is named. Only sequences
every member whose record still comes has reported are judged (the records come a few at a time:
judged on the first alone, a rank was compared with part of its group for a moment). A rank is a
straggler when that median exceeds max(FLOOR_SECONDS, INTERVAL_RATIO x the group's median
interval between consecutive collectives), and it holds the group up (in at least HOLDING_SHARE of
its collectives it entered within that threshold of the last member: a rank released late while
its peers wait for the straggler enters late, but before it), in every group it has data in: with data x tensor
parallel groups, a rank that waited for the straggler in one group enters its other groups late
too, but is on time in the group it waited in; the straggler is late in all of them. The
lateness a rank is shown with is the least of its groups' for the same reason. A moment's lateness is
not a straggler: a rank is named only once the collectives it has been found late in, judgement after
judgement, span CONFIRM_SECONDS (`confirm`): a window of 32 collectives of 50 ms steps spans 1.6 s,
and a healthy rank slowed for a second on a loaded machine was named from one such window.

`judge` is pure (per rank, per group, sequence -> entry time). `Tracker` keeps each local rank's
entry times across its records (the hooks read their entries once in a wall-clock slot, at about
the same moment on every rank of a node, so that their windows overlap) and judges each job's ranks
on this node, again only when a record changed. The daemon has one Tracker, which `/metrics`
(`families`), `/v1/status` `stragglers` and the straggler incidents all read
(sidecar/jobview/stragglers.py `status`), so they never judge a node's ranks two ways. Entry times
are each rank's wall clock: on one node, one clock. Across nodes the job view's coordinator judges
the whole job with the same `judge`, each node's times corrected by its clock offset estimate
(sidecar/jobview/stragglers.py); `families` shows that judgement for this node's ranks when it is
fresh.

Everything here is read from records the ranks sent (validated by collectives.py, bounded by the
wire's limits): no rank can make it cost more than its own bounded record.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from statistics import median

from prometheus_client.core import Metric

from sidecar.metric import spec
from sidecar.ranks.collectives import Collectives
from sidecar.ranks.model import Rank, RankKey
from trainer_hooks.wire import COLLECTIVES_MAX_RECENT

WINDOW = COLLECTIVES_MAX_RECENT  # common sequences of a group a rank's median is taken over
FLOOR_SECONDS = 0.020  # a lateness below this is clocks and scheduling, never a straggler
INTERVAL_RATIO = 0.1  # ... nor below this share of its group's median interval between collectives
# (a rank slowed by r x the step is late r/(1+r) of the interval: named from r = 11%; 0.25 named only from 33%)
MIN_SEQUENCES = 8  # common sequences a group needs before it names a straggler
# ... and a straggler holds its group up: in at least this share of its collectives it entered within the
# threshold of the last member (of the 90th percentile's in groups of 10 and more: one rank of a thousand
# hiccups in most collectives). A rank released late from the previous collective while its peers wait for
# a straggler (a ring's completion reaching it later on a busy machine) enters late too, before the
# straggler: it delays no one (issue 48: named beside a rank under a CPU quota, 34 ms late to its 97 ms).
HOLDING_SHARE = 0.5
# ... and the collectives a rank was found late in, judgement after judgement, must span this long: a
# moment's delay is not a straggler. A window of 32 collectives of 300 ms steps spans 9.6 s (named at the
# first judgement, as before); of 50 ms steps, 1.6 s: a rank of a healthy job slowed for a second or two
# (a loaded machine) was named; now it must still be late at a later judgement (the hooks' next read).
CONFIRM_SECONDS = 5.0
GAP_SECONDS = 15.0  # ... late again after this long without: anew (the hooks read their entries every 10 s)
HISTORY = 2 * COLLECTIVES_MAX_RECENT  # entry times kept per rank and group, newest

# listed in training_metrics.METRICS, whose collector exports it (one module lists a family)
LATENESS = spec(
    "training",
    "rank_lateness_seconds",
    "gauge",
    "How long after its peers (the median of the other members of its process group) the rank enters the group's "
    "collectives: per group, the median over the last common collectives (each rank's Flight Recorder entry times; 0 "
    "when it comes early), and the least of its groups'. A straggler enters every collective late, while its step time"
    " equals its peers' (each waits for it). Judged over the whole job by its coordinator (the job view) while it has "
    "a fresh judgement, else among the job's ranks on this node; each node shows only its own ranks. Absent until "
    "judged.",
    ["job_id", "rank"],
)

GroupKey = tuple[str, tuple[int, ...] | None]  # the group's name and its members when sent
Entries = Mapping[int, Mapping[GroupKey, Mapping[int, float]]]  # rank -> group -> seq -> entry time
# job -> this node's ranks' lateness as the job's coordinator judged it (None: no fresh judgement)
JobLevel = Callable[[str], Mapping[int, float] | None]


@dataclass(frozen=True)
class GroupLateness:
    """One process group's judgement."""

    pg: str
    sequences: int  # common sequences judged (entered by at least two members)
    interval: float | None  # median seconds between its consecutive collectives (first entries)
    threshold: float  # a member's median lateness above this is late
    lateness: dict[int, float]  # rank -> its median lateness in the group
    start: float = 0.0  # the first entry time of the oldest and newest collectives judged
    end: float = 0.0
    # rank -> the share of its collectives it held up: entered within the threshold of the last member
    holding: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RankLateness:
    rank: int
    seconds: float  # the least of its groups' median lateness
    groups: dict[str, float]  # pg -> its median lateness there
    straggler: bool  # late in every group it has data in (and each judged enough sequences)


@dataclass(frozen=True)
class Verdict:
    groups: list[GroupLateness]
    ranks: dict[int, RankLateness]

    @property
    def stragglers(self) -> list[int]:
        return sorted(r for r, v in self.ranks.items() if v.straggler)


def _group(
    pg: str, members: Mapping[int, Mapping[int, float]], window: int, floor: float, ratio: float
) -> GroupLateness | None:
    newest_of = [max(times) for times in members.values() if times]
    if not newest_of:
        return None
    newest = max(newest_of)
    # Only collectives every member whose record still comes has reported: a record read before its
    # peers' (they come a few at a time) would otherwise judge its newest collectives against part
    # of the group, a different part at each record, and name a rank for a moment.
    upto = min(n for n in newest_of if n > newest - HISTORY)
    by_seq: dict[int, dict[int, float]] = {}
    for rank, times in members.items():
        for seq, created in times.items():
            if newest - HISTORY < seq <= upto:  # a member whose record stopped coming: its old entries age out
                by_seq.setdefault(seq, {})[rank] = created
    common = sorted(s for s, ranks in by_seq.items() if len(ranks) >= 2)[-window:]
    if not common:
        return None
    first = {s: min(by_seq[s].values()) for s in common}
    late: dict[int, list[float]] = {}
    for s in common:
        for rank, behind in _behind_peers(by_seq[s]).items():
            late.setdefault(rank, []).append(behind)
    steps = [(first[b] - first[a]) / (b - a) for a, b in zip(common, common[1:], strict=False)]
    interval = median(steps) if steps else None
    threshold = max(floor, ratio * interval) if interval is not None and interval > 0 else floor
    shown = {r: max(0.0, median(v)) for r, v in sorted(late.items())}
    held: dict[int, int] = {}
    for s in common:
        entered_at = sorted(by_seq[s].values(), reverse=True)
        last = entered_at[len(entered_at) // 10]  # the last member's, or in a large group the 90th percentile's
        for rank, entered in by_seq[s].items():
            held[rank] = held.get(rank, 0) + (entered >= last - threshold)
    holding = {r: held.get(r, 0) / len(v) for r, v in late.items()}
    return GroupLateness(pg, len(common), interval, threshold, shown, first[common[0]], first[common[-1]], holding)


def _behind_peers(entered: Mapping[int, float]) -> dict[int, float]:
    """Each member's entry time minus the median of its peers' (the other members that entered the
    same collective): negative when it came early. With the n entry times sorted, the peers' median
    of the member at position i is one of three values, by which side of the middle i is on: one
    sort per collective, O(n log n)."""
    ranks = sorted(entered, key=entered.__getitem__)
    v = [entered[r] for r in ranks]
    n = len(v)
    half = (n - 1) // 2  # the peers' middle position (n - 1 of them)
    if n % 2 == 0:  # an odd number of peers: their middle one
        below, at, above = v[half + 1], v[half + 1], v[half]
    else:  # an even number: the mean of their two middle ones
        below, at, above = (v[half] + v[half + 1]) / 2, (v[half - 1] + v[half + 1]) / 2, (v[half - 1] + v[half]) / 2
    out = dict(zip(ranks[:half], [t - below for t in v[:half]], strict=True))
    out[ranks[half]] = v[half] - at
    out.update(zip(ranks[half + 1 :], [t - above for t in v[half + 1 :]], strict=True))
    return out


def judge(
    entries: Entries,
    window: int = WINDOW,
    floor: float = FLOOR_SECONDS,
    ratio: float = INTERVAL_RATIO,
    min_sequences: int = MIN_SEQUENCES,
) -> Verdict:
    """Each rank's lateness per group and overall, and who is a straggler, from the ranks' entry
    times (rank -> group -> sequence -> Unix seconds)."""
    by_group: dict[GroupKey, dict[int, Mapping[int, float]]] = {}
    for rank, of_rank in entries.items():
        for key, times in of_rank.items():
            by_group.setdefault(key, {})[rank] = times
    judged: list[GroupLateness] = []
    per_rank: dict[int, list[GroupLateness]] = {}
    for key, members in sorted(by_group.items(), key=lambda kv: (kv[0][0], kv[0][1] or ())):
        if len(members) < 2:
            continue
        g = _group(key[0], members, window, floor, ratio)
        if g is None:
            continue
        judged.append(g)
        for rank in g.lateness:
            per_rank.setdefault(rank, []).append(g)
    ranks = {}
    for rank, groups in sorted(per_rank.items()):
        straggler = all(
            g.sequences >= min_sequences
            and g.lateness[rank] > g.threshold
            and g.holding.get(rank, 1.0) >= HOLDING_SHARE  # it held its group up
            for g in groups
        )
        ranks[rank] = RankLateness(
            rank, min(g.lateness[rank] for g in groups), {g.pg: g.lateness[rank] for g in groups}, straggler
        )
    return Verdict(judged, ranks)


def confirm(verdict: Verdict, since: dict[int, tuple[float, float]], span: float = CONFIRM_SECONDS) -> Verdict:
    """`verdict` with a rank a straggler only once the collectives it has been late in, judgement
    after judgement, span `span` seconds. `since`, per rank, kept between judgements: the first entry
    time of the oldest collective of the judgement that first found it late, and the newest one found
    late since. A judgement that finds the rank on time (over MIN_SEQUENCES collectives or more) forgets
    it; one that cannot judge it (too few common collectives: a node's entries not come yet) leaves it
    as it is; lateness found again more than GAP_SECONDS after the last is lateness anew."""
    of_rank: dict[int, list[GroupLateness]] = {}
    for g in verdict.groups:
        for rank in g.lateness:
            of_rank.setdefault(rank, []).append(g)
    ranks = {}
    for rank, r in verdict.ranks.items():
        groups = of_rank.get(rank, [])
        if not r.straggler or not groups:
            if any(g.sequences >= MIN_SEQUENCES and g.lateness[rank] <= g.threshold for g in groups):
                since.pop(rank, None)
            ranks[rank] = r
            continue
        start, end = min(g.start for g in groups), max(g.end for g in groups)
        first, last = since.get(rank, (start, end))
        if start - last > GAP_SECONDS:
            first = start
        since[rank] = (first, max(last, end))
        ranks[rank] = replace(r, straggler=end - first >= span)
    return Verdict(verdict.groups, ranks)


def entries_of(record: Collectives) -> dict[GroupKey, dict[int, float]]:
    """A record's entry times, per group."""
    return {(g.pg, g.ranks): dict(g.recent) for g in record.groups if g.recent}


# ---------------------------------------------------------------- the ranks of this node


@dataclass
class _History:
    rank: Rank  # the registration it belongs to (a restarted rank is a new one: its history starts anew)
    record: Collectives | None = None  # the last record merged
    groups: dict[GroupKey, dict[int, float]] | None = None
    merged: int = 0  # records merged: what a judgement was made of


class Tracker:
    """This node's ranks' entry times, merged from each record as it is seen (HISTORY per group,
    newest), judged per job. Read from the event loop and the /metrics renderer's thread: a lock."""

    def __init__(self) -> None:
        self._seen: dict[RankKey, _History] = {}
        self._lock = threading.Lock()
        self._made_of: tuple | None = None  # what the cached judgement was made of
        self._verdicts: dict[str, Verdict] = {}
        self._since: dict[str, dict[int, tuple[float, float]]] = {}  # per job, `confirm`'s
        self.judgements = 0  # how many times it judged (not how often it was asked)

    def observe(self, ranks: Iterable[Rank]) -> None:
        live = {r.key: r for r in ranks if not r.gone}
        for key in [k for k, h in self._seen.items() if live.get(k) is not h.rank]:
            del self._seen[key]
        for key, rank in live.items():
            record = rank.collectives
            if record is None:
                continue
            h = self._seen.setdefault(key, _History(rank))
            if h.record is record:
                continue
            h.record = record
            h.groups = merge(h.groups or {}, entries_of(record))
            h.merged += 1

    def judged(self, ranks: Iterable[Rank]) -> dict[str, Verdict]:
        """Per job: its ranks on this node (`ranks`' latest records merged in), judged; judged again
        only when a record came or a rank went since the last judgement."""
        with self._lock:
            self.observe(ranks)
            made_of = tuple(sorted((key, id(h.rank), h.merged) for key, h in self._seen.items()))
            if made_of != self._made_of:
                self._made_of, self._verdicts = made_of, self._judge()
                self.judgements += 1
            return self._verdicts

    def _judge(self) -> dict[str, Verdict]:
        jobs: dict[str, dict[int, Mapping[GroupKey, Mapping[int, float]]]] = {}
        for (job_id, rank), h in self._seen.items():
            if h.groups:
                jobs.setdefault(job_id, {})[rank] = h.groups
        self._since = {job_id: since for job_id, since in self._since.items() if job_id in jobs}
        return {
            job_id: confirm(judge(entries), self._since.setdefault(job_id, {}))
            for job_id, entries in sorted(jobs.items())
            if len(entries) >= 2
        }


def merge(
    old: dict[GroupKey, dict[int, float]], new: Mapping[GroupKey, Mapping[int, float]], keep: int = HISTORY
) -> dict[GroupKey, dict[int, float]]:
    """`old` with `new`'s entries, the newest `keep` per group. A group whose newest sequence went
    back (its process group was formed again) starts anew; a group the rank no longer reports is
    dropped."""
    out: dict[GroupKey, dict[int, float]] = {}
    for key, times in new.items():
        kept = old.get(key, {})
        if kept and times and max(times) < max(kept):
            kept = {}
        both = {**kept, **times}
        out[key] = {s: both[s] for s in sorted(both)[-keep:]}
    return out


def series(r: Rank) -> int:
    """Series `families` may give one rank (for /metrics' budget): at most one."""
    return int(not r.gone and r.collectives is not None and any(g.recent for g in r.collectives.groups))


def families(
    tracker: Tracker,
    ranks: Iterable[Rank],
    only: Collection[RankKey] | None = None,
    job_level: JobLevel | None = None,
) -> list[Metric]:
    """`sidecar_rank_lateness_seconds` of the ranks in `only` (None: all), after merging `ranks`'
    latest records into `tracker`. A job whose coordinator judged it over the whole job
    (`job_level(job_id)`: this node's ranks -> lateness, None when it has no fresh judgement) shows
    that judgement for every rank of the job it names, this node's own for the rest: a node shows
    only its own ranks, so no two nodes export one rank, and one node never mixes the two for a job.
    """
    ranks = list(ranks)
    values: dict[RankKey, float] = {}
    for job_id, verdict in tracker.judged(ranks).items():
        for rank, v in verdict.ranks.items():
            values[(job_id, rank)] = v.seconds
    if job_level is not None:
        live = {r.key for r in ranks if not r.gone}
        for job_id in sorted({key[0] for key in live}):
            judged = job_level(job_id)
            if judged is None:
                continue
            for key in [k for k in values if k[0] == job_id and k[1] not in judged]:
                del values[key]  # one judgement per job: the job's, where it has one
            for rank, seconds in judged.items():
                if (job_id, rank) in live:
                    values[(job_id, rank)] = seconds
    family = LATENESS.family()
    for (job_id, rank), seconds in sorted(values.items()):
        if only is None or (job_id, rank) in only:
            family.add_metric([job_id, str(rank)], seconds)
    return [family]
