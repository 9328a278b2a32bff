"""The coordinator (sidecar/jobview/coordinator.py): one job incident for every node's reports of
the same stall, a verdict that every node gets (long-polled), lost nodes, bounds, the story."""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import pytest

from sidecar.jobview.coordinator import Coordinator, CoordinatorError
from sidecar.jobview.report import NodePart
from tests.jobview.helpers import rank, report


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def coordinator(clock: Clock, hosts=lambda job: job == "j1", **kw) -> Coordinator:
    args = {"lost_after": 15.0, "verdict_wait": 3.0, "max_nodes": 16, "probe": None, "clock": clock}
    return Coordinator(hosts, **(args | kw))


def test_every_node_of_a_stall_gets_the_same_job_incident_and_culprit():
    c = coordinator(Clock())
    assert c.accept(report("node-0", rank(0, state="healthy"))) is None
    v0 = c.accept(report("node-0", rank(0)))
    v1 = c.accept(report("node-1", rank(1, waiting=False)))
    v2 = c.accept(report("node-2", rank(2)))
    assert v0 is not None and v1 is not None and v2 is not None
    assert v0.job_incident == v1.job_incident == v2.job_incident
    assert v2.culprit is not None and (v2.culprit.rank, v2.culprit.node) == (1, "node-1")
    assert (v2.nodes, v2.dumped) == (3, 0) and v2.not_dumped == ["node-0", "node-1", "node-2"]


def test_a_culprit_its_node_finds_busy_is_marked_so_for_every_node_and_unmarked_when_it_is_not():
    """Issue 29: a rank named (here by its stack: not waiting while its peers wait) whose node
    finds it busy, not hung: the verdict says so, and changes (a new version) when it no longer is."""
    clock = Clock()
    c = coordinator(clock)
    c.accept(report("node-0", rank(0)))
    v = c.accept(report("node-1", rank(1, waiting=False)))
    assert v is not None and v.culprit is not None and v.culprit.rank == 1 and not v.culprit.busy
    version = v.version
    clock.now += 1.0
    busy = rank(1, waiting=False)
    busy.busy = True
    v = c.accept(report("node-1", busy))
    assert v is not None and v.culprit is not None and v.culprit.busy and v.culprit.rank == 1
    assert v.version > version
    clock.now += 1.0
    v = c.accept(report("node-1", rank(1, waiting=False)))
    assert v is not None and v.culprit is not None and not v.culprit.busy


def test_a_job_without_a_rank_on_this_node_is_refused():
    c = coordinator(Clock())
    with pytest.raises(CoordinatorError) as e:
        c.accept(report("node-0", rank(0), job="someone-elses"))
    assert e.value.status == 404 and e.value.code == "not_coordinator"


def test_nodes_beyond_max_nodes_are_refused_with_429():
    c = coordinator(Clock(), max_nodes=2)
    c.accept(report("node-0", rank(0, state="healthy")))
    c.accept(report("node-1", rank(1, state="healthy")))
    with pytest.raises(CoordinatorError) as e:
        c.accept(report("node-2", rank(2, state="healthy")))
    assert e.value.status == 429


def test_a_node_silent_past_lost_after_is_named_when_the_others_wait():
    clock = Clock()
    c = coordinator(clock)
    for node, r in (("node-0", 0), ("node-1", 1), ("node-2", 2)):
        c.accept(report(node, rank(r, state="healthy")))
    clock.now += 16.0  # node-2 goes silent
    c.accept(report("node-0", rank(0)))
    v = c.accept(report("node-1", rank(1)))
    assert v is not None and v.lost_nodes == ["node-2"]
    assert v.culprit is not None and v.culprit.rank is None and v.culprit.node == "node-2"


def test_the_incident_closes_once_every_node_trains_again_and_a_new_stall_opens_another():
    clock = Clock()
    c = coordinator(clock)
    first = c.accept(report("node-0", rank(0, waiting=False)))
    assert first is not None and not first.closed
    c.accept(report("node-0", rank(0, state="healthy")))
    clock.now += 2.0
    closed = c.accept(report("node-0", rank(0, state="healthy")))
    assert closed is not None and closed.closed and closed.job_incident == first.job_incident
    again = c.accept(report("node-0", rank(0, waiting=False)))
    assert again is not None and again.job_incident != first.job_incident and not again.closed


