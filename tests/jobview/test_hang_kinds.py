"""The one table of hang kinds (sidecar/hang_kinds.py) and the wait-for judgement over synthetic
reports (sidecar/jobview/judge.py): each kind from the waits and the ranks' conditions that make
it, the healthy pause that is none, and what the table drives (wire, docs, runbook, alerts)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from sidecar import hang_kinds
from sidecar.jobview import collectives
from sidecar.jobview.judge import judge, judge_summaries, summarize
from sidecar.jobview.report import Culprit, Verdict, parse_report, parse_verdict
from sidecar.watchdog.coordination import before_restart, local_culprit
from tests.jobview.helpers import rank, report
from tests.jobview.test_collectives import group, pairs, view

ROOT = Path(__file__).resolve().parents[2]


def doing(r: int, activity: str | None, waiting: bool | None = False, state: str = "stalled", **kw):
    v = rank(r, state=state, waiting=waiting, **kw)
    v.activity = activity
    return v


def three(culprit_activity: str | None, others_wait: bool = True):
    """Ranks 0 and 2 wait in a collective (or not); rank 1 on node-1 does `culprit_activity`."""
    return [
        report("node-0", doing(0, "idle" if others_wait else "cpu", waiting=others_wait), world=3),
        report("node-1", doing(1, culprit_activity), world=3),
        report("node-2", doing(2, "idle" if others_wait else "cpu", waiting=others_wait), world=3),
    ]


@pytest.mark.parametrize(
    "activity, kind",
    [("stopped", "rank_stopped"), ("io", "io_stuck"), ("dataloader", "dataloader_stuck"), ("cpu", "rank_spinning"),
     ("idle", "rank_deadlocked"), (None, "rank_not_waiting")],
)  # fmt: skip
def test_the_end_of_the_wait_chain_names_the_kind_from_what_its_process_does(activity, kind):
    c = judge(three(activity))
    assert c is not None and (c.rank, c.node, c.kind) == (1, "node-1", kind), c
    assert hang_kinds.of(c.kind).acts == "culprit_node"


def test_no_one_waiting_and_every_rank_working_is_a_pause_that_nothing_acts_on():
    c = judge(three("cpu", others_wait=False))
    assert c is not None and c.kind == "job_paused" and c.rank is None, c
    verdict = Verdict("j1", "inc", 1, 0.0, culprit=c)
    assert not any(local_culprit(verdict, f"node-{i}", {i}) for i in range(3))  # no node acts


def test_a_pause_is_no_pause_once_one_rank_waits_or_one_stops_working():
    assert judge(three("idle", others_wait=False)).kind == "rank_deadlocked"  # type: ignore[union-attr]
    reports = three("cpu", others_wait=False)
    reports[0].ranks[0].waiting = True  # rank 0 entered a collective: it waits on rank 1 (and 2)
    c = judge(reports)
    assert c is not None and c.kind == "rank_spinning" and c.rank in (1, 2), c


def test_records_that_prove_no_one_waits_keep_a_pause_while_a_rank_cannot_be_read():
    """make test (3 nodes, every rank evaluating): one rank's node could not tell what its process
    did (its stack being read, state t: activity None) and the forced judgement named rank 2
    `rank_not_waiting`; its node killed it. Every rank's fresh record held nothing in flight: no
    one waited, so it is a pause. Without records the unread rank is not taken for working."""

    def recorded(activity_1: str | None, completed: int = 5):
        views = [view(r, group(enqueued=5, completed=completed, size=3), state="stalled") for r in range(3)]
        for v, did in zip(views, ("cpu", activity_1, "cpu"), strict=True):
            v.activity, v.waiting = did, False
        return [report(f"node-{v.rank}", v, world=3) for v in views]

    for force in (False, True):
        c = judge(recorded(None), force=force)
        assert c is not None and c.kind == "job_paused" and c.rank is None, c
    c = judge(recorded("idle"), force=True)  # one rank does not work: not a pause
    assert c is not None and c.kind != "job_paused", c
    c = judge(three(None, others_wait=False), force=True)  # no records: nothing proves no one waits
    assert c is not None and c.kind != "job_paused", c


def test_a_record_in_flight_is_a_wait_though_the_stack_is_in_the_users_code():
    """A CUDA job's waiting rank sits at its own sync point: its record, not its stack, shows the wait."""
    reports = three("cpu", others_wait=False)
    busy_rank = reports[0].ranks[0]
    busy_rank.collectives = view(0, group(enqueued=6, completed=5)).collectives
    assert judge(reports) is None  # the records decide it once they are fresh
    c = judge(reports, force=True)
    assert c is not None and c.kind != "job_paused", c


