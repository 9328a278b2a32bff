"""Stragglers across nodes (sidecar/jobview/stragglers.py): the entry times a report carries, the
coordinator's judgement of the whole job with each node's clock corrected, and what every node is
told in the answer to its report."""

from __future__ import annotations

import json

import pytest

from sidecar.jobview import stragglers
from sidecar.jobview.coordinator import Coordinator
from sidecar.jobview.report import NodeReport, parse_report
from sidecar.jobview.stragglers import RankEntries, Sent, parse_answer, parse_entries
from sidecar.ranks.protocol import ProtocolError
from tests.jobview.helpers import rank, report

T0 = 1_764_870_000.0
STEP = 0.4  # seconds between a group's collectives (a report's 16 span 6 s: lateness.CONFIRM_SECONDS)
DELAY = 0.0005  # one-way delay of a report, node to coordinator


def entries(r: int, late: float = 0.0, first: int = 100, count: int = 16, clock: float = 0.0, pg: str = "0"):
    """Rank r's entry times of `count` collectives of group `pg`, `late` seconds after the group's
    other members, read on a clock `clock` seconds off the coordinator's."""
    recent = tuple((s, T0 + s * STEP + late + clock + 0.001 * (r % 3)) for s in range(first, first + count))
    return RankEntries(r, {(pg, None): recent})


