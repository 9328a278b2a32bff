"""Judging from the backend's own record (sidecar/jobview/collectives.py): each rank's Flight
Recorder summary, as the hooks send it, decides rank_late, collective_stuck and collective_mismatch
before the stacks; records that do not decide it yet make the judge wait, never guess."""

from __future__ import annotations

import json

import pytest

from sidecar.jobview import collectives
from sidecar.jobview.coordinator import Coordinator
from sidecar.jobview.judge import judge
from sidecar.jobview.report import NodeReport, parse_report, parse_verdict
from sidecar.ranks.collectives import Collectives, Group, Pending, parse_collectives, parse_fr_dump
from sidecar.ranks.protocol import ProtocolError
from tests.jobview.helpers import rank, report

NOW = 1_000_000.0


def group(pg="0", enqueued=5, completed=5, inside=None, op="all_reduce", sizes=((256,),), size=4, seq=None):
    """A rank's group: `inside` seconds in collective `seq` (default enqueued) when it read its record."""
    pending = []
    if enqueued > completed:
        at = seq if seq is not None else completed + 1
        pending = [Pending(at, op, tuple(sizes), NOW - (inside if inside is not None else 10.0))]
    return Group(pg, "default_pg" if pg == "0" else "", size, None, enqueued, enqueued, completed, pending)


def view(r, *groups, age=0.2, state="stalled", waiting=None, node_step=29):
    v = rank(r, state=state, step=node_step, waiting=waiting)
    v.collectives, v.collectives_age = Collectives(NOW, list(groups)), age
    return v


def pairs(*views, nodes=None):
    return [((nodes or {}).get(v.rank, f"node-{v.rank}"), v) for v in views]


def test_the_rank_that_never_entered_is_late_whatever_its_stack_says():
    waiting = [view(r, group(enqueued=6, completed=5)) for r in (0, 1, 3)]
    late = view(2, group(enqueued=5, completed=5), waiting=True)  # its stack even looks like a wait
    found = collectives.judge(pairs(*waiting, late))
    assert found is not None and found.kind == "rank_late"
    culprit = found.to_culprit()
    assert (culprit.rank, culprit.node, culprit.evidence) == (2, "node-2", "collectives")
    assert culprit.collective is not None and (culprit.collective["seq"], culprit.collective["late"]) == (6, [2])
    assert "never entered" in culprit.reason


def test_a_record_read_just_before_its_peers_entered_proves_nothing_until_it_is_old_or_renewed():
    waiting = [view(r, group(enqueued=6, completed=5, inside=0.5), age=0.1) for r in (0, 1, 3)]
    behind = view(2, group(enqueued=5, completed=5), age=0.7)  # read before the others entered #6
    assert collectives.judge(pairs(*waiting, behind), stale_after=5.0) is None
    forced = collectives.judge(pairs(*waiting, behind), stale_after=5.0, force=True)
    assert forced is not None and forced.culprit is not None and forced.culprit[1].rank == 2
    stopped = view(2, group(enqueued=5, completed=5), age=6.0)  # its record stopped coming
    found = collectives.judge(pairs(*waiting, stopped), stale_after=5.0)
    assert found is not None and found.culprit is not None and found.culprit[1].rank == 2
    assert "stopped" in found.reason


def test_every_member_inside_for_long_with_fresh_records_is_a_stuck_collective():
    members = [view(r, group(enqueued=6, completed=5, inside=12.0)) for r in range(4)]
    nodes = {0: "node-0", 1: "node-1", 2: "node-1", 3: "node-2"}
    found = collectives.judge(pairs(*members, nodes=nodes), stale_after=5.0)
    assert found is not None and found.kind == "collective_stuck"
    culprit = found.to_culprit()
    assert culprit.rank is None and culprit.collective is not None
    assert culprit.collective["nodes"] == ["node-0", "node-1", "node-2"] and culprit.collective["seq"] == 6


def test_a_collective_one_member_entered_moments_ago_is_not_stuck():
    members = [view(r, group(enqueued=6, completed=5, inside=12.0)) for r in range(3)]
    members.append(view(3, group(enqueued=6, completed=5, inside=0.01)))
    assert collectives.judge(pairs(*members), stale_after=5.0) is None


def test_a_stuck_collective_waits_for_members_not_heard_from():
    members = [view(r, group(enqueued=6, completed=5, inside=12.0)) for r in range(3)]  # size 4, rank 3 unknown
    assert collectives.judge(pairs(*members), stale_after=5.0) is None


