"""A crash loop (issue 42, item 5): the job's coordinator counts the verdicts its restarts meet
again at the same step (jobview/jobs.signature) and says, past job_view.crash_loop_repeats, that
the job is ended; each node marks it (jobview/crashloop.py) and tells its ranks of the job to exit
93 in the answer to their next push; a fresh launch lifts the mark. The wire carries both fields,
and a verdict without them (an older coordinator) reads as no loop."""

from __future__ import annotations

import json
import os
import types

import pytest

from sidecar.jobview.coordinator import Coordinator
from sidecar.jobview.crashloop import CrashLoops
from sidecar.jobview.report import Culprit, Verdict, parse_verdict
from tests.jobview.helpers import rank, report
from tests.jobview.test_coordinator import Clock
from trainer_hooks import ending
from trainer_hooks.wire import CRASH_LOOP_EXIT, END


def coordinator(clock: Clock, **kw) -> Coordinator:
    args = {"lost_after": 15.0, "verdict_wait": 3.0, "max_nodes": 16, "probe": None, "clock": clock}
    return Coordinator(lambda job: job == "j1", **(args | kw))


def hang(c: Coordinator, clock: Clock, step: int, culprit: int = 1, its_step: int | None = None) -> Verdict:
    """Rank `culprit` not waiting (its last push at `its_step`) while its peer waits at `step`: one
    job incident, its verdict."""
    peer = 1 - culprit
    c.accept(report(f"node-{peer}", rank(peer, step=step)))
    v = c.accept(report(f"node-{culprit}", rank(culprit, waiting=False, step=step if its_step is None else its_step)))
    assert v is not None and v.culprit is not None and v.culprit.rank == culprit, v
    return v


def train_again(c: Coordinator, clock: Clock) -> None:
    for _ in range(2):
        for r in (0, 1):
            c.accept(report(f"node-{r}", rank(r, state="healthy")))
        clock.now += 2.0
    assert c.verdict("j1").closed


def test_the_same_rank_hung_at_the_same_step_is_a_crash_loop_at_its_second_repeat():
    clock = Clock()
    c = coordinator(clock)  # crash_loop_repeats 2: the third time
    seen = []
    for _ in range(3):
        v = hang(c, clock, step=40)
        seen.append((v.repeats, v.crash_loop))
        train_again(c, clock)
    assert seen == [(0, False), (1, False), (2, True)]


def test_one_repeat_is_enough_when_so_configured_and_never_when_zero():
    for repeats, expected in ((1, [False, True]), (0, [False, False])):
        clock = Clock()
        c = coordinator(clock, crash_loop_repeats=repeats)
        loops = []
        for _ in range(2):
            loops.append(hang(c, clock, step=40).crash_loop)
            train_again(c, clock)
        assert loops == expected, repeats


def test_a_stopped_rank_whose_last_push_lags_differently_each_time_still_repeats():
    """A stopped rank cannot push its last steps (3 nodes, SIGSTOP at step 150: its node last heard
    143 one time, 150 the next): the job's step is where the ranks that wait stand."""
    clock = Clock()
    c = coordinator(clock, crash_loop_repeats=1)
    hang(c, clock, step=40, its_step=33)
    train_again(c, clock)
    v = hang(c, clock, step=40, its_step=38)
    assert (v.repeats, v.crash_loop) == (1, True)


@pytest.mark.parametrize("change", ["another step", "another rank"])
def test_a_different_step_or_rank_is_not_a_repeat(change):
    clock = Clock()
    c = coordinator(clock, crash_loop_repeats=1)
    hang(c, clock, step=40)
    train_again(c, clock)
    v = hang(c, clock, step=41) if change == "another step" else hang(c, clock, step=40, culprit=0)
    assert (v.repeats, v.crash_loop) == (0, False)


def test_a_lost_node_again_and_again_is_not_a_crash_loop():
    """Not the program's (hang_kinds: loops is for the kinds that name a rank)."""
    clock = Clock()
    c = coordinator(clock, crash_loop_repeats=1)
    for _ in range(2):
        for node, r in (("node-0", 0), ("node-1", 1), ("node-2", 2)):
            c.accept(report(node, rank(r, state="healthy")))
        clock.now += 16.0  # node-2 goes silent
        c.accept(report("node-0", rank(0)))
        v = c.accept(report("node-1", rank(1)))
        assert v is not None and v.culprit is not None and v.culprit.kind == "node_lost"
        assert (v.repeats, v.crash_loop) == (0, False)
        for _ in range(2):
            for node, r in (("node-0", 0), ("node-1", 1), ("node-2", 2)):
                c.accept(report(node, rank(r, state="healthy")))
            clock.now += 2.0