def test_every_node_has_dumped_once_each_says_so():
    c = coordinator(Clock())
    v = c.accept(report("node-0", rank(0)))
    assert v is not None
    c.accept(report("node-1", rank(1, waiting=False), dumped=v.job_incident))
    assert not c.verdict("j1").all_dumped
    c.accept(report("node-0", rank(0), dumped=v.job_incident))
    assert c.verdict("j1").all_dumped


async def test_a_long_poll_answers_as_soon_as_the_verdict_changes():
    c = coordinator(Clock())
    v = c.accept(report("node-0", rank(0)))
    assert v is not None and v.culprit is None
    waiter = asyncio.create_task(c.wait_change("j1", v.version, timeout=10.0))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    c.accept(report("node-1", rank(1, waiting=False)))
    got = await asyncio.wait_for(waiter, 2.0)
    assert got is not None and got.culprit is not None and got.culprit.rank == 1


async def test_a_long_poll_without_change_returns_after_its_wait():
    c = coordinator(Clock())
    v = c.accept(report("node-0", rank(0)))
    got = await asyncio.wait_for(c.wait_change("j1", v.version, timeout=0.1), 2.0)
    assert got is not None and got.version == v.version


async def test_a_node_whose_sidecar_does_not_answer_the_probe_is_lost():
    clock = Clock()
    answered = {"http://n0:1": True, "http://n2:1": False}

    async def probe(url: str) -> bool:
        return answered[url]

    c = coordinator(clock, probe=probe, verdict_wait=0.05)
    c.accept(report("node-2", rank(2, state="healthy"), url="http://n2:1"))
    clock.now += 1.0
    c.accept(report("node-0", rank(0, state="gone", exited_at=100.0), url="http://n0:1"))
    await asyncio.sleep(0.3)
    v = c.verdict("j1")
    assert v is not None and v.lost_nodes == ["node-2"]
    assert v.culprit is not None and v.culprit.node == "node-2" and v.culprit.rank is None


def test_the_story_merges_every_node_part_into_one_timeline():
    c = coordinator(Clock())
    v = c.accept(report("node-0", rank(0)))
    assert v is not None
    part0 = NodePart(
        "inc-0", "left_to_launcher", [{"event": "detected", "time": 10.0}, {"event": "left_to_launcher", "time": 12.0}]
    )
    part1 = NodePart("inc-1", "killed", [{"event": "detected", "time": 10.5}, {"event": "sigterm", "time": 11.0}])
    c.accept(report("node-0", rank(0), part=part0, job_incident=v.job_incident))
    c.accept(report("node-1", rank(1, waiting=False), part=part1, job_incident=v.job_incident))
    story = c.story("j1")
    assert story is not None and story["verdict"]["culprit"]["rank"] == 1
    assert [(e["node"], e["event"]) for e in story["timeline"]] == [
        ("node-0", "detected"),
        ("node-1", "detected"),
        ("node-1", "sigterm"),
        ("node-0", "left_to_launcher"),
    ]
    assert story["nodes"]["node-1"]["part"] == {"incident": "inc-1", "outcome": "killed", "stages": {}}
    assert story["nodes"]["node-1"]["ranks"][0]["stack_top"] == "train_step (train.py:14)"


STAGES = {
    "node-0": {"detect": 4.8, "dump": 0.1, "decide": None, "kill": None, "restart": 2.4, "first_step": 0.2},
    "node-1": {"detect": 4.7, "dump": 0.12, "decide": 0.3, "kill": 0.06, "restart": 0.05, "first_step": 0.2},
    "node-2": {"detect": 4.9, "dump": 0.09, "decide": None, "kill": None, "restart": 1.1, "first_step": None},
}


def _three_nodes_stall(c: Coordinator) -> str:
    v = c.accept(report("node-0", rank(0)))
    assert v is not None
    c.accept(report("node-1", rank(1, waiting=False)))
    c.accept(report("node-2", rank(2)))
    return v.job_incident


