"""`bench_recovery --long --faults mixed`: each injected hang must be killed on its node and the job
trained again; a kill during the healthy pause (or claimed by no hang) is a false kill; the pause is
the job's own time in the goodput. The end-to-end run: 3 simulated nodes, a few faults."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import mixed_faults, recovery_mixed
from bench.bench_recovery import main
from bench.mixed_faults import Fault, MixedRun
from harness.job import LogEvent

T0 = 1_800_000_000.0
STEP = 0.1


def steps_between(first: int, last: int, start: float) -> list[LogEvent]:
    return [LogEvent("step", start + (s - first) * STEP, {"step": s, "from_rank": 0}) for s in range(first, last + 1)]


def kill(node: str, at: float, rank: int, kind: str) -> dict:
    return {
        "node": node,
        "kind": "stall",
        "time": at,
        "hang_kind": kind,
        "blamed_rank": rank,
        "outcome": "killed",
        "timeline": [{"event": "sigterm", "time": at + 0.1}, {"event": "exit_observed", "time": at + 0.2}],
    }


def mixed_run(tmp_path: Path, incidents: list[dict]) -> MixedRun:
    """Steps 1-1000 at 0.1 s; a deadlock of rank 1 at step 300 (t+30 s, 6 s lost, steps 300-1000 again
    from t+36 s); a pause of every rank at step 500, 10 s long, not a loss."""
    deadlock = Fault(0, "deadlock", 1, "node-1", T0 + 29.9, at_step=300, fired=T0 + 29.9)
    pause = Fault(1, "pause", None, None, T0 + 55.0, at_step=500, fired=T0 + 56.0)
    events = steps_between(1, 299, T0)
    events += [LogEvent("rendezvous", T0 + 35.5, {"from_rank": 0})]
    after = steps_between(300, 499, T0 + 36.0)
    events += after + steps_between(500, 1000, after[-1].time + 10.0 + STEP)
    return MixedRun(10, 60, 5.0, 3, [deadlock, pause], events, incidents, [0, 0, 0], {}, None, tmp_path)


def test_a_hang_killed_on_its_node_is_its_own_and_the_pause_counts_as_the_jobs_time(tmp_path, capsys):
    report = recovery_mixed.analyse(mixed_run(tmp_path, [kill("node-1", T0 + 35.0, 1, "rank_deadlocked")]))

    assert report.false_kills == [] and all(not o.problems for o in report.outcomes), report.outcomes
    assert report.outcomes[0].recovered is not None and report.outcomes[0].recovered == pytest.approx(6.1, abs=0.05)
    # 999 steps of 0.1 s and the 10 s pause in 116 s of wall time: the 6 s hang is the only loss
    assert report.spent.wall == pytest.approx(116.0, abs=0.05)
    assert report.goodput == pytest.approx((99.9 + 10.0) / 116.0, abs=0.001)
    recovery_mixed.print_report(report, "warm")
    out = capsys.readouterr().out
    assert "goodput: 94.7%" in out and "count as useful time, not as loss" in out and ": PASS" in out


def test_a_kill_during_the_healthy_pause_is_a_false_kill_and_fails_the_target(tmp_path):
    incidents = [kill("node-1", T0 + 35.0, 1, "rank_deadlocked"), kill("node-2", T0 + 62.0, 2, "rank_spinning")]
    report = recovery_mixed.analyse(mixed_run(tmp_path, incidents))

    assert [why for why, _ in report.false_kills] == ["after fault 2 pause all ranks"]
    assert report.outcomes[1].problems == ["killed on node-2 (rank_spinning)"]
    assert not report.passed


def test_a_hang_no_node_killed_for_its_rank_is_a_problem(tmp_path):
    report = recovery_mixed.analyse(mixed_run(tmp_path, [kill("node-0", T0 + 35.0, 0, "rank_stopped")]))

    assert report.outcomes[0].problems == ["not killed on its node node-1 (rank 1 blamed by no kill)"]


def test_mixed_faults_need_long_and_known_kinds():
    with pytest.raises(SystemExit):
        main(["--faults", "mixed", "--nodes", "3"])
    with pytest.raises(SystemExit):
        main(["--long", "--faults", "mixed", "--kinds", "stop,meteor"])


@pytest.mark.slow
def test_three_nodes_each_hang_is_killed_and_recovered_and_the_healthy_pause_is_not(tmp_path, capsys):
    # A short run: a deadlock, a spinning rank, a stopped DataLoader worker, a stopped rank and the
    # healthy pause, one every 12 s, floor 3 s (pause 6 s); the victim moves across the nodes. About
    # 2 minutes on 2 cores. The spin failed before the judge's fix (a lone working rank, its peers
    # not yet waiting, was called job_paused and the verdict held: the job hung, never killed).
    kinds = ("deadlock", "spin", "dataloader", "stop", "pause")
    run = mixed_faults.run(tmp_path, minutes=1.0, floor=3.0, nodes=3, every=12.0, kinds=kinds)
    report = recovery_mixed.analyse(run)
    recovery_mixed.print_report(report, "warm")
    out = capsys.readouterr().out

    assert [f.kind for f in run.faults] == list(kinds), out
    assert [f.rank for f in run.faults] == [0, 1, 2, 0, None], out
    for o in report.outcomes:
        assert not o.problems, out
        if o.fault.kind == "pause":
            assert o.kills == [] and not o.restarted, out
        else:
            assert any(i["node"] == o.fault.node and i["blamed_rank"] == o.fault.rank for i in o.kills), out
            assert o.recovered is not None, out
    assert report.false_kills == [], out
    assert all(code == 0 for code in run.exit_codes), out
    assert "goodput: " in out and "count as useful time, not as loss" in out