def test_a_member_in_the_collective_whose_record_stopped_is_to_blame_not_the_network():
    members = [view(r, group(enqueued=6, completed=5, inside=12.0)) for r in range(3)]
    members.append(view(3, group(enqueued=6, completed=5, inside=0.02), age=9.0))
    found = collectives.judge(pairs(*members), stale_after=5.0)
    assert found is not None and found.kind == "rank_late" and found.culprit is not None
    assert found.culprit[1].rank == 3 and "inside" in found.reason


def test_different_collectives_at_one_sequence_are_a_mismatch():
    members = [view(r, group(enqueued=6, completed=5)) for r in (0, 1, 3)]
    members.append(view(2, group(enqueued=6, completed=5, op="barrier", sizes=())))
    found = collectives.judge(pairs(*members))
    assert found is not None and found.kind == "collective_mismatch"
    assert found.ops == {"all_reduce[256]": [0, 1, 3], "barrier": [2]}
    assert found.to_culprit().rank == 2  # the odd one out


def test_a_desync_two_records_show_waits_for_the_rest_before_naming_none():
    """make test: ranks 0 and 3 read their records before entering #6; rank 1's all_reduce against
    rank 2's barrier tied 1-1 and the verdict named no one, killed."""
    before = [view(r, group(enqueued=5, completed=5), age=0.1) for r in (0, 3)]
    one = view(1, group(enqueued=6, completed=5))
    odd = view(2, group(enqueued=6, completed=5, op="barrier", sizes=()))
    assert collectives.judge(pairs(*before, one, odd)) is None  # the others may yet make a minority
    forced = collectives.judge(pairs(*before, one, odd), force=True)
    assert forced is not None and forced.kind == "collective_mismatch" and forced.culprit is None
    renewed = [view(r, group(enqueued=6, completed=5)) for r in (0, 3)]
    found = collectives.judge(pairs(*renewed, one, odd))
    assert found is not None and found.to_culprit().rank == 2


def test_shapes_differ_legitimately_where_the_op_allows_it():
    members = [view(r, group(enqueued=6, completed=5, op="all_to_all", sizes=((r + 1, 8),), inside=0.01))
               for r in range(4)]  # fmt: skip
    assert collectives.judge(pairs(*members)) is None
    members[1] = view(1, group(enqueued=6, completed=5, op="all_reduce", sizes=((512,),)))
    members[0] = view(0, group(enqueued=6, completed=5, op="all_reduce", sizes=((256,),)))
    found = collectives.judge(pairs(*members))
    assert found is not None and found.kind == "collective_mismatch"


def test_with_two_kinds_of_subgroup_the_chain_ends_at_the_one_rank():
    """2 x 2: tensor parallel {0,1}, {2,3} (pg 1, 2), data parallel {0,2}, {1,3} (pg 3, 4).
    Rank 3 stopped before its TP all-reduce; rank 2 waits for it in TP, rank 1 waits for it in DP,
    rank 0 waits for rank 1 in TP {0,1}: rank 1 is late there but waits elsewhere."""
    r0 = view(0, group("1", 8, 7, size=2), group("3", 7, 7, size=2))
    r1 = view(1, group("1", 7, 7, size=2), group("4", 8, 7, size=2))
    r2 = view(2, group("2", 8, 7, size=2), group("3", 7, 7, size=2))
    r3 = view(3, group("2", 7, 7, size=2), group("4", 7, 7, size=2), age=8.0)
    found = collectives.judge(pairs(r0, r1, r2, r3), stale_after=5.0)
    assert found is not None and found.culprit is not None and found.culprit[1].rank == 3


def test_nothing_in_flight_decides_nothing():
    members = [view(r, group(enqueued=6, completed=6)) for r in range(4)]
    assert collectives.judge(pairs(*members)) is None


def test_the_job_judge_prefers_the_record_and_waits_for_it_before_the_stacks():
    # stacks say rank 1 runs its own code; the records say rank 2 never entered #6
    r0 = view(0, group(enqueued=6, completed=5), waiting=True)
    r1 = view(1, group(enqueued=6, completed=5), waiting=False)
    r2 = view(2, group(enqueued=5, completed=5), waiting=True)
    r3 = view(3, group(enqueued=6, completed=5), waiting=True)
    reports = [report("node-0", r0), report("node-1", r1, r2), report("node-2", r3)]
    culprit = judge(reports)
    assert culprit is not None and (culprit.rank, culprit.kind, culprit.evidence) == (2, "rank_late", "collectives")
    # undecided records: no verdict from the stacks until forced, then the stacks judge
    r2.collectives_age = 0.0
    for r in (r0, r1, r3):
        r.collectives = Collectives(NOW, [group(enqueued=6, completed=5, inside=0.3)])
    assert judge(reports) is None
    forced = judge(reports, force=True)
    assert forced is not None and forced.rank == 2  # the late rank, named under force