@pytest.mark.parametrize(
    "activity, kind",
    [("stopped", "rank_stopped"), ("idle", "rank_deadlocked"), ("io", "io_stuck"), ("cpu", "rank_late"),
     (None, "rank_late")],
)  # fmt: skip
def test_a_late_rank_is_named_from_the_record_and_its_kind_from_its_process(activity, kind):
    """Its peers wait in a collective it never entered (the record); its node reads why: stopped, no
    CPU (two locks, a queue: deadlocked), in D. Working, it stays late (slow and spinning look alike
    by CPU)."""
    members = [view(r, group(enqueued=6, completed=5), waiting=False) for r in (0, 2, 3)]
    late = view(1, group(enqueued=5, completed=5), age=30.0, waiting=False)
    late.activity = activity
    found = collectives.judge(pairs(*members, late))
    assert found is not None and found.kind == "rank_late"
    reports = [report(f"node-{v.rank}", v) for v in (*members, late)]
    c = judge_summaries([summarize(r) for r in reports])
    assert c is not None and (c.rank, c.kind, c.evidence) == (1, kind, "collectives"), c
    assert (f"its process: {activity}" in c.reason) == (kind != "rank_late")


def test_a_desync_names_the_odd_rank_out_and_its_node():
    members = [view(r, group(enqueued=6, completed=5)) for r in (0, 1, 3)]
    members.append(view(2, group(enqueued=6, completed=5, op="barrier", sizes=())))
    found = collectives.judge(pairs(*members, nodes={0: "node-0", 1: "node-0", 2: "node-2", 3: "node-1"}))
    assert found is not None and found.kind == "collective_mismatch"
    c = found.to_culprit()
    assert (c.rank, c.node) == (2, "node-2") and c.collective is not None and c.collective["odd"] == {"2": "node-2"}
    assert "the odd one out: rank 2 on node-2" in c.reason
    assert hang_kinds.of(c.kind).acts == "every_node"  # a desync restarts every rank


def test_a_desync_split_evenly_names_no_rank():
    members = [view(r, group(enqueued=6, completed=5)) for r in (0, 1)]
    members += [view(r, group(enqueued=6, completed=5, op="barrier", sizes=())) for r in (2, 3)]
    found = collectives.judge(pairs(*members))
    assert found is not None and found.to_culprit().rank is None


def test_the_lost_node_is_named_before_any_survivor_exit():
    reports = [
        report("node-0", rank(0, state="gone", exited_at=100.0)),
        report("node-1", rank(1, state="gone", exited_at=101.0)),
    ]
    assert judge(reports, silent=["node-2"]) is None  # the silent node may be the lost one: wait
    c = judge(reports, lost=["node-2"])
    assert c is not None and (c.kind, c.node, c.rank) == ("node_lost", "node-2", None), c


def test_exits_are_ordered_on_one_clock():
    """node-1's clock runs 2 s ahead: its rank's exit at 101.0 on its clock was at 99.0 on the coordinator's."""
    reports = [
        report("node-0", rank(0, state="gone", exited_at=100.0), world=2),
        report("node-1", rank(1, state="gone", exited_at=101.0), world=2),
    ]
    summaries = [summarize(r) for r in reports]
    assert judge_summaries(summaries).rank == 0  # type: ignore[union-attr]
    c = judge_summaries(summaries, offsets={"node-1": 2.0})
    assert c is not None and (c.rank, c.kind) == (1, "rank_crashed"), c


