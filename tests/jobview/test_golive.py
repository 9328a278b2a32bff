"""The go-live checks over the whole job (sidecar/jobview/golive.py): each node's figures on the
wire, validated field by field; the coordinator's judgement over every node's ranks (naming the
rank and node that differ); the answer every node reads; what `/v1/status` shows."""

from __future__ import annotations

import json

import pytest

from sidecar.jobview import golive
from sidecar.jobview.coordinator import Coordinator
from sidecar.jobview.report import parse_report
from sidecar.ranks.golive import GIB, MIB, JobFigures, LossFigures, RankFigures
from sidecar.ranks.protocol import ProtocolError
from tests.jobview.helpers import rank, report

MEM = 22 * GIB


def figures(ranks: range | list[int], memory: float = MEM, expected: int = 4, step: float = 0.3, **kw) -> JobFigures:
    """A node's figures: its ranks stepped, `memory` bytes each, `step` seconds per step."""
    out = [RankFigures(r, True, int(memory), step_seconds=step) for r in ranks]
    return JobFigures(expected, kw.pop("steps", 50), kw.pop("share", 0.2), out, **kw)


def falling(first: int = 1, steps: int = 50) -> LossFigures:
    return LossFigures(first, first + steps - 1, steps, 2.3, 1.9, 0, first, first + steps - 1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def coordinator(clock: Clock, world: int = 8) -> Coordinator:
    return Coordinator(
        lambda job: world if job == "j1" else 0, lost_after=15.0, verdict_wait=3.0, max_nodes=16, probe=None,
        clock=clock, wall=lambda: 1_764_870_000.0 + clock.now, node="node-a",
    )  # fmt: skip


def send(c: Coordinator, clock: Clock, node: str, got: JobFigures | None, world: int = 8) -> None:
    """A healthy heartbeat of `node` carrying `got`, after the judgement's rate limit."""
    clock.now += 1.5
    ranks = [rank(r.rank, state="healthy", waiting=None) for r in got.ranks] if got is not None else []
    c.accept(report(node, *ranks, world=world, golive=got))


def checks(c: Coordinator) -> dict[str, tuple[str, str]]:
    answer = c.golive("j1")
    assert answer is not None
    return {name: (check.state, check.text) for name, check in answer.checks.items()}


# ---------------------------------------------------------------- the report field


def wire(got: JobFigures | None) -> dict:
    return json.loads(json.dumps(report("node-1", rank(2), golive=got).to_wire()))


def test_a_reports_figures_survive_the_round_trip_and_a_report_without_them_stays_as_it_was():
    sent = figures([2, 3], loss=falling())
    sent.ranks[0].tokens_per_second = 51_200.0
    parsed = parse_report(wire(sent), max_ranks=8)
    assert parsed.golive == sent
    plain = wire(None)
    assert "golive" not in plain, "a coordinator that predates it sees the report it always saw"
    assert parse_report(plain, max_ranks=8).golive is None


def good() -> dict:
    return wire(figures([2, 3], loss=falling()))["golive"]


def changed(path: str, value) -> dict:
    data = good()
    *parents, last = path.split(".")
    obj = data
    for p in parents:
        obj = obj[int(p)] if isinstance(obj, list) else obj[p]
    key = int(last) if isinstance(obj, list) else last
    if value is KeyError:
        del obj[key]
    else:
        obj[key] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("ranks.0.memory", -1, "golive.ranks[0].memory"),
        ("ranks.0.memory", 2.0**51, "golive.ranks[0].memory"),
        ("ranks.0.memory", "22G", "golive.ranks[0].memory"),
        ("ranks.1.stepped", 1, "golive.ranks[1].stepped"),
        ("ranks.1.stepped", KeyError, "golive.ranks[1].stepped"),
        ("ranks.0.tokens_per_second", 0, "golive.ranks[0].tokens_per_second"),
        ("ranks.0.samples_per_second", 1e13, "golive.ranks[0].samples_per_second"),
        ("ranks.0.step_seconds", True, "golive.ranks[0].step_seconds"),
        ("ranks.0.rank", -1, "golive.ranks[0].rank"),
        ("ranks.0.rank", 3, "golive.ranks[1].rank"),  # named twice
        ("ranks.0", "rank 2", "golive.ranks[0]"),
        ("ranks", {"rank": 2}, "golive.ranks"),
        ("expected", 0, "golive.expected"),
        ("steps", 1, "golive.steps"),
        ("share", 0, "golive.share"),
        ("share", 11, "golive.share"),
        ("loss.last_step", 0, "golive.loss.last_step"),  # before its first step
        ("loss.head", "2.3", "golive.loss.head"),
        ("loss.points", -1, "golive.loss.points"),
        ("loss", [1, 2], "golive.loss"),
    ],
)
def test_a_bad_figure_is_refused_naming_the_field(path, value, field):
    data = wire(None)
    data["golive"] = changed(path, value)
    with pytest.raises(ProtocolError) as e:
        parse_report(data, max_ranks=8)
    assert str(e.value).startswith(field), str(e.value)