def test_without_records_the_stack_rule_judges_and_says_so():
    reports = [report("node-0", rank(0)), report("node-1", rank(1, waiting=False)), report("node-2", rank(2))]
    culprit = judge(reports)
    assert culprit is not None and (culprit.rank, culprit.kind, culprit.evidence) == (1, "rank_not_waiting", "stacks")


def test_a_desync_the_previous_incident_had_is_flagged_as_a_repeat():
    clock = [1000.0]
    c = Coordinator(lambda job: True, 15.0, 3.0, 16, clock=lambda: clock[0])

    def mismatch() -> NodeReport:
        return report(
            "node-0",
            view(0, group(enqueued=6, completed=5, size=2)),
            view(1, group(enqueued=6, completed=5, op="barrier", sizes=(), size=2)),
            world=2,
        )

    first = c.accept(mismatch())
    assert first is not None and first.culprit is not None and first.culprit.kind == "collective_mismatch"
    assert first.culprit.collective is not None and first.culprit.collective["repeat"] is False
    for _ in range(3):  # training again: the incident closes
        clock[0] += 1.0
        c.accept(report("node-0", rank(0, state="healthy"), rank(1, state="healthy"), world=2))
        c.tick("j1")
    clock[0] += 1.0
    again = c.accept(mismatch())
    assert again is not None and again.job_incident != first.job_incident
    assert again.culprit is not None and again.culprit.collective is not None
    assert again.culprit.collective["repeat"] is True


def test_records_and_verdicts_survive_the_wire():
    r = view(2, group(enqueued=6, completed=5, inside=3.0), group("1", 3, 3, size=2))
    wire = json.loads(json.dumps(report("node-1", r).to_wire()))
    back = parse_report(wire, max_ranks=8).ranks[0]
    assert back.collectives == r.collectives and back.collectives_age == r.collectives_age
    members = [view(i, group(enqueued=6, completed=5)) for i in (0, 1, 3)] + [view(2, group(enqueued=5, completed=5))]
    found = collectives.judge(pairs(*members))
    assert found is not None
    from sidecar.jobview.report import Verdict

    verdict = Verdict("j1", "inc", 1, NOW, culprit=found.to_culprit())
    parsed = parse_verdict(json.loads(json.dumps(verdict.to_wire())))
    assert parsed is not None and parsed.culprit == verdict.culprit


GOOD = {"time": NOW, "groups": [{"pg": "0", "desc": "default_pg", "size": 2, "ranks": [0, 1], "enqueued": 6,
                                 "started": -1, "completed": 5,
                                 "pending": [{"seq": 6, "op": "all_reduce", "sizes": [[256]], "created": NOW - 1,
                                              "state": "scheduled"}]}]}  # fmt: skip


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d.update(time="now"), "collectives.time"),
        (lambda d: d["groups"][0].update(pg="\x1b[2J"), "collectives.groups[0].pg"),
        (lambda d: d["groups"][0].update(enqueued=-2), "collectives.groups[0].enqueued"),
        (lambda d: d["groups"][0]["pending"][0].update(op="x" * 65), "collectives.groups[0].pending[0].op"),
        (lambda d: d["groups"][0]["pending"][0].update(sizes=[[1] * 9]), "collectives.groups[0].pending[0].sizes"),
        (lambda d: d["groups"][0].update(ranks=list(range(65))), "collectives.groups[0].ranks"),
        (lambda d: d.update(groups=[d["groups"][0]] * 17), "collectives.groups"),
        (lambda d: d.update(groups=[d["groups"][0]] * 2), "collectives.groups"),
    ],
)
def test_a_bad_record_is_refused_naming_the_field(change, field):
    data = json.loads(json.dumps(GOOD))
    change(data)
    with pytest.raises(ProtocolError) as e:
        parse_collectives(data)
    assert str(e.value).startswith(field), str(e.value)


def test_a_good_record_parses_and_a_dump_is_bounded():
    record = parse_collectives(GOOD)
    assert record is not None and record.groups[0].waiting and record.brief().startswith("pg 0 (default_pg): in")
    assert parse_fr_dump({"entries": [{}], "pg_config": {}, "version": "2.10"}) is not None
    with pytest.raises(ProtocolError):
        parse_fr_dump({"entries": [{"x": "y" * 1024}] * 256 * 3, "version": "2.10"})
    with pytest.raises(ProtocolError):
        parse_fr_dump({"entries": [{"pad": "y" * 4096}] * 200, "version": "2.10"})