@pytest.mark.parametrize("claimed, taken", [(-2.0, "own"), (-40.0, "heard"), (None, "heard"), (+5.0, "heard")])
def test_an_exit_is_dated_by_the_ranks_own_report_within_its_bounds(claimed, taken):
    """A crashing rank's deregistration may reach its loaded sidecar after its peers' consequences
    reached theirs (CI, make test: rank 2's consequence named first on both incidents of a crash
    loop): the exit is dated by the time its hooks stamped on the exception, when that is at most
    30 s before its sidecar heard of it (and not in the future)."""
    import time as clock

    from sidecar.ranks.model import Rank
    from sidecar.ranks.protocol import parse_deregistration

    now = clock.time()
    wire = {
        "job_id": "j",
        "rank": 1,
        "pid": 7,
        "reason": "exception",
        "exit": {"type": "RuntimeError", "message": "boom", "time": None if claimed is None else now + claimed},
    }
    dereg = parse_deregistration(wire)
    assert dereg.exit is not None and (dereg.exit.time is None) == (claimed is None)
    r = Rank(job_id="j", rank=1, local_rank=1, world_size=2, local_world_size=1, pid=7, pid_start_time=None)
    r.gone_at, r.exit_time = clock.monotonic(), dereg.exit.time
    got = r.exited_wall()
    if taken == "own":
        assert got == pytest.approx(now + claimed, abs=1e-6)  # type: ignore[operator]
    else:
        assert got == pytest.approx(clock.time(), abs=0.5)


def test_an_exit_time_that_is_not_unix_seconds_is_refused_naming_it():
    from sidecar.ranks.protocol import ProtocolError, parse_deregistration

    for bad in ("soon", -1, True, 1e13):
        with pytest.raises(ProtocolError, match="exit.time"):
            parse_deregistration({"job_id": "j", "rank": 1, "pid": 7, "exit": {"type": "E", "time": bad}})


# ---------------------------------------------------------------- the wire


def verdict_wire(kind: str) -> dict:
    return Verdict("j1", "inc", 3, 1.0, culprit=Culprit(1, "node-1", 29, reason="why", kind=kind)).to_wire()


def test_a_newer_nodes_kind_is_carried_not_refused():
    wire = verdict_wire("rank_haunted")
    v = parse_verdict(wire)
    assert v is not None and v.culprit is not None and v.culprit.kind == "rank_haunted"
    assert hang_kinds.of("rank_haunted") is hang_kinds.OTHER and hang_kinds.metric_label("rank_haunted") == "other"
    assert local_culprit(v, "node-1", {1}) is True and local_culprit(v, "node-0", {0}) is False


def test_a_rank_condition_survives_the_wire_and_an_unknown_one_is_dropped():
    r = doing(1, "dataloader")
    wire = report("node-1", r).to_wire()
    assert parse_report(wire, 8).ranks[0].activity == "dataloader"
    wire["ranks"][0]["activity"] = "levitating"
    assert parse_report(wire, 8).ranks[0].activity is None


def test_a_malformed_kind_is_refused_naming_the_field():
    with pytest.raises(Exception, match="culprit.kind"):
        parse_verdict(verdict_wire("Bad Kind!"))


def test_one_culprit_round_trips_with_its_kind():
    c = Culprit(2, "node-2", 29, reason="a desync", kind="collective_mismatch", evidence="collectives",
                collective={"pg": "0", "seq": 3, "odd": {"2": "node-2"}})  # fmt: skip
    v = parse_verdict(Verdict("j1", "inc", 1, 0.0, culprit=c).to_wire())
    assert v is not None and v.culprit is not None and v.culprit.collective["odd"] == {"2": "node-2"}  # type: ignore[index]


# ---------------------------------------------------------------- what the table drives


def test_every_kind_has_a_runbook_section_and_an_alert_that_exists_or_a_reason_for_none():
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    sections = set(re.findall(r"^### (\S+)", runbook, re.M))
    alerts = {
        rule["alert"]
        for path in (ROOT / "alerts").glob("*.rules.yml")
        for g in yaml.safe_load(path.read_text())["groups"]
        for rule in g["rules"]
        if "alert" in rule
    }
    for kind in hang_kinds.KINDS.values():
        assert kind.name in sections, f"docs/runbook.md has no '### {kind.name}'"
        assert (kind.alert in alerts) if kind.alert else kind.no_alert, kind


def test_the_architecture_doc_carries_the_generated_table():
    doc = (ROOT / "docs" / "architecture" / "hang-kinds.md").read_text()
    assert hang_kinds.table() in doc, "docs/architecture/hang-kinds.md: paste `python -m sidecar.hang_kinds`"


def test_the_metric_help_names_every_kind():
    assert all(name in hang_kinds.metric_help() for name in hang_kinds.KINDS)


def test_a_kind_without_an_alert_or_reason_is_refused():
    with pytest.raises(ValueError, match="an alert, or the reason"):
        hang_kinds.register(hang_kinds.HangKind("rank_mute", "x", "y", "rank", "culprit_node", None))