def _part(node: str, stages: dict | None = None) -> NodePart:
    outcome = "killed" if node == "node-1" else "left_to_launcher"
    return NodePart(f"inc-{node}", outcome, [{"event": "detected", "time": 10.0}], dict(stages or {}))


def test_the_story_holds_every_nodes_recovery_stages():
    c = coordinator(Clock())
    job_incident = _three_nodes_stall(c)
    for i, node in enumerate(("node-0", "node-1", "node-2")):
        c.accept(report(node, rank(i), part=_part(node, STAGES[node]), job_incident=job_incident))
    story = c.story("j1")
    assert story is not None
    assert {node: n["part"]["stages"] for node, n in story["nodes"].items()} == STAGES


def test_the_stages_that_come_after_the_job_incident_closed_reach_its_story():
    """Most of a recovery (restart, process group, first step) is measured once the job trains
    again, when the coordinator has closed the job incident: a node's part sent then replaces its
    earlier one in that incident's story, also after a new job incident opened."""
    clock = Clock()
    c = coordinator(clock)
    job_incident = _three_nodes_stall(c)
    c.accept(report("node-1", rank(1, waiting=False), part=_part("node-1", {"detect": 4.7}), job_incident=job_incident))
    for i, node in enumerate(("node-0", "node-1", "node-2")):
        c.accept(report(node, rank(i, state="healthy")))
    clock.now += 2.0
    closed = c.accept(report("node-0", rank(0, state="healthy")))
    assert closed is not None and closed.closed
    heartbeat = report("node-1", part=_part("node-1", STAGES["node-1"]), job_incident=job_incident, healthy=1)
    c.accept(heartbeat)
    again = c.accept(report("node-0", rank(0, waiting=False)))  # a new stall: its own job incident
    assert again is not None and again.job_incident != job_incident
    c.accept(report("node-2", part=_part("node-2", STAGES["node-2"]), job_incident=job_incident, healthy=1))
    story = c.story("j1", job_incident)
    assert story is not None
    assert story["nodes"]["node-1"]["part"]["stages"] == STAGES["node-1"]
    assert story["nodes"]["node-2"]["part"]["stages"] == STAGES["node-2"]
    assert story["nodes"]["node-0"]["part"] is None


def test_a_node_that_took_no_part_in_a_closed_job_incident_cannot_add_its_part():
    clock = Clock()
    c = coordinator(clock)
    v = c.accept(report("node-0", rank(0, waiting=False)))
    assert v is not None
    c.accept(report("node-0", rank(0, state="healthy")))
    clock.now += 2.0
    assert c.accept(report("node-0", rank(0, state="healthy"))).closed
    c.accept(report("node-5", part=_part("node-5", STAGES["node-0"]), job_incident=v.job_incident, healthy=1))
    story = c.story("j1")
    assert story is not None and "node-5" not in story["nodes"]
    assert "node-5" not in c._jobs["j1"].current.parts  # nothing kept of it either


def test_a_node_hosting_the_coordinator_sees_its_own_dump_counted_at_once():
    """The in-process link must hold a copy of the verdict: holding the coordinator's own object,
    it never saw a version change, and `wait_for(everyone_dumped)` slept its 0.5 s poll (measured:
    0.53 s between the verdict and the SIGTERM of every single-node hang in bench_recovery)."""
    from sidecar.jobview.reporter import Reporter
    from sidecar.watchdog.coordination import everyone_dumped

    async def scenario() -> tuple[float, bool]:
        c = Coordinator(lambda job: job == "j1", lost_after=15.0, verdict_wait=3.0, max_nodes=16, probe=None)
        state = {"dumped": False}

        def source(job_id: str):
            r = report("node-0", rank(0), rank(1, waiting=False), world=2)
            verdict = reporter.verdict(job_id)
            if state["dumped"] and verdict is not None:
                r.dumped = verdict.job_incident
            return r

        reporter = Reporter("node-0", "http://127.0.0.1:1", 5.0, source, local=c)
        reporter.set_coordinator("j1", "http://127.0.0.1:1", "node-0", None)
        task = asyncio.get_running_loop().create_task(reporter.run())
        try:
            first = await reporter.wait_for("j1", lambda v: v is not None and v.culprit is not None, 3.0)
            assert first is not None and not first.all_dumped
            state["dumped"] = True
            loop = asyncio.get_running_loop()
            start = loop.time()
            got = await reporter.wait_for("j1", everyone_dumped, 3.0)
            return loop.time() - start, everyone_dumped(got)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    took, dumped = asyncio.run(scenario())
    assert dumped
    assert took < 0.4, f"the node's own dump reached its verdict after {took:.2f}s"