class Walls:
    """The coordinator's wall clock and monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = T0 + 100

    def wall(self) -> float:
        return self.now

    def mono(self) -> float:
        return self.now - T0


def coordinator(walls: Walls, node: str = "node-0") -> Coordinator:
    return Coordinator(
        lambda job: 8 if job == "j1" else 0, lost_after=15.0, verdict_wait=3.0, max_nodes=16, probe=None,
        clock=walls.mono, wall=walls.wall, node=node,
    )  # fmt: skip


def send(
    c: Coordinator, walls: Walls, node: str, ranks: list[int], lateness: list[RankEntries], clock: float = 0.0,
    delay: float = DELAY,
):  # fmt: skip
    """A healthy report of `node`, stamped by its own clock (`clock` seconds off), taken `delay` later."""
    walls.now += 1.5  # past the judgement's rate limit
    r = report(node, *(rank(x, state="healthy", waiting=None) for x in ranks), world=8, lateness=lateness)
    r.time = walls.now + clock
    walls.now += delay
    c.accept(r)


# ---------------------------------------------------------------- the report field


def test_a_reports_entry_times_survive_the_round_trip():
    sent = report("node-1", rank(2, state="healthy"), lateness=[entries(2, 0.1), entries(3)])
    sent.lateness[0].groups[("1", (0, 2))] = ((7, T0 + 1.5), (8, T0 + 1.75))
    wire = json.loads(json.dumps(sent.to_wire()))
    got = parse_report(wire, 64).lateness
    assert [e.rank for e in got] == [2, 3]
    assert got[0].groups[("1", (0, 2))] == ((7, T0 + 1.5), (8, T0 + 1.75))
    assert got[0].groups[("0", None)] == tuple((s, round(t, 4)) for s, t in entries(2, 0.1).groups[("0", None)])


def test_a_report_without_entry_times_is_accepted_and_carries_none():
    """A node that predates the field: absent means none; a report without any omits it."""
    wire = report("node-1", rank(2)).to_wire()
    assert "lateness" not in wire
    assert parse_report(wire, 64).lateness == []


def good() -> dict:
    return {"rank": 2, "groups": [{"pg": "0", "ranks": [0, 2], "recent": [[5, T0], [6, T0 + 0.1]]}]}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda e: e.update(rank=-1), "lateness[0].rank"),
        (lambda e: e.update(rank="2"), "lateness[0].rank"),
        (lambda e: e["groups"][0].update(pg="a\x1b[31m"), "lateness[0].groups[0].pg"),
        (lambda e: e["groups"][0].update(ranks=[0, 1 << 40]), "lateness[0].groups[0].ranks[1]"),
        (lambda e: e["groups"][0].update(recent=[[6, T0], [5, T0]]), "lateness[0].groups[0].recent[1]"),
        (lambda e: e["groups"][0].update(recent=[[5, float("inf")]]), "lateness[0].groups[0].recent[0]"),
        (lambda e: e["groups"][0].update(recent=[[5, -1.0]]), "lateness[0].groups[0].recent[0]"),
        (lambda e: e["groups"][0].update(recent=[[5]]), "lateness[0].groups[0].recent[0]"),
        (lambda e: e["groups"][0].update(recent={"5": T0}), "lateness[0].groups[0].recent"),
        (lambda e: e["groups"].append(dict(e["groups"][0])), "lateness[0].groups[1].pg"),
        (lambda e: e.update(groups="0"), "lateness[0].groups"),
    ],
)
def test_malformed_entry_times_are_refused_naming_the_field(change, field):
    entry = good()
    change(entry)
    wire = report("node-1", rank(2)).to_wire() | {"lateness": [entry]}
    with pytest.raises(ProtocolError) as e:
        parse_report(wire, 64)
    assert str(e.value).startswith(field + ":"), str(e.value)


def test_entry_times_are_bounded_per_group_and_per_report():
    too_many = good()
    too_many["groups"][0]["recent"] = [[s, T0 + s] for s in range(stragglers.REPORT_RECENT + 1)]
    with pytest.raises(ProtocolError) as e:
        parse_entries([too_many], 64)
    assert e.value.status == 413 and "lateness[0].groups[0].recent" in str(e.value)
    with pytest.raises(ProtocolError) as e:
        parse_entries([good() | {"rank": r} for r in range(5)], 4)
    assert e.value.status == 413 and str(e.value).startswith("lateness:")
    with pytest.raises(ProtocolError, match=r"lateness\[1\]\.rank: rank 2 is named twice"):
        parse_entries([good(), good()], 64)
    five = good()
    five["groups"] = [{"pg": str(i), "recent": [[1, T0]]} for i in range(stragglers.REPORT_GROUPS + 1)]
    with pytest.raises(ProtocolError) as e:
        parse_entries([five], 64)
    assert e.value.status == 413 and str(e.value).startswith("lateness[0].groups:")


def test_the_coordinator_keeps_a_window_per_group_and_no_rank_beyond_the_world_size():
    j = stragglers.JobJudge()
    for first in range(100, 200, 16):
        j.take("node-0", T0, T0, [entries(0, first=first), entries(8, first=first)], 0.0, 8)
    assert sorted(j.ranks) == [0]  # a job of 8 ranks has no rank 8
    assert [len(times) for times in j.ranks[0].groups.values()] == [stragglers.KEPT]


def test_a_rank_costs_a_report_about_420_bytes_per_group():
    """The stated size: REPORT_RECENT entries of one group, one rank, as JSON on the wire."""
    one = json.dumps(entries(12345, 0.1, first=123456).to_wire(), separators=(",", ":"))
    print(f"\none rank, one group, {stragglers.REPORT_RECENT} entries: {len(one)} bytes")
    assert 300 <= len(one) <= 450


def test_a_rank_is_sent_again_only_once_its_entries_moved():
    sent = Sent()
    first = [entries(0), entries(1)]
    assert sent.due(first) == first
    sent.taken(first)
    assert sent.due([entries(0), entries(1)]) == []
    moved = entries(1, first=101)
    assert sent.due([entries(0), moved]) == [moved]


# ---------------------------------------------------------------- the coordinator's judgement


def test_the_coordinator_names_a_straggler_on_another_node_and_tells_every_node():
    walls = Walls()
    c = coordinator(walls)
    for _ in range(2):
        send(c, walls, "node-0", [0], [entries(0)])
        send(c, walls, "node-1", [1, 2], [entries(1), entries(2, late=0.1)])
        send(c, walls, "node-2", [3], [entries(3)])
    told = {node: c.lateness("j1", node) for node in ("node-0", "node-1", "node-2")}
    for node, judged in told.items():
        assert judged is not None, node
        assert [(s.rank, s.node, s.pg) for s in judged.stragglers] == [(2, "node-1", "0")], node
        assert judged.stragglers[0].seconds == pytest.approx(0.1, abs=0.003)
        assert judged.stragglers[0].interval == pytest.approx(STEP, abs=1e-6)
        assert judged.judged_ranks == 4
    # each node hears its own ranks' lateness, no other node's: the answer does not grow with the job
    assert sorted(told["node-1"].ranks) == [1, 2] and told["node-1"].ranks[2] == pytest.approx(0.1, abs=0.003)
    assert sorted(told["node-0"].ranks) == [0] and sorted(told["node-2"].ranks) == [3]
    wire = json.loads(json.dumps(told["node-2"].to_wire()))
    assert parse_answer(wire).to_wire() == told["node-2"].to_wire()


def test_a_healthy_job_across_nodes_names_no_straggler():
    walls = Walls()
    c = coordinator(walls)
    send(c, walls, "node-0", [0], [entries(0)])
    send(c, walls, "node-1", [1, 2], [entries(1), entries(2)])
    judged = c.lateness("j1", "node-1")
    assert judged is not None and judged.stragglers == [] and judged.judged_ranks == 3


@pytest.mark.parametrize("skew", [0.3, -0.3])
def test_a_node_whose_clock_is_300_ms_off_does_not_make_its_ranks_look_early_or_late(skew):
    """node-1's clock is `skew` seconds off the coordinator's: its ranks' entry times, and the time
    it stamps its reports with, are all off by that much. Corrected by the offset estimate, every
    rank's lateness is what it truly is, within the one-way delay of the quickest report."""
    walls = Walls()
    c = coordinator(walls)
    for _ in range(3):
        send(c, walls, "node-0", [0], [entries(0)])
        send(c, walls, "node-1", [1, 2], [entries(1, clock=skew), entries(2, clock=skew)], clock=skew)
        send(c, walls, "node-2", [3], [entries(3, late=0.05)])
    judged = c.lateness("j1", "node-1")
    assert judged is not None and judged.clock_offset == pytest.approx(skew - DELAY, abs=1e-6)
    # entries() puts rank r 1 ms x (r % 3) late, rank 3 50 ms more: entered at 0, 1, 2 and 50 ms, each
    # judged against the median of the other three's (rank 1: 2 ms, so 0; rank 3: 1 ms)
    truth = {0: 0.0, 1: 0.0, 2: 0.001, 3: 0.049}
    assert judged.stragglers == [] or [s.rank for s in judged.stragglers] == [3]
    verdict = c._jobs["j1"].lateness.verdict
    assert verdict is not None
    for r, want in truth.items():
        assert abs(verdict.ranks[r].seconds - want) <= DELAY + 1e-6, (r, verdict.ranks[r].seconds)