def test_no_waiting_rank_is_named_while_a_node_of_the_job_has_only_sent_heartbeats():
    """node-1's rank was healthy in its own eyes (an inferred data_load phase) and sent no ranks: the
    ranks seen all wait, on it. Before, the forced judgement named the oldest of the waiting ranks."""
    reports = [report("node-0", rank(0, state="stalled", age=9.0), world=3), report("node-1", healthy=1, world=3),
               report("node-2", rank(2, state="stalled", age=8.0), world=3)]  # fmt: skip
    assert judge(reports, force=True) is None
    assert judge([reports[0], reports[2]], force=True) is None  # node-1 not reporting at all: its rank unheard of
    whole = [report("node-0", rank(0, state="stalled", age=9.0), world=2),
             report("node-2", rank(2, state="stalled", age=8.0), world=2)]  # fmt: skip
    assert judge(whole, force=True).kind == "oldest_progress"  # type: ignore[union-attr]  # every rank seen waits


def test_no_first_exit_is_named_while_ranks_of_the_job_are_unheard_of():
    """Only node-0 has reported (the others had not learned the coordinator yet): its rank's exit may
    be a consequence of one the coordinator has not heard of. Before, it was named the cause."""
    alone = [report("node-0", rank(0, state="gone", exited_at=100.0), world=3)]
    assert judge(alone) is None
    assert judge(alone, force=True).kind == "rank_crashed"  # type: ignore[union-attr]


def test_the_tail_of_a_pause_stays_a_pause_until_its_last_rank_stops_working():
    """Every rank evaluates (a pause); rank 0 is done first and waits in the next all-reduce while
    ranks 1 and 2 still work: a chain of waits that ends in working ranks is no hang, the verdict
    stays `job_paused` (before: `rank_spinning` on a rank its node held busy, recorded as a hang kind
    on the waiting node: bench_hang_kinds' healthy evaluation, 9 of 10). Once they stop working with
    rank 0 still waiting, it is a hang, named."""
    from sidecar.jobview.coordinator import Coordinator

    now = [1000.0]
    c = Coordinator(lambda job: job == "j1", lost_after=15.0, verdict_wait=3.0, max_nodes=16, clock=lambda: now[0])
    for r in three("cpu", others_wait=False):
        v = c.accept(r)
    assert v is not None and v.culprit is not None and v.culprit.kind == "job_paused" and not v.culprit.busy, v
    tail = three("cpu", others_wait=False)
    tail[0].ranks[0].waiting, tail[0].ranks[0].activity = True, "idle"  # rank 0 done: it waits on 1 and 2
    for r in tail:
        now[0] += 0.5
        v = c.accept(r)
    # a tail: someone waits on working ranks (`busy`: every node holds it at most watchdog.ceiling_seconds)
    assert v is not None and v.culprit is not None and v.culprit.kind == "job_paused" and v.culprit.busy, v
    hung = three("idle")  # 1 stops working, its peers wait: the end of the chain no longer works
    for r in hung:
        now[0] += 0.5
        v = c.accept(r)
    assert v is not None and v.culprit is not None and v.culprit.kind == "rank_deadlocked", v
    assert (v.culprit.rank, v.culprit.node) == (1, "node-1")


def test_the_tail_of_a_pause_stays_a_pause_while_its_working_rank_cannot_be_read():
    """The pause's tail seen by the records: ranks 0 and 2 are done and wait in the next all-reduce,
    rank 1 never entered it (the record says `rank_late`) and its node cannot tell for a moment what
    its process does (its stack is being read: state t, `activity` None). Nothing says it stopped
    working: the verdict stays `job_paused` (before: `rank_late` replaced it, bench_hang_kinds'
    healthy evaluation, 2 of 7 runs). Once its node reads it idle, it is named."""
    from sidecar.jobview.coordinator import Coordinator

    now = [1000.0]
    c = Coordinator(lambda job: job == "j1", lost_after=15.0, verdict_wait=3.0, max_nodes=16, clock=lambda: now[0])
    for r in three("cpu", others_wait=False):
        v = c.accept(r)
    assert v is not None and v.culprit is not None and v.culprit.kind == "job_paused", v

    def tail(activity: str | None) -> list:
        views = [view(0, group(enqueued=6, completed=5, size=3)), view(1, group(enqueued=5, completed=5, size=3)),
                 view(2, group(enqueued=6, completed=5, size=3))]  # fmt: skip
        for v, did in zip(views, ("idle", activity, "idle"), strict=True):
            v.activity, v.waiting = did, v.rank != 1
        return [report(f"node-{v.rank}", v) for v in views]

    for r in tail(None):
        now[0] += 0.5
        v = c.accept(r)
    assert v is not None and v.culprit is not None and v.culprit.kind == "job_paused" and v.culprit.busy, v
    for r in tail("idle"):  # rank 1 stops working, its peers wait on it: a hang, named
        now[0] += 0.5
        v = c.accept(r)
    assert v is not None and v.culprit is not None and (v.culprit.rank, v.culprit.node) == (1, "node-1"), v
    assert v.culprit.kind == "rank_deadlocked", v