def test_a_jobs_reports_are_bounded_by_its_world_size_and_every_jobs_by_max_ranks():
    """Round 3, row 1: invented nodes of 1,024 ranks each, reported for one's own job, grew the
    coordinator until the OOM killer came (4,096 nodes x 1,024 ranks per job, no overall bound)."""
    sizes = {"j1": 4, "j2": 64}
    c = coordinator(Clock(), hosts=lambda job: sizes.get(job, 0), max_ranks=6)
    c.accept(report("node-0", rank(0, state="healthy"), rank(1, state="healthy")))
    c.accept(report("node-1", rank(2, state="healthy"), rank(3, state="healthy")))
    with pytest.raises(CoordinatorError) as e:  # a fifth rank of a 4-rank job
        c.accept(report("node-2", rank(3, state="healthy")))
    assert (e.value.status, e.value.code) == (429, "limit_exceeded") and "world size (4)" in str(e.value)
    with pytest.raises(CoordinatorError) as e:  # a rank number the job cannot have
        c.accept(report("node-1", rank(2, state="healthy"), rank(9, state="healthy")))
    assert e.value.status == 400
    c.accept(report("node-1", rank(2, state="healthy")))  # a node's new report replaces its old one
    c.accept(report("node-2", rank(3, state="healthy")))
    assert c.ranks_held == 4
    c.accept(report("node-0", *(rank(r, state="healthy") for r in range(2)), job="j2"))
    # every job's reports together: max_ranks, shared fairly (budget.py): j1 holds 4 of 6, over its part
    # (3 of one owner's 6, two jobs): it gives back its excess, its largest node's report, for j2's
    c.accept(report("node-1", rank(2, state="healthy"), job="j2"))
    assert c._jobs["j1"].ranks_held == 2 and c._jobs["j2"].ranks_held == 3 and c.ranks_held == 5
    c.accept(report("node-2", rank(3, state="healthy"), job="j2"))  # free room: taken, past its part or not
    with pytest.raises(CoordinatorError) as e:  # no room, and past j2's part: refused, nothing dropped
        c.accept(report("node-3", rank(4, state="healthy"), job="j2"))
    assert e.value.status == 429 and "job_view.max_ranks" in str(e.value) and "fair part" in str(e.value)
    with pytest.raises(CoordinatorError):  # j1 back past its part, with no room: refused as well
        c.accept(report("node-0", rank(0, state="healthy"), rank(1, state="healthy")))
    assert c.ranks_held == 6 and c._jobs["j1"].ranks_held == 2


def test_one_owners_invented_nodes_cannot_take_the_budget_from_another_owners_job():
    """Round 4, row 3: mallory (uid 1001), one sleeper of her job claiming world size 2**24, filled the
    coordinator's ranks with invented nodes; alice's (uid 1000) second node then got 429, and her
    real hang was judged by one node alone. Now, once alice's reports need room, mallory's job is
    past its fair part (half the budget: two owners) and is dropped; her next report over her part
    is refused, and alice's are never refused while she keeps within hers."""
    sizes = {"mine": 1 << 24, "alice": 16}

    def hers(n: int) -> None:  # an invented node of 8 ranks
        with contextlib.suppress(CoordinatorError):
            c.accept(
                report(f"fake-{n}", *(rank(n * 8 + i, state="stalled") for i in range(8)), job="mine", world=1 << 24)
            )

    def alices(node: int, count: int = 4) -> None:
        c.accept(
            report(f"node-{node}", *(rank(node * 4 + i, state="healthy") for i in range(count)), job="alice", world=16)
        )

    c = coordinator(Clock(), hosts=lambda job: sizes.get(job, 0), max_ranks=64)
    c.key_for("mine", 1001), c.key_for("alice", 1000)
    for n in range(20):
        hers(n)
    assert c._jobs["mine"].ranks_held == 64  # alone, she may use it all
    alices(0)  # alice's node needs room: mallory's job, past its part (32 of 64: two owners), gives it back
    alices(1)  # (one invented node of 8 dropped for 4), then free room
    assert c._jobs["alice"].ranks_held == 8 and c._jobs["mine"].ranks_held == 56 and c.ranks_held == 64
    for n in range(20, 40):  # no room, and she is past her part: refused
        hers(n)
    assert c._jobs["alice"].ranks_held == 8 and c._jobs["mine"].ranks_held == 56
    alices(2)  # alice's third and fourth nodes: mallory, over her part, makes room again
    alices(3)
    assert c._jobs["alice"].ranks_held == 16 and c._jobs["mine"].ranks_held == 48 and c.ranks_held == 64