def test_records_from_reports_received_at_different_moments_are_compared_as_of_one_instant():
    """Node-1's report came 2 s before node-0's: its rank's record, read just before rank 0 entered
    #6, is 2 s older than its report says by the time rank 0's report shows rank 0 inside #6 for
    1.5 s. Compared as reported (0.3 s old against 1.5 s), rank 1 would look late; it is not."""
    clock = [1000.0]
    c = Coordinator(lambda job: True, 15.0, 3.0, 16, clock=lambda: clock[0])
    stopped = view(2, group(enqueued=5, completed=5), age=0.3)
    c.accept(report("node-1", view(1, group(enqueued=5, completed=5), age=0.3), stopped, world=3))
    clock[0] += 2.0
    verdict = c.accept(report("node-0", view(0, group(enqueued=6, completed=5, inside=1.4), age=0.1), world=3))
    c.tick("j1")
    assert verdict is None or verdict.culprit is None  # nothing established yet: rank 1's record is old
    clock[0] += 3.0  # no fresher record from node-1: both its ranks' records stopped (stale)
    c.tick("j1")
    v = c.verdict("j1")
    assert v is not None and v.culprit is not None and v.culprit.kind == "rank_late"


@pytest.mark.parametrize("text", ["all\x1b[2J", "all\x9breduce", "all\u202ereduce", "all\x00"])
def test_control_c1_and_bidi_characters_in_a_record_are_refused(text):
    data = json.loads(json.dumps(GOOD))
    data["groups"][0]["pending"][0]["op"] = text
    with pytest.raises(ProtocolError):
        parse_collectives(data)


def test_a_record_behind_a_collective_its_peer_completed_is_old_not_late():
    """Rank 0 completed #31 of their group, so rank 1 entered it too: rank 1's record (#30, read
    before) is old, whatever its age; rank 1 is not late to #31, and no verdict comes of it."""
    r0 = view(0, group("1", 31, 31, size=2))
    r1 = view(1, group("1", 30, 30, size=2), age=9.0)
    assert collectives.judge(pairs(r0, r1), stale_after=5.0) is None


def test_the_stale_bound_covers_how_often_a_waiting_rank_sends_its_record():
    # a waiting rank's hooks send the record alone every second (or every flush interval, if longer)
    assert collectives.stale_after(0.5) == 3.0 and collectives.stale_after(2.0) == 5.0
    assert collectives.stale_after(5.0) == 11.0


def test_forced_every_member_fresh_inside_a_while_is_a_stuck_collective_not_a_guess():
    members = [view(r, group(enqueued=6, completed=5, inside=1.5)) for r in range(4)]
    assert collectives.judge(pairs(*members), stale_after=5.0) is None
    forced = collectives.judge(pairs(*members), stale_after=5.0, force=True)
    assert forced is not None and forced.kind == "collective_stuck"


def test_a_cut_link_that_left_some_members_past_the_collective_is_still_a_stuck_collective():
    """Measured (tests/jobview/test_link_cut.py, once in a CI run): a training link cut in the middle
    of all-reduce #108; ranks 0 and 3 got every chunk they needed, completed #108 and wait in
    #109; ranks 1 and 2 wait in #108 for chunks that never come. Nobody is late to anything: every
    member entered the oldest collective not everyone completed, and waits. The judge named
    nobody, and the forced fallback blamed rank 1 by 'oldest progress'."""
    ahead = [view(r, group(enqueued=109, completed=108, inside=12.0)) for r in (0, 3)]
    behind = [view(r, group(enqueued=108, completed=107, inside=12.3)) for r in (1, 2)]
    nodes = {0: "node-0", 1: "node-1", 2: "node-1", 3: "node-2"}
    for force in (False, True):
        found = collectives.judge(pairs(*ahead, *behind, nodes=nodes), stale_after=5.0, force=force)
        assert found is not None and found.kind == "collective_stuck", found
        culprit = found.to_culprit()
        assert culprit.rank is None and culprit.collective is not None
        assert (culprit.collective["seq"], culprit.collective["late"], culprit.collective["waiting"]) == (108, [], 4)
        assert culprit.collective["nodes"] == ["node-0", "node-1", "node-2"]
        assert "ranks 0, 3 completed it" in culprit.reason, culprit.reason
    # moments inside prove nothing yet
    fresh = [view(r, group(enqueued=108, completed=107, inside=0.3)) for r in (1, 2)]
    assert collectives.judge(pairs(*ahead, *fresh, nodes=nodes), stale_after=5.0) is None
    # one of those behind is not inside #108 at all: it never entered, it is late
    outside = view(2, group(enqueued=107, completed=107), age=6.0)
    found = collectives.judge(pairs(*ahead, behind[0], outside, nodes=nodes), stale_after=5.0)
    assert found is not None and found.kind == "rank_late" and found.culprit is not None
    assert found.culprit[1].rank == 2