def test_a_pause_is_not_replaced_by_a_guess_as_it_ends():
    """As a pause ends the ranks step again a moment apart; a judgement in between, with no rank
    waiting on a known one, falls back to the oldest progress, a guess (bench_hang_kinds' healthy
    evaluation: one node recorded `oldest_progress` on rank 1): the pause's verdict stays."""
    from sidecar.jobview.coordinator import Coordinator

    now = [1000.0]
    c = Coordinator(lambda job: job == "j1", lost_after=15.0, verdict_wait=3.0, max_nodes=16, clock=lambda: now[0])
    for r in three("cpu", others_wait=False):
        v = c.accept(r)
    assert v is not None and v.culprit is not None and v.culprit.kind == "job_paused", v
    ending = [report("node-0", doing(0, None, waiting=None, step=30)), report("node-1", doing(1, None, waiting=None)),
              report("node-2", doing(2, None, waiting=None, step=30))]  # fmt: skip
    for r in ending:
        now[0] += 4.0  # past the verdict wait: the judgement may guess
        v = c.accept(r)
    assert v is not None and v.culprit is not None and v.culprit.kind == "job_paused", v


def test_the_first_exit_stays_first_when_its_node_no_longer_lists_it_but_an_earlier_one_replaces_it():
    """A node's report drops its exited rank once the restarted one registers: the next judgement
    must not rename a later exit the first (bench_crash_loop: a crash loop found one crash late). An
    exit heard later that happened earlier still wins."""
    from sidecar.jobview.coordinator import Coordinator

    now = [1000.0]
    c = Coordinator(lambda job: job == "j1", lost_after=15.0, verdict_wait=3.0, max_nodes=16, clock=lambda: now[0])
    c.accept(report("node-2", rank(2), world=3))  # it waits
    c.accept(report("node-0", rank(0, state="gone", exited_at=100.1), world=3))
    v = c.accept(report("node-1", rank(1, state="gone", exited_at=100.0), world=3))
    assert v is not None and v.culprit is not None and (v.culprit.rank, v.culprit.kind) == (1, "rank_crashed"), v
    now[0] += 1.0
    c.accept(report("node-1", rank(1, state="starting", step=None), world=3))  # the restarted rank 1
    v = c.accept(report("node-2", rank(2, state="gone", exited_at=100.2), world=3))
    assert v is not None and v.culprit is not None and v.culprit.rank == 1, v
    now[0] += 1.0
    v = c.accept(report("node-2", rank(2, state="gone", exited_at=99.0), world=3))  # it was first after all
    assert v is not None and v.culprit is not None and (v.culprit.rank, v.culprit.node) == (2, "node-2"), v


def test_a_nodes_first_exit_is_kept_for_the_incident_when_it_was_dropped_before_the_judgement():
    """The crashed rank's node reported its exit once, then its restart (make test-under-load: the
    restart registered 0.3 s after the crash); the coordinator could not judge yet (node-2 not heard
    of), and the peers' later exits were all it had left when it did: a consequence was named the
    crashed one (issue 48). The first exit a node reported stays its own for the incident."""
    from sidecar.jobview.coordinator import Coordinator

    def gone(r: int, at: float, kind: str):
        v = rank(r, state="gone", exited_at=at)
        v.exit_kind = kind
        return v

    now = [1000.0]
    c = Coordinator(lambda job: job == "j1", lost_after=15.0, verdict_wait=3.0, max_nodes=16, clock=lambda: now[0])
    v = c.accept(report("node-1", gone(1, 100.0, "other"), world=3))
    assert v is not None and v.culprit is None, v  # two ranks of the world not heard of: one may have exited first
    now[0] += 0.2
    c.accept(report("node-1", rank(1, state="starting", step=None), world=3))  # its restart, not stepped
    c.accept(report("node-0", gone(0, 100.1, "communication"), world=3))
    v = c.accept(report("node-2", gone(2, 100.1, "communication"), world=3))
    assert v is not None and v.culprit is not None and (v.culprit.rank, v.culprit.node) == (1, "node-1"), v
    assert v.culprit.kind == "rank_crashed", v