def test_a_job_with_no_rank_here_is_forgotten_with_its_key():
    """Round 3, row 2: a job was never forgotten (RSS stayed at 224 MB with no rank left)."""
    clock, hosted = Clock(), {"j1": 2}
    c = coordinator(clock, hosts=lambda job: hosted.get(job, 0))
    key = c.key_for("j1", 1000)
    assert c.key_for("j1", 1000) == key and c.key_for("j1", 1001) != key  # per owner: a new owner, a new key
    key = c.key_for("j1", 1000)
    c.accept(report("node-0", rank(0)))
    c.accept(report("node-1", rank(1, waiting=False)))
    assert c.jobs() == ["j1"] and c.ranks_held == 2
    c.sweep()
    assert c.jobs() == ["j1"]  # still hosted
    del hosted["j1"]  # no rank of it here any more (the daemon's `hosts` allows a restart's gap)
    c.sweep()
    assert c.jobs() == [] and c.verifier("j1") is None and c.ranks_held == 0 and c.forgotten == 1
    hosted["j1"] = 2
    assert c.key_for("j1", 1000) != key  # a job seen again gets a new key


def test_a_nodes_part_carries_its_recovery_stages_and_is_sent_again_while_they_come_in():
    """What a node sends (watchdog/coordination.py): its recovery's stages in its part, and the
    part again after the job incident closed, for a few reports after each new milestone."""
    from sidecar.incidents.store import Incident
    from sidecar.watchdog.coordination import part_of, recovery_news

    incident = Incident("inc-1", 100.0, "j1", "node-1", 1, "stalled", 5.0, False, [], job_incident="J")
    assert part_of(incident, "killed").stages == {}
    incident.recovery = {
        "milestones": {"hang": 95.0, "detected": 100.0, "ranks_gone": 101.0, "started": 101.5, "first_step": None},
        "stages_seconds": {"detect": 5.0, "kill": 0.06, "restart": 0.5, "first_step": None},
        "hang_to_training_seconds": 7.25,
    }
    assert part_of(incident, "killed").stages == {
        "detect": 5.0, "kill": 0.06, "restart": 0.5, "first_step": None, "hang_to_training": 7.25,
    }  # fmt: skip
    assert recovery_news(incident, None, wall=110.0, within=15.0)
    assert not recovery_news(incident, None, wall=117.0, within=15.0)
    assert not recovery_news(incident, "K", wall=110.0, within=15.0)  # a newer job incident is open: not now
    assert not recovery_news(Incident("inc-2", 100.0, "j1", "n", 1, "", 5.0, False, []), None, 100.0, 15.0)


DRILL = "drill-20261205T005255Z-424106"