def test_the_clock_offset_is_the_least_delayed_reports_and_one_late_report_moves_nothing():
    """Issue 48: the estimate was the least sample (the most delayed report's): one report held up
    40 ms among 0.5 ms ones made node-1's ranks 40 ms late for 64 reports and named them stragglers."""
    walls = Walls()
    c = coordinator(walls)
    skew = 0.3
    for i in range(6):
        held = 0.04 if i == 2 else DELAY  # the third report of node-1 waits 40 ms (a busy event loop)
        send(c, walls, "node-0", [0], [entries(0, first=100 + 16 * i)])
        send(c, walls, "node-1", [1, 2], [entries(r, clock=skew, first=100 + 16 * i) for r in (1, 2)], clock=skew,
             delay=held)  # fmt: skip
        send(c, walls, "node-2", [3], [entries(3, first=100 + 16 * i)])
        judged = c.lateness("j1", "node-1")
        assert judged is not None and judged.clock_offset == pytest.approx(skew - DELAY, abs=1e-6), (i, judged)
        assert judged.stragglers == [], (i, judged.stragglers)
    verdict = c._jobs["j1"].lateness.verdict
    assert verdict is not None
    for r, want in {0: 0.0, 1: 0.001, 2: 0.002, 3: 0.0}.items():  # entered at 0, 1, 2, 0 ms (entries())
        assert abs(verdict.ranks[r].seconds - want) <= DELAY + 1e-6, (r, verdict.ranks[r].seconds)


def test_a_clock_that_steps_is_followed_and_late_reports_alone_are_no_step():
    o = stragglers.ClockOffset()
    for delay in (0.002, 0.0005, 0.03, 0.001):
        o.add(0.3 - delay)
    assert o.estimate == pytest.approx(0.2995)
    for _ in range(stragglers.STEP_REPORTS - 1):  # reports held up 0.4 s, but fewer than a step's
        o.add(0.3 - 0.4)
    o.add(0.3 - 0.001)
    assert o.estimate == pytest.approx(0.2995) and o.steps == 0
    o.add(0.8 - 0.001)  # stepped forward half a second: followed at once
    assert o.estimate == pytest.approx(0.799)
    for delay in (0.003, 0.0007, 0.002):  # stepped back to -0.2 s: followed after STEP_REPORTS reports
        o.add(-0.2 - delay)
    assert o.steps == 1 and o.estimate == pytest.approx(-0.2007)
    o.add(-0.2 - 0.0004)  # and the least-delayed report wins again
    assert o.estimate == pytest.approx(-0.2004)
    for _ in range(stragglers.OFFSET_REPORTS):  # the window moves on: the old best ages out
        o.add(-0.2 - 0.001)
    assert o.estimate == pytest.approx(-0.201)
    for i in range(1, 41):  # slewed back 1 ms a report (chrony): followed within the lateness floor
        o.add(-0.201 - 0.001 * i)
        assert o.estimate - (-0.201 - 0.001 * i) <= stragglers.STEP_SECONDS + 0.004, i