def test_figures_are_bounded_by_the_reports_ranks():
    data = wire(None)
    data["golive"] = {**good(), "ranks": [RankFigures(r, True).to_wire() for r in range(9)]}
    with pytest.raises(ProtocolError) as e:
        parse_report(data, max_ranks=8)
    assert e.value.status == 413 and str(e.value).startswith("golive.ranks")


def test_a_rank_costs_a_report_under_120_bytes():
    got = figures(range(8))
    for r in got.ranks:
        r.tokens_per_second = 51234.0
    size = len(json.dumps(got.to_wire(), separators=(",", ":")))
    assert size < 8 * 120, size


def test_figures_are_sent_when_they_change_and_every_refresh():
    sent = golive.Sent()
    got = figures([0, 1])
    assert sent.due(got, 0.0) is got
    sent.taken(got, 0.0)
    assert sent.due(figures([0, 1]), 5.0) is None, "unchanged: not sent again"
    assert sent.due(figures([0, 1], memory=MEM + 64 * MIB), 5.0) is not None
    assert sent.due(figures([0, 1]), golive.REFRESH_SECONDS + 1) is not None, "a restarted coordinator learns them"
    assert sent.due(None, 5.0) is None


# ---------------------------------------------------------------- the job-wide judgement


def test_a_balanced_job_across_nodes_is_ok_and_counts_every_rank():
    clock = Clock()
    c = coordinator(clock)
    send(c, clock, "node-a", figures(range(4), loss=falling()))
    send(c, clock, "node-b", figures(range(4, 8), memory=MEM * 1.05))
    got = checks(c)
    assert got["ranks_joined"] == ("ok", "8 of 8 ranks reported by 2 nodes")
    assert got["first_batch"][0] == "ok"
    assert got["gpu_memory"] == ("ok", "ranks 0, 1, 2, 3, 4, 5, 6, 7: 22.0-23.1 GiB (within 20%)")
    assert got["throughput"][0] == "ok"
    assert got["loss"][0] == "ok" and "2.3 -> 1.9" in got["loss"][1]
    answer = c.golive("j1")
    assert answer is not None and answer.state == "ok" and (answer.ranks, answer.nodes) == (8, 2)


def test_one_nodes_rank_using_40_percent_more_memory_is_named_with_its_node():
    clock = Clock()
    c = coordinator(clock)
    send(c, clock, "node-a", figures(range(4), loss=falling()))
    heavy = figures(range(4, 8))
    heavy.ranks[2].memory = int(MEM * 1.4)  # rank 6: the guide's sign of settings that differ
    send(c, clock, "node-b", heavy)
    state, text = checks(c)["gpu_memory"]
    assert state == "warning"
    assert text == "rank 6 on node-b uses 30.8 GiB, the others 22.0 GiB (+40%)"
    assert c.golive("j1").state == "warning"  # type: ignore[union-attr]


def test_a_slow_rank_on_another_node_is_named_in_throughput():
    clock = Clock()
    c = coordinator(clock)
    send(c, clock, "node-a", figures(range(4), loss=falling()))
    slow = figures(range(4, 8))
    slow.ranks[3].step_seconds = 0.45
    send(c, clock, "node-b", slow)
    assert checks(c)["throughput"] == ("warning", "rank 7 on node-b steps in 0.45 s, the others 0.3 s per step (+50%)")


def test_ranks_missing_on_a_node_keep_the_job_pending_naming_the_node():
    clock = Clock()
    c = coordinator(clock)
    send(c, clock, "node-a", figures(range(4), loss=falling()))
    send(c, clock, "node-b", figures([4, 5, 7]))  # rank 6 has not registered there
    got = checks(c)
    assert got["ranks_joined"] == (
        "pending",
        "7 of 8 ranks reported by 2 nodes; missing rank 6; node-b has 3 of its 4 local ranks",
    )
    assert got["first_batch"] == ("pending", "1 of 8 ranks not reported yet")
    assert got["gpu_memory"][0] == "pending" and got["throughput"][0] == "pending"


def test_a_node_not_heard_yet_keeps_the_job_pending():
    clock = Clock()
    c = coordinator(clock)
    send(c, clock, "node-a", figures(range(4), loss=falling()))
    assert checks(c)["ranks_joined"] == ("pending", "4 of 8 ranks reported by 1 node; missing rank 4, 5, 6, 7")


def test_ranks_before_their_first_batch_are_named_with_their_node_and_memory_waits():
    clock = Clock()
    c = coordinator(clock)
    send(c, clock, "node-a", figures(range(4), loss=falling()))
    late = figures(range(4, 8))
    late.ranks[1].stepped = False
    send(c, clock, "node-b", late)
    got = checks(c)
    assert got["first_batch"] == ("pending", "rank 5 on node-b not past its first batch yet")
    assert got["gpu_memory"] == ("pending", "waiting for every rank's first step")


def test_the_loss_is_rank_0s_nodes_wherever_it_is():
    clock = Clock()
    c = coordinator(clock)
    flat = LossFigures(1, 50, 50, 2.3, 2.3, 0, 1, 50)
    send(c, clock, "node-a", figures(range(4, 8), loss=falling()))  # not rank 0's node: its loss is not read
    send(c, clock, "node-b", figures(range(4), loss=flat))
    assert checks(c)["loss"] == ("warning", "loss did not fall over steps 1-50: 2.3 -> 2.3")


