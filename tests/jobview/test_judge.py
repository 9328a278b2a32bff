"""The culprit rule (sidecar/jobview/judge.py): the rank that is not waiting for its peers at the
job's lowest step; a rank waiting in a collective is never blamed; a lost node is named when every
rank that reports waits; after exits, the first to exit unless a node went silent."""

from __future__ import annotations

from sidecar.jobview.judge import judge
from tests.jobview.helpers import rank, report


def test_the_rank_not_waiting_at_the_lowest_step_is_the_culprit_whichever_node_it_is_on():
    reports = [
        report("node-0", rank(0)),
        report("node-1", rank(1, local=0), rank(2, state="stalled", waiting=False, local=1)),
        report("node-2", rank(3)),
    ]
    c = judge(reports)
    assert c is not None and (c.rank, c.node, c.step) == (2, "node-1", 29)
    assert "not waiting for its peers" in c.reason and "3 ranks wait" in c.reason
    assert c.stack_top == "train_step (train.py:14)"


def test_a_rank_waiting_in_a_collective_is_never_blamed_even_when_it_is_alone_on_its_node():
    reports = [report("node-0", rank(0, state="stalled", age=9.0)), report("node-1", rank(1, waiting=False))]
    c = judge(reports)
    assert c is not None and c.rank == 1 and c.node == "node-1"


def test_a_rank_not_waiting_above_the_lowest_step_is_not_the_culprit():
    reports = [report("node-0", rank(0, step=30, waiting=False)), report("node-1", rank(1, step=29, waiting=None))]
    assert judge(reports) is None  # the rank at the lowest step has not been looked at yet


def test_the_judgement_waits_for_the_stacks_then_forced_names_the_oldest_progress():
    reports = [report("node-0", rank(0, waiting=None, age=2.0)), report("node-1", rank(1, waiting=None, age=4.0))]
    assert judge(reports) is None
    c = judge(reports, force=True)
    assert c is not None and c.rank == 1 and "its stack was not known" in c.reason


def test_when_every_reporting_rank_waits_the_lost_node_is_named():
    reports = [report("node-0", rank(0)), report("node-1", rank(1), rank(2))]
    assert judge(reports) is None
    c = judge(reports, lost=["node-2"])
    assert c is not None and c.rank is None and c.node == "node-2" and "stopped reporting" in c.reason


def test_a_healthy_job_has_no_culprit():
    assert judge([report("node-0", rank(0, state="healthy")), report("node-1", rank(1, state="healthy"))]) is None


def test_after_exits_the_first_rank_to_exit_is_the_cause():
    reports = [
        report("node-0", rank(0, state="gone", exited_at=105.0), world=3),
        report("node-1", rank(1, state="gone", exited_at=100.0), rank(2, state="gone", exited_at=104.0), world=3),
    ]
    c = judge(reports)
    assert c is not None and (c.rank, c.node) == (1, "node-1") and "first rank of the job to exit" in c.reason


def test_exits_wait_for_a_silent_node_and_name_it_once_it_is_lost():
    reports = [
        report("node-0", rank(0, state="gone", exited_at=100.0)),
        report("node-1", rank(1, state="gone", exited_at=101.0)),
    ]
    assert judge(reports, silent=["node-2"]) is None
    c = judge(reports, lost=["node-2"], silent=["node-2"])
    assert c is not None and c.rank is None and c.node == "node-2"