def test_the_estimates_error_is_bounded_by_the_round_trips_its_node_measured():
    """make test on a saturated machine: every report of a node took 50-65 ms to be taken, so the
    estimate was 50-65 ms below the true offset, which the product promises (the least one-way
    delay) but did not show. Each report now carries its node's round trip of the report before it
    (a bound on that one's one-way delay): the offset lies in [sample, sample + rtt] for each, and
    the estimate's error bound is the least such upper end minus the estimate."""
    o, truth = stragglers.ClockOffset(), 3.0
    o.add(truth - 0.060)  # the first report: its round trip is known only at the next one
    assert o.estimate == pytest.approx(truth - 0.060) and o.error is None  # nothing bounds it yet
    o = stragglers.ClockOffset()
    delays, rtts = (0.060, 0.055, 0.052, 0.090, 0.058), (0.125, 0.070, 0.061, 0.200, 0.080)
    previous = None
    for delay, rtt in zip(delays, rtts, strict=True):
        o.add(truth - delay, previous_rtt=previous)
        previous = rtt
        assert o.estimate <= truth  # a sample is never above the true offset
        if o.error is not None:
            assert truth - o.estimate <= o.error + 1e-9, (o.estimate, o.error)
    assert o.estimate == pytest.approx(truth - 0.052)
    assert o.error == pytest.approx(0.061)  # the 52 ms report's round trip: the offset <= 2.948 + 0.061
    wire = stragglers.JobLateness(1.0, clock_offset=o.estimate, clock_offset_error=o.error).to_wire()
    back = stragglers.parse_answer(json.loads(json.dumps(wire)))
    assert back is not None and back.clock_offset_error == pytest.approx(0.061)
    older = stragglers.parse_answer({k: v for k, v in wire.items() if k != "clock_offset_error"})
    assert older is not None and older.clock_offset_error is None  # a coordinator that predates it


def test_a_reports_round_trip_survives_the_wire_and_a_bad_one_is_refused_naming_it():
    wire = NodeReport("j1", "node-1", 4, 100.0, [], rtt=0.0123456789).to_wire()
    assert parse_report(json.loads(json.dumps(wire)), 16).rtt == pytest.approx(0.012346)
    assert "rtt" not in NodeReport("j1", "node-1", 4, 100.0, []).to_wire()  # absent when unknown: older peers
    for bad in (-1.0, "1", True, float("inf")):
        with pytest.raises(ProtocolError, match="^rtt"):
            parse_report({**wire, "rtt": bad}, 16)


def test_a_node_forgotten_takes_its_ranks_out_of_the_judgement():
    j = stragglers.JobJudge()
    j.take("node-0", T0, T0, [entries(0)], 0.0, 8)
    j.take("node-1", T0, T0, [entries(1, late=0.1)], 0.0, 8)
    j.forget_node("node-1")
    assert j.judge(10.0, T0) and j.verdict is not None and sorted(j.verdict.ranks) == []
    j.take("node-1", T0, T0, [entries(1, late=0.1, first=110)], 20.0, 8)
    j.take("node-0", T0, T0, [entries(0, first=110)], 20.0, 8)
    assert j.judge(30.0, T0) and j.verdict.stragglers == [1]
    assert not j.judge(30.5, T0)  # nothing new, and too soon
    assert j.judge(100.0, T0) is False  # nothing new: no judgement however late
    j.take("node-0", T0, T0, [entries(0, first=111)], 100.0, 8)
    assert j.judge(100.0 + stragglers.STALE_SECONDS + 1, T0)
    assert sorted(j.verdict.ranks) == []  # both ranks' entries stopped moving: left out


# ---------------------------------------------------------------- the answer field