def test_the_loss_is_pending_until_rank_0s_node_reports():
    clock = Clock()
    c = coordinator(clock)
    send(c, clock, "node-b", figures(range(4, 8)))
    assert checks(c)["loss"] == ("pending", "the node of rank 0 has not reported yet")


def test_unchanged_figures_count_and_a_silent_node_drops_out():
    clock = Clock()
    c = coordinator(clock)
    send(c, clock, "node-a", figures(range(4), loss=falling()))
    send(c, clock, "node-b", figures(range(4, 8)))
    send(c, clock, "node-a", None)  # heartbeats: unchanged figures
    assert checks(c)["ranks_joined"][0] == "ok"
    for _ in range(12):  # node-b silent past lost_after (15 s), node-a still reports
        send(c, clock, "node-a", None)
    assert checks(c)["ranks_joined"] == ("pending", "4 of 8 ranks reported by 1 node; missing rank 4, 5, 6, 7")


def test_ranks_beyond_the_world_size_are_left_out():
    clock = Clock()
    c = coordinator(clock, world=4)
    send(c, clock, "node-a", figures(range(4), loss=falling()), world=4)
    c.accept(report("node-b", world=4, golive=figures([7])))  # a rank no world of 4 has
    clock.now += 11
    assert checks(c)["ranks_joined"] == ("ok", "4 of 4 ranks reported by 2 nodes")


def test_the_judgement_of_8000_ranks_is_quick():
    import time

    nodes = {
        f"node-{n}": golive._Node(figures(range(8 * n, 8 * n + 8), expected=8), 8000, float(n)) for n in range(1000)
    }
    # this process's CPU time, not the wall clock: four test workers on two cores stretched 0.02 s
    # of work to 1.07 s of wall time once; the bound is for a judgement that grew quadratic
    started = time.process_time()
    judged = golive.judge(nodes, 0.0)
    took = time.process_time() - started
    assert judged.checks["gpu_memory"].state == "ok" and judged.checks["ranks_joined"].state == "ok"
    assert took < 0.5, f"{took:.2f} CPU-s"


# ---------------------------------------------------------------- the answer


def test_the_answer_survives_the_round_trip_and_is_bounded():
    clock = Clock()
    c = coordinator(clock)
    send(c, clock, "node-a", figures(range(4), loss=falling()))
    answer = c.golive("j1")
    assert answer is not None
    raw = json.loads(json.dumps(answer.to_wire()))
    back = golive.parse_answer(raw)
    assert back is not None and back.checks == answer.checks and back.world_size == 8
    assert len(json.dumps(raw)) < 1500
    assert golive.parse_answer(None) is None, "a coordinator that predates it sends none"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"checks": [1]}, "golive.checks"),
        ({"checks": {"loss": {"state": "great", "text": "x"}}}, "golive.checks.loss.state"),
        ({"checks": {"loss": {"state": "ok", "text": "\x1b[2J"}}}, "golive.checks.loss.text"),
        ({"checks": {"loss": {"state": "ok", "text": "x" * 481}}}, "golive.checks.loss.text"),
        ({"time": -1}, "golive.time"),
        ({"ranks": "all"}, "golive.ranks"),
    ],
)
def test_a_malformed_answer_is_refused_naming_the_field(change, field):
    raw = {"time": 1.0, "age_seconds": 0.0, "ranks": 1, "nodes": 1, "world_size": 1, "checks": {}, **change}
    with pytest.raises(ProtocolError) as e:
        golive.parse_answer(raw)
    assert str(e.value).startswith(field), str(e.value)


def test_a_check_this_node_does_not_know_is_left_out():
    raw = {"time": 1.0, "checks": {"loss": {"state": "ok", "text": "fell"}, "future": {"state": "ok", "text": "x"}}}
    back = golive.parse_answer(raw)
    assert back is not None and list(back.checks) == ["loss"]


# ---------------------------------------------------------------- what a node shows


def test_a_node_shows_the_job_wide_checks_while_fresh_else_its_own():
    clock = Clock()
    c = coordinator(clock)
    send(c, clock, "node-a", figures(range(4), loss=falling()))
    answer = c.golive("j1")
    assert answer is not None
    mine = {"j1": {"state": "ok", "steps": 50, "checks": {"ranks_joined": {"state": "ok", "text": "4 of 4 local"}}}}
    shown = golive.shown(mine, lambda job: (answer, 2.0), lambda job: ("node-a", "http://a"))
    assert shown["j1"]["judged_by"] == "coordinator" and shown["j1"]["judged_on"] == "node-a"
    assert shown["j1"]["state"] == "pending" and shown["j1"]["checks"]["ranks_joined"]["state"] == "pending"
    assert shown["j1"]["node_checks"] == mine["j1"]["checks"] and shown["j1"]["world_size"] == 8
    stale = golive.shown(mine, lambda job: None, lambda job: ("node-a", "http://a"))
    assert stale["j1"] == {**mine["j1"], "judged_by": "node"}