def test_the_wire_carries_the_loop_and_an_older_coordinators_verdict_reads_as_none():
    v = Verdict(
        "j1",
        "inc-1",
        3,
        10.0,
        Culprit(1, "node-1", 40, reason="no CPU, its stack still", kind="rank_deadlocked"),
        repeats=2,
        crash_loop=True,
    )
    back = parse_verdict(json.loads(json.dumps(v.to_wire())))
    assert back is not None and (back.repeats, back.crash_loop) == (2, True)
    older = v.to_wire()
    del older["repeats"], older["crash_loop"]
    back = parse_verdict(older)
    assert back is not None and (back.repeats, back.crash_loop) == (0, False)


def rank_of(job: str, restart: int, observe_only: bool = False):
    return types.SimpleNamespace(job_id=job, rank=0, restart_count=restart, observe_only=observe_only)


def loop_verdict(job: str = "j1", incident: str = "inc-2") -> Verdict:
    return Verdict(job, incident, 5, 10.0, Culprit(1, "node-1", 40, kind="rank_crashed"), repeats=2, crash_loop=True)


def test_a_node_tells_the_ranks_of_an_ended_job_to_exit_93_until_a_fresh_launch():
    loops = CrashLoops()
    loops.see(Verdict("j1", "inc-1", 1, 10.0, Culprit(1, "node-1", 40, kind="rank_crashed"), repeats=1))
    assert loops.end_for(rank_of("j1", 1), observe_only=False) is None  # a repeat, not yet a loop
    loops.see(loop_verdict())
    end = loops.end_for(rank_of("j1", 2), observe_only=False)
    assert end is not None and end["exit_code"] == CRASH_LOOP_EXIT and end["job_incident"] == "inc-2"
    assert "rank_crashed (rank 1 on node-1, its last step 40)" in end["reason"] and "3 times" in end["reason"]
    assert loops.end_for(rank_of("other-job", 2), observe_only=False) is None
    assert loops.end_for(rank_of("j1", 2, observe_only=True), observe_only=False) is None
    assert loops.end_for(rank_of("j1", 2), observe_only=True) is None  # the node's observe-only mode
    [family] = loops.families()
    assert [(s.labels, s.value) for s in family.samples] == [({"job_id": "j1"}, 1)]
    loops.registered(rank_of("j1", 3), AGENT)  # the ended attempt's restart: still ended
    assert loops.end_for(rank_of("j1", 3), observe_only=False) is not None
    loops.registered(rank_of("j1", 0), (4242, 9.5))  # a fresh launch of the same job id: a new agent
    assert loops.end_for(rank_of("j1", 0), observe_only=False) is None and loops.status() == {}


AGENT = (4141, 7.25)  # torchrun's agent of the ended launch: (pid, start time)


@pytest.mark.parametrize("launcher", [AGENT, None], ids=["same agent", "parent unknown"])
def test_a_restart_for_a_membership_change_keeps_the_mark_and_only_a_new_launcher_lifts_it(launcher):
    """bench_crash_loop, 1 run of 4: node-2's agent restarted its group each time for a membership
    change (the other agents re-joining), which torch does not count: its rank came back with
    restart 0 after the mark, was taken for a fresh launch, lifted the mark, failed in its
    rendezvous with exit 1, and its agent exited 1 instead of 93."""
    loops = CrashLoops()
    loops.registered(rank_of("j1", 0), AGENT)  # the job's first launch, before the loop
    loops.see(loop_verdict())
    loops.registered(rank_of("j1", 0), launcher)
    kept = loops.end_for(rank_of("j1", 0), observe_only=False) is not None
    assert kept == (launcher is not None)  # an unknown parent is taken for a fresh launch


def test_the_hooks_exit_93_on_the_end_and_take_no_other_status(capsys):
    codes: list[int] = []
    ident = types.SimpleNamespace(job_id="j1", rank=3)
    ending.obey({"ok": True}, ident, codes.append)
    ending.obey({END: {"exit_code": 0, "reason": "x"}}, ident, codes.append)  # only 93 is ever taken
    ending.obey({END: "93"}, ident, codes.append)
    assert codes == []
    ending.obey({END: {"exit_code": CRASH_LOOP_EXIT, "reason": "a crash loop: x", "job_incident": "inc-2"}},
                ident, codes.append)  # fmt: skip
    assert codes == [CRASH_LOOP_EXIT]
    err = capsys.readouterr().err
    assert "job j1 rank 3: the sidecar ended the job: a crash loop: x (job incident inc-2); exiting 93" in err


def test_a_ranks_launcher_is_its_parent_process_named_by_pid_and_start_time(spawn):
    from sidecar.host import procs

    child = spawn()
    born = procs.start_time(child.pid)
    assert procs.parent(child.pid, born) == (os.getpid(), procs.start_time(os.getpid()))
    assert procs.parent(child.pid, (born or 0) + 1.0) is None  # not the process that start time names
