"""Lateness per rank (sidecar/ranks/lateness.py) from synthetic collective records: who enters each
collective of its group last, by how much, and which rank is the straggler."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from sidecar.ranks import lateness
from sidecar.ranks.collectives import parse_collectives
from sidecar.ranks.lateness import Tracker, judge
from sidecar.ranks.model import Rank
from sidecar.ranks.protocol import ProtocolError
from trainer_hooks.wire import COLLECTIVES_MAX_RECENT

T0 = 1_800_000_000.0
STEP = 0.250  # seconds between a group's collectives (32 span 7.75 s: lateness.CONFIRM_SECONDS)


def times(ranks, seqs, delay: Callable[[int, int], float], key=("0", None)) -> dict:
    """rank -> {group: {seq: entry time}}: each rank enters seq s at T0 + s*STEP + delay(rank, s)."""
    return {r: {key: {s: T0 + s * STEP + delay(r, s) for s in seqs}} for r in ranks}


def test_a_healthy_job_names_no_straggler():
    rng = random.Random(1)
    v = judge(times(range(4), range(1, 41), lambda r, s: rng.uniform(0, 0.003)))
    assert v.stragglers == []
    assert all(rl.seconds < 0.003 for rl in v.ranks.values())
    assert v.groups[0].sequences == COLLECTIVES_MAX_RECENT  # the window: the last 32 common sequences


def test_one_slow_rank_is_named_with_its_delay():
    rng = random.Random(2)
    v = judge(times(range(4), range(1, 41), lambda r, s: (0.1 if r == 2 else 0) + rng.uniform(0, 0.002)))
    assert v.stragglers == [2]
    assert v.ranks[2].seconds == pytest.approx(0.1, abs=0.003)
    assert all(v.ranks[r].seconds < 0.003 for r in (0, 1, 3))
    assert v.groups[0].interval == pytest.approx(STEP, abs=0.003)


def test_a_rank_released_late_while_its_peers_wait_for_the_straggler_is_not_named():
    """Issue 48: beside a rank under a CPU quota (97 ms late), a healthy rank of another node was
    named at 34 ms: on a busy machine the previous all-reduce's completion reached it later, so it
    entered late too, but always before the straggler: nobody waited for it. A straggler holds its
    group up: it enters within the threshold of the last member in most collectives."""
    rng = random.Random(4)
    v = judge(times(range(4), range(1, 41), lambda r, s: {2: 0.097, 3: 0.034}.get(r, 0) + rng.uniform(0, 0.004)))
    assert v.ranks[3].seconds == pytest.approx(0.034, abs=0.005) and v.ranks[3].seconds > v.groups[0].threshold
    assert v.stragglers == [2], (v.stragglers, v.groups[0].holding)
    assert v.groups[0].holding[2] == 1.0 and v.groups[0].holding[3] == 0.0
    # a large group: some rank hiccups in most collectives, later than the straggler; measured against
    # the 90th percentile's entry, not the very last member's, the straggler still holds the group up
    hiccups = {s: set(rng.sample(range(200), 2)) for s in range(1, 41)}
    v = judge(times(range(200), range(1, 41), lambda r, s: (0.03 if r == 7 else 0) + (0.2 if r in hiccups[s] else 0)
                    + rng.uniform(0, 0.004)))  # fmt: skip
    assert v.stragglers == [7], (v.stragglers, v.groups[0].holding.get(7))
    # two ranks equally slow (within the threshold of each other) both hold the group up: both named
    v = judge(times(range(8), range(1, 41), lambda r, s: (0.1 if r in (2, 5) else 0) + rng.uniform(0, 0.004)))
    assert v.stragglers == [2, 5]


def test_with_data_and_tensor_parallel_groups_only_the_slow_rank_is_named():
    """4 ranks: tensor parallel {0,1} {2,3}, data parallel {0,2} {1,3}. Rank 3 computes 80 ms longer
    before its tensor-parallel collective; rank 2 waits for it there, so it enters its data-parallel
    collective as late as rank 3: late in one of its groups, on time in the other."""
    tp = {0: ("1", (0, 1)), 1: ("1", (0, 1)), 2: ("2", (2, 3)), 3: ("2", (2, 3))}
    dp = {0: ("3", (0, 2)), 2: ("3", (0, 2)), 1: ("4", (1, 3)), 3: ("4", (1, 3))}
    d, rng = 0.08, random.Random(3)
    entries: dict = {r: {tp[r]: {}, dp[r]: {}} for r in range(4)}
    for s in range(1, 41):
        base = T0 + s * STEP
        for r in range(4):
            entries[r][tp[r]][s] = base + (d if r == 3 else 0) + rng.uniform(0, 0.002)
            # after the TP collective, which ends when its last member entered
            entries[r][dp[r]][s] = base + 0.01 + (d if r in (2, 3) else 0) + rng.uniform(0, 0.002)
    v = judge(entries)
    assert v.stragglers == [3]
    assert v.ranks[3].seconds == pytest.approx(d, abs=0.003)
    assert v.ranks[2].groups == {"2": pytest.approx(0, abs=0.003), "3": pytest.approx(d, abs=0.003)}
    assert v.ranks[2].seconds < 0.003  # on time in the group where it waited
    assert all(v.ranks[r].seconds < 0.003 for r in (0, 1, 2))


def _noisy(world: int, seed: int, noise: float, slow: dict[int, float] | None = None) -> dict:
    """`world` ranks whose compute per step varies by up to `noise` seconds (uniform), drawn per rank
    and sequence (a real job's noisy steps), `slow` ranks that many seconds more."""
    rng, slow = random.Random(seed), slow or {}
    return times(range(world), range(1, 41), lambda r, s: slow.get(r, 0.0) + rng.uniform(0, noise))


@pytest.mark.parametrize("world", [4, 16, 64])
def test_a_large_noisy_healthy_group_names_no_straggler(world):
    """The first of N noisy members enters ever earlier as N grows (the least of N draws): measured
    after the first member, every rank of 64 with 50 ms of step noise was 25 ms late, above the
    20 ms floor, and all 64 were named (before lateness was measured against the member's peers).
    Against the median of its peers a healthy rank's median lateness stays near 0 whatever N."""
    v = judge(_noisy(world, seed=world, noise=0.05))
    assert v.stragglers == []
    assert max(rl.seconds for rl in v.ranks.values()) < 0.012


@pytest.mark.parametrize("world", [4, 16, 64])
def test_a_straggler_among_noisy_ranks_is_named_alone_with_its_delay(world):
    v = judge(_noisy(world, seed=world + 1, noise=0.05, slow={world - 2: 0.06}))
    assert v.stragglers == [world - 2]
    assert v.ranks[world - 2].seconds == pytest.approx(0.06, abs=0.012)


def test_collectives_not_every_member_has_reported_yet_are_not_judged():
    """Four ranks' records come a few at a time. Ranks 0 and 1 have sent collectives 41-72, in which
    rank 0 came 50 ms after rank 1 (a burst of load); ranks 2 and 3 have not yet. Judged on the two
    alone, rank 0 was named until the others' records came (a healthy job's transient straggler);
    those collectives wait for every member, and once ranks 2 and 3 send theirs, on time with
    rank 1, rank 0 is late against its peers' median and named."""
    entries = {r: {("0", None): {s: T0 + s * STEP for s in range(1, 41)}} for r in range(4)}
    for r in (0, 1):
        entries[r][("0", None)].update({s: T0 + s * STEP + (0.05 if r == 0 else 0) for s in range(41, 73)})
    v = judge(entries)
    assert v.stragglers == [] and v.groups[0].sequences == COLLECTIVES_MAX_RECENT
    assert max(v.groups[0].lateness.values()) < 1e-9  # collectives 9-40, all four on time
    for r in (2, 3):
        entries[r][("0", None)].update({s: T0 + s * STEP for s in range(41, 73)})
    v = judge(entries)
    assert v.stragglers == [0] and v.ranks[0].seconds == pytest.approx(0.05, abs=1e-6)


def test_clock_jitter_below_the_floor_names_no_straggler():
    """One rank always 15 ms behind (a clock offset, scheduling) with jitter of +-5 ms: below the floor."""
    rng = random.Random(4)
    v = judge(times(range(2), range(1, 41), lambda r, s: (0.015 if r == 1 else 0) + rng.uniform(-0.005, 0.005)))
    assert v.stragglers == []
    assert 0.005 < v.ranks[1].seconds < lateness.FLOOR_SECONDS


def test_lateness_small_against_the_interval_between_collectives_is_no_straggler():
    """25 ms late in a group whose collectives come every 2 s: above the floor, below 0.1 x interval."""
    entries = {r: {("0", None): {s: T0 + 2.0 * s + (0.025 if r == 1 else 0) for s in range(1, 21)}} for r in (0, 1)}
    v = judge(entries)
    assert v.ranks[1].seconds == pytest.approx(0.025, abs=1e-5) and v.stragglers == []


def test_too_few_common_collectives_name_no_one_yet():
    v = judge(times(range(2), range(1, 4), lambda r, s: 0.1 if r == 1 else 0))
    assert v.ranks[1].seconds == pytest.approx(0.1, abs=1e-5) and v.stragglers == []


def test_only_sequences_two_members_entered_count():
    """Rank 1's record was read before rank 0's: rank 0's newer entries have no peer yet."""
    entries = {
        0: {("0", None): {s: T0 + s * STEP for s in range(1, 41)}},
        1: {("0", None): {s: T0 + s * STEP + 0.1 for s in range(1, 31)}},
    }
    v = judge(entries)
    assert v.groups[0].sequences == 30 and v.stragglers == [1]


def _record(seqs, at: float, pg="0") -> dict:
    return {"time": at, "groups": [{"pg": pg, "desc": "", "size": 2, "ranks": [0, 1], "enqueued": max(seqs),
                                    "started": -1, "completed": max(seqs), "pending": [],
                                    "recent": [[s, at - 1 + s * 0.001] for s in seqs]}]}  # fmt: skip


def test_a_record_carries_its_entry_times():
    parsed = parse_collectives(_record(range(5, 10), T0))
    assert parsed is not None and parsed.groups[0].recent[0] == (5, pytest.approx(T0 - 1 + 0.005))
    assert parse_collectives({**_record([1], T0), "groups": [{**_record([1], T0)["groups"][0], "recent": []}]})


@pytest.mark.parametrize(
    ("recent", "field"),
    [
        ("x", "collectives.groups[0].recent"),
        ([[1, T0]] * (COLLECTIVES_MAX_RECENT + 1), "collectives.groups[0].recent"),
        ([[1]], "collectives.groups[0].recent[0]"),
        ([[1, T0, 3]], "collectives.groups[0].recent[0]"),
        ([[-1, T0]], "collectives.groups[0].recent[0]"),
        ([[1 << 62, T0]], "collectives.groups[0].recent[0]"),
        ([[True, T0]], "collectives.groups[0].recent[0]"),
        ([[1.0, T0]], "collectives.groups[0].recent[0]"),
        ([[2, T0], [2, T0]], "collectives.groups[0].recent[1]"),
        ([[3, T0], [2, T0]], "collectives.groups[0].recent[1]"),
        ([[1, float("nan")]], "collectives.groups[0].recent[0]"),
        ([[1, float("inf")]], "collectives.groups[0].recent[0]"),
        ([[1, -1.0]], "collectives.groups[0].recent[0]"),
        ([[1, 1e12]], "collectives.groups[0].recent[0]"),
        ([[1, "1"]], "collectives.groups[0].recent[0]"),
        ([[1, None]], "collectives.groups[0].recent[0]"),
    ],
)
def test_a_malformed_recent_is_refused_naming_the_field(recent, field):
    record = _record([1], T0)
    record["groups"][0]["recent"] = recent
    with pytest.raises(ProtocolError) as e:
        parse_collectives(record)
    assert str(e.value).startswith(field + ":"), str(e.value)


def _rank(rank: int, job="job") -> Rank:
    return Rank(job_id=job, rank=rank, local_rank=rank, world_size=2, local_world_size=2, pid=1000 + rank,
                pid_start_time=1.0)  # fmt: skip


def _take(r: Rank, seqs, delay: float) -> None:
    record = _record(list(seqs), T0)
    record["groups"][0]["recent"] = [[s, T0 + s * STEP + delay] for s in seqs]
    r.take_collectives(parse_collectives(record), None, 0.0)


def test_the_tracker_joins_records_read_at_different_moments():
    """Rank 0's record covers #1-32, then #41-72; rank 1's #9-40: only the history makes them meet
    (#9-32), and rank 0's newer entries join rank 1's next record."""
    r0, r1 = _rank(0), _rank(1)
    tracker = Tracker()
    _take(r0, range(1, 33), 0.0)
    _take(r1, range(9, 41), 0.1)
    tracker.judged([r0, r1])
    _take(r0, range(41, 73), 0.0)
    v = tracker.judged([r0, r1])["job"]
    assert v.groups[0].sequences == 24 and v.stragglers == [1]
    _take(r1, range(41, 73), 0.1)
    fam = lateness.families(tracker, [r0, r1])[0]
    got = {s.labels["rank"]: s.value for s in fam.samples}
    assert got == {"0": pytest.approx(0.0, abs=1e-5), "1": pytest.approx(0.1, abs=1e-5)}
    assert tracker.judged([r0, r1])["job"].groups[0].sequences == COLLECTIVES_MAX_RECENT


def test_a_restarted_rank_starts_anew_and_gone_ranks_are_not_shown():
    r0, r1 = _rank(0), _rank(1)
    tracker = Tracker()
    _take(r0, range(1, 33), 0.0)
    _take(r1, range(1, 33), 0.1)
    tracker.judged([r0, r1])
    again = _rank(1)  # a new registration: its process group formed anew, its sequences from 1 again
    _take(again, range(1, 33), 0.0)
    fam = lateness.families(tracker, [r0, again])[0]
    assert {s.labels["rank"]: s.value for s in fam.samples} == {"0": 0.0, "1": pytest.approx(0.0, abs=1e-5)}
    again.gone = True
    assert lateness.families(tracker, [r0, again])[0].samples == []
    assert lateness.series(again) == 0 and lateness.series(r0) == 1


def test_ranks_of_other_jobs_are_never_compared():
    a, b = _rank(0, "a"), _rank(1, "b")
    _take(a, range(1, 33), 0.0)
    _take(b, range(1, 33), 0.1)
    assert lateness.families(Tracker(), [a, b])[0].samples == []


def test_a_rank_judged_across_nodes_shows_the_jobs_value_on_its_own_node_only():
    """The job view's coordinator judged the job (job_level: this node's ranks -> lateness): its
    value wins over this node's own for every rank of the job, a rank alone on its node gets one,
    a rank of another node named in the judgement is never exported here, and a job without a
    fresh judgement keeps this node's own."""
    r1, r2, alone, other = _rank(1), _rank(2), _rank(5, "solo"), _rank(0, "other")
    for r, delay in ((r1, 0.0), (r2, 0.1), (alone, 0.0), (other, 0.0)):
        _take(r, range(1, 33), delay)
    judged = {"job": {1: 0.004, 2: 0.104, 0: 0.0}, "solo": {5: 0.3, 6: 0.0}}
    fam = lateness.families(Tracker(), [r1, r2, alone, other], job_level=judged.get)[0]
    got = {(s.labels["job_id"], s.labels["rank"]): s.value for s in fam.samples}
    assert got == {("job", "1"): 0.004, ("job", "2"): 0.104, ("solo", "5"): 0.3}
    # without a judgement for the job, this node's own (the two ranks of "job" here)
    fam = lateness.families(Tracker(), [r1, r2], job_level=lambda job_id: None)[0]
    got = {s.labels["rank"]: s.value for s in fam.samples}
    assert got == {"1": pytest.approx(0.0, abs=1e-5), "2": pytest.approx(0.1, abs=1e-5)}


def test_one_judgement_serves_every_reader_until_a_record_comes_or_a_rank_goes():
    """/metrics, /v1/status and the straggler incidents read one Tracker: asked again with nothing
    new, it does not judge again; a new record, a restarted rank or a gone one makes it judge anew."""
    from sidecar.jobview import stragglers

    r0, r1 = _rank(0), _rank(1)
    tracker = Tracker()
    _take(r0, range(1, 33), 0.0)
    _take(r1, range(1, 33), 0.1)
    first = tracker.judged([r0, r1])
    shown = stragglers.status("node-0", [r0, r1], lambda j: None, lambda j: None, tracker)
    fam = lateness.families(tracker, [r0, r1])[0]
    assert tracker.judgements == 1 and tracker.judged([r0, r1]) is first
    # the three readers say the same: rank 1, 100 ms late
    assert [(j["judged_by"], [s["rank"] for s in j["stragglers"]]) for j in shown] == [("node", [1])]
    assert {s.labels["rank"]: round(s.value, 3) for s in fam.samples} == {"0": 0.0, "1": 0.1}
    _take(r1, range(33, 65), 0.0)  # a new record: judged again
    assert tracker.judged([r0, r1]) is not first and tracker.judgements == 2
    again = _rank(1)  # rank 1 registered anew
    _take(again, range(1, 33), 0.0)
    tracker.judged([r0, again])
    r0.gone = True
    assert tracker.judged([r0, again]) == {} and tracker.judgements == 4


FAST = 0.05  # 50 ms steps: the 32 collectives a judgement sees span 1.55 s


def _take_fast(r: Rank, seqs, late: float) -> None:
    record = _record(list(seqs), T0)
    record["groups"][0]["recent"] = [[s, T0 + s * FAST + late] for s in seqs]
    r.take_collectives(parse_collectives(record), None, 0.0)


def test_a_rank_late_for_a_moment_of_fast_steps_is_no_straggler_and_one_late_for_seconds_is():
    """Steps of 50 ms: a rank 26 ms late over one read's 32 collectives (1.55 s) is a rank slowed for a
    moment (a healthy 3-node job on a loaded machine was named so), not a straggler; on time at the
    next read, it is forgotten; late at every read from collective 401 to 532 (6.5 s), it is named."""
    r0, r1 = _rank(0), _rank(1)
    tracker = Tracker()
    reads = [(range(1, 33), 0.026, []), (range(201, 233), 0.0, []), (range(401, 433), 0.026, [])]
    reads += [(range(501, 533), 0.026, [1])]
    for seqs, late, named in reads:
        _take_fast(r0, seqs, 0.0)
        _take_fast(r1, seqs, late)
        v = tracker.judged([r0, r1])["job"]
        assert v.ranks[1].seconds == pytest.approx(late, abs=1e-5) and v.groups[0].threshold == 0.02
        assert v.stragglers == named, (seqs, late)
    assert lateness.confirm(judge(times(range(2), range(1, 33), lambda r, s: 0.026 * r)), {}).stragglers == [1]


def test_confirm_names_a_rank_once_its_late_collectives_span_the_confirm_seconds():
    since: dict[int, tuple[float, float]] = {}
    late = judge(times(range(3), range(1, 17), lambda r, s: 0.05 * (r == 2)))  # 16 collectives: 3.75 s
    assert late.stragglers == [2] and lateness.confirm(late, since).stragglers == []
    assert since == {2: (pytest.approx(T0 + STEP), pytest.approx(T0 + 16 * STEP))}
    assert lateness.confirm(judge({}), since).stragglers == [] and 2 in since  # not judged: kept
    later = judge(times(range(3), range(9, 25), lambda r, s: 0.05 * (r == 2)))  # to T0 + 24 * STEP: 5.75 s on
    assert lateness.confirm(later, since).stragglers == [2]
    on_time = judge(times(range(3), range(25, 41), lambda r, s: 0.0))
    assert lateness.confirm(on_time, since).stragglers == [] and since == {}
    lateness.confirm(judge(times(range(3), range(41, 57), lambda r, s: 0.05 * (r == 2))), since)
    much_later = judge(times(range(3), range(200, 216), lambda r, s: 0.05 * (r == 2)))  # 36 s after: anew
    assert lateness.confirm(much_later, since).stragglers == [] and since[2][0] == pytest.approx(T0 + 200 * STEP)