def test_a_peer_failure_is_ordered_after_the_exit_that_caused_it():
    """A rank that died of a communication error usually died of another's exit; on a loaded machine
    (make test, two runs) it was heard first, on its node's clock or through the clock offsets, and
    named the crashed one. A peer failure counts 5 s later among the job's exits; alone, it is first."""
    from sidecar.jobview.report import parse_report

    def exits(comm_at: float, other_at: float):
        comm = rank(0, state="gone", exited_at=comm_at)
        comm.exit_kind = "communication"
        other = rank(1, state="gone", exited_at=other_at)
        other.exit_kind = "other"
        return [report("node-0", comm, world=2), report("node-1", other, world=2)]

    c = judge_summaries([summarize(r) for r in exits(100.0, 100.3)])
    assert c is not None and (c.rank, c.kind) == (1, "rank_crashed"), c
    c = judge_summaries([summarize(r) for r in exits(100.0, 106.0)])  # long after: the peer failure was first
    assert c is not None and c.rank == 0, c
    wire = exits(100.0, 100.3)[0].to_wire()
    assert parse_report(wire, 16).ranks[0].exit_kind == "communication"
    wire["ranks"][0]["exit_kind"] = "a_newer_kind"
    assert parse_report(wire, 16).ranks[0].exit_kind is None  # dropped, never refused


def test_a_verdict_decided_before_a_restart_does_not_act_on_the_new_processes():
    """bench_race --field, 3 nodes, floor 1 s: the job incident of a stopped rank 1 was still open
    when the restarted rank 1 (a new process) paused 1 s in its first steps; its node took the open
    verdict (rank 1 stopped, decided before the new process registered) and killed the new process,
    three times, until torchrun's restarts ran out."""
    c = Culprit(1, "node-1", step=74, kind="rank_stopped", evidence="collectives")
    verdict = Verdict("j1", "inc", 3, 100.0, culprit=c, decided=101.0)
    assert local_culprit(verdict, "node-1", {1}, {1: 100.5}) is True  # its process of then: acts
    assert local_culprit(verdict, "node-1", {1}, {1: 105.0}) is None  # a new process: not about it
    assert local_culprit(verdict, "node-1", {1}) is True  # no registrations known: as before
    # a kind every node acts on: stale once every local process is newer than the decision
    stuck = Verdict("j1", "inc", 3, 100.0, culprit=Culprit(None, "node-1", kind="collective_stuck"), decided=101.0)
    assert local_culprit(stuck, "node-0", {0, 2}, {0: 105.0, 2: 100.0}) is True
    assert local_culprit(stuck, "node-0", {0, 2}, {0: 105.0, 2: 106.0}) is None
    assert before_restart(stuck, {0: 105.0}) and not before_restart(None, {0: 105.0})


def test_one_working_rank_while_its_peers_still_step_is_no_pause():
    """bench_recovery --faults mixed, 3 nodes: rank 0 spun in a Python loop; the first report had it
    troubled and using CPU while ranks 1 and 2 were still healthy (not yet waiting long enough), and
    the coordinator called the job paused; the verdict stayed job_paused once they waited on it (a
    pause's tail), and nothing killed the spinning rank. A job pauses on every rank."""
    spinning = doing(0, "cpu", state="suspect")
    lone = [report("node-0", spinning, world=3), report("node-1", world=3, healthy=1),
            report("node-2", world=3, healthy=1)]  # fmt: skip
    c = judge(lone)
    assert c is None or c.kind != "job_paused", c
    every = [report(f"node-{i}", doing(i, "cpu", state="suspect"), world=3) for i in range(3)]
    c = judge(every)
    assert c is not None and c.kind == "job_paused", c  # every rank working: still a pause