def test_a_drill_one_node_runs_is_in_the_verdict_every_node_gets_until_that_node_says_it_is_over():
    """`sidecar drill` on node-1: its reports name the drill, so the job incident its stopped rank
    opens carries it to every node (each records its stall as the drill's, not as a real one). Only
    node-1 ends it; the next incident, after it did, is a real one."""
    clock = Clock()
    c = coordinator(clock)
    c.accept(report("node-1", rank(1, state="healthy"), drill=DRILL))  # armed before the rank is stopped
    v0 = c.accept(report("node-0", rank(0)))  # its rank waits for the stopped one
    assert v0 is not None and v0.drill == DRILL
    v2 = c.accept(report("node-2", rank(2), drill=None))  # another node's report does not end it
    assert v2 is not None and v2.drill == DRILL
    for node, r in (("node-0", 0), ("node-1", 1), ("node-2", 2)):
        c.accept(report(node, rank(r, state="healthy")))  # node-1's says no drill any more
    clock.now += 2.0
    closed = c.accept(report("node-0", rank(0, state="healthy")))
    assert closed is not None and closed.closed and closed.drill == DRILL  # the story keeps what it was
    real = c.accept(report("node-0", rank(0)))
    assert real is not None and not real.closed and real.drill is None


def test_a_drill_named_after_the_incident_opened_reaches_its_verdict():
    c = coordinator(Clock())
    first = c.accept(report("node-0", rank(0)))
    assert first is not None and first.drill is None
    known = first.version
    later = c.accept(report("node-1", rank(1), drill=DRILL))
    assert later is not None and later.drill == DRILL and later.version > known  # long-polls wake for it


async def test_an_incident_closes_once_its_nodes_are_fine_without_waiting_for_another_report():
    """A crash loop's restarts train about 2 s before the next crash (make test-under-load,
    train.sbatch): a node's report after its restart was fine, but it reported again only when the
    verdict's long poll answered, so the incident never closed and every next crash fell into it (5
    crashes, no crash loop found, exit 1). It closes CLOSE_AFTER_SECONDS after every report is fine."""
    from sidecar.jobview.coordinator import CLOSE_AFTER_SECONDS

    c = coordinator(lambda: asyncio.get_running_loop().time())
    v = c.accept(report("node-0", rank(0, state="gone", exited_at=100.0), world=1))
    assert v is not None and not v.closed
    c.accept(report("node-0", rank(0, state="healthy"), world=1))  # its restart trains

    async def closed():
        got = c.verdict("j1")
        while got is not None and not got.closed:  # as a node long-polls the verdict: no report meanwhile
            got = await c.wait_change("j1", got.version, timeout=30.0)
        return got

    got = await asyncio.wait_for(closed(), CLOSE_AFTER_SECONDS + 2.0)
    assert got is not None and got.closed, got


def test_a_crash_incident_closes_as_soon_as_its_ranks_are_back():
    """A crash on the first batch after each restart (make test-under-load: the restarts trained
    about 1 s before the next crash) must meet a closed incident, or the crash loop is never found."""
    clock = Clock()
    c = coordinator(clock)
    v = c.accept(report("node-0", rank(0, state="gone", exited_at=100.0), world=1))
    assert v is not None and v.culprit is not None and v.culprit.kind == "rank_crashed", v
    clock.now += 0.1
    v = c.accept(report("node-0", rank(0, state="healthy"), world=1))  # its restart
    assert v is not None and v.closed, v


def test_a_node_sharing_the_coordinators_name_at_another_address_asks_it_over_http_not_itself():
    """make test: two sidecars on one host, both named after it ('vm'), one rank each. The second
    took the coordinator's name for its own and judged the job in-process from its own rank alone:
    with no rank seen waiting, a sleeping rank read once as runnable was a `job_paused`, and the kill
    came at the ceiling, blamed on no rank. Only the same name *and* address is this node."""
    from sidecar.jobview.reporter import Reporter

    c = Coordinator(lambda job: job == "j1", lost_after=15.0, verdict_wait=3.0, max_nodes=16, probe=None)
    me = Reporter("vm", "http://127.0.0.1:20117", 5.0, lambda job: None, local=c)
    assert not me.set_coordinator("j1", "http://127.0.0.1:20116", "vm", None)  # not this node: signed reports only
    assert me.set_coordinator("j1", "http://127.0.0.1:20116", "vm", secrets.token_hex(32))  # another sidecar, same name
    assert not me._is_local(me._links["j1"])
    me.set_coordinator("j1", "http://127.0.0.1:20117/", "vm", None)  # this one
    assert me._is_local(me._links["j1"])