def test_an_answer_without_lateness_means_none_and_a_malformed_one_is_refused_naming_the_field():
    assert parse_answer(None) is None
    one = {"rank": 2, "node": "node-1", "seconds": 0.1, "pg": "0", "interval": 0.15, "threshold": 0.0375}
    good_answer = {"time": T0, "stragglers": [one], "ranks": [[2, 0.1]]}
    got = parse_answer(good_answer)
    assert got is not None and got.stragglers[0].rank == 2 and got.ranks == {2: 0.1} and got.clock_offset is None
    for bad, field in [
        ({**good_answer, "time": "now"}, "lateness.time"),
        ({**good_answer, "ranks": [[2, -0.1]]}, "lateness.ranks[0]"),
        ({**good_answer, "stragglers": [{**one, "node": "a\nb"}]}, "lateness.stragglers[0].node"),
        ({**good_answer, "stragglers": [one] * 9}, "lateness.stragglers"),
    ]:
        with pytest.raises(ProtocolError) as e:
            parse_answer(bad)
        assert str(e.value).startswith(field + ":"), str(e.value)


def test_the_reporter_sends_entries_once_and_keeps_what_its_coordinator_judged():
    """Through the reporter (here with this node's own coordinator, in-process): the first report
    carries the ranks' entries, the next ones none until they move; the judgement comes back as
    this node's ranks' lateness (the metric's source) and in its status."""
    import asyncio

    from sidecar.jobview.reporter import Reporter

    async def scenario():
        c = Coordinator(lambda job: 2 if job == "j1" else 0, lost_after=15.0, verdict_wait=3.0, max_nodes=4,
                        probe=None, node="node-0")  # fmt: skip
        carried: list[int] = []
        accept = c.accept

        def counting(r):
            carried.append(len(r.lateness))
            return accept(r)

        c.accept = counting  # type: ignore[method-assign]

        def source(job_id: str):
            ranks = [rank(0, state="healthy", waiting=None), rank(1, state="healthy", waiting=None)]
            return report("node-0", *ranks, world=2, lateness=[entries(0), entries(1, late=0.1)])

        reporter = Reporter("node-0", "http://127.0.0.1:1", 0.05, source, local=c)
        reporter.set_coordinator("j1", "http://127.0.0.1:1", "node-0", None)
        task = asyncio.get_running_loop().create_task(reporter.run())
        try:
            for _ in range(100):
                await asyncio.sleep(0.05)
                if reporter.lateness_of("j1") is not None and len(carried) >= 3:
                    break
            assert reporter.clock_offset("j2") == {}  # no job view: the push answer says nothing
            said = reporter.clock_offset("j1")  # the push answer's, which the hooks' slots follow
            assert set(said) == {"clock_offset"} and abs(said["clock_offset"]) < 0.5, said
            return carried, reporter.lateness_of("j1"), reporter.status()["j1"]["lateness"]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    carried, mine, shown = asyncio.run(scenario())
    assert carried[0] == 2 and set(carried[1:]) == {0}, carried
    assert mine is not None and mine[1] == pytest.approx(0.1, abs=0.003) and mine[0] == pytest.approx(0.0)
    assert [s["rank"] for s in shown["stragglers"]] == [1] and shown["age_seconds"] < 5


def test_the_coordinator_names_a_rank_only_once_it_has_been_late_for_the_confirm_seconds():
    """Across nodes too: late over 16 collectives of 100 ms steps (1.5 s) is a moment; the same rank
    still late at a later report, 5 s of collectives on, is the job's straggler."""
    fast = 0.1

    def of(r: int, late: float, first: int) -> RankEntries:
        return RankEntries(r, {("0", None): tuple((s, T0 + s * fast + late) for s in range(first, first + 16))})

    j = stragglers.JobJudge()
    j.take("node-0", T0, T0, [of(0, 0.0, 100), of(2, 0.0, 100)], 0.0, 8)
    j.take("node-1", T0, T0, [of(1, 0.05, 100)], 0.0, 8)
    assert j.judge(1.0, T0) and j.verdict is not None and j.verdict.ranks[1].seconds == pytest.approx(0.05)
    assert j.verdict.stragglers == [] and j.since[1][0] == pytest.approx(T0 + 100 * fast)
    j.take("node-0", T0, T0, [of(0, 0.0, 150), of(2, 0.0, 150)], 5.0, 8)
    j.take("node-1", T0, T0, [of(1, 0.05, 150)], 5.0, 8)
    assert j.judge(6.0, T0) and j.verdict.stragglers == [1]
    assert [s.rank for s in j.answer("node-0").stragglers] == [1]  # type: ignore[union-attr]
