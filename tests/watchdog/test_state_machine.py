"""The per-rank state machine, driven tick by tick with a hand-moved clock over a real
Registry whose ranks are real (sleeping) processes. Observe-only, so nothing is signalled."""

from __future__ import annotations

import pytest

from sidecar.ranks.protocol import Deregistration
from sidecar.ranks.registry import Registry
from sidecar.watchdog.machine import ALLOWED, IllegalTransition, RankState, Watchdog
from tests.support import make_settings
from tests.watchdog.helpers import WATCHDOG, phase, register, step

EPS = 1e-9  # float sums on a monotonic clock of thousands of seconds

pytestmark = pytest.mark.asyncio


@pytest.fixture
def world(tmp_path, clock, spawn):
    s = make_settings(tmp_path, WATCHDOG, **{"watchdog.observe_only": True})
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=clock)
    return s, registry, dog, spawn().pid


def state(dog, r) -> str:
    return dog.rank_state(r)


async def test_a_new_rank_is_starting(world):
    _, registry, dog, pid = world
    r = register(registry, pid)
    dog.tick()
    assert state(dog, r) == "starting"


async def test_the_first_step_makes_a_rank_healthy(world, clock):
    _, registry, dog, pid = world
    r = register(registry, pid)
    dog.tick()
    step(registry, r, 1, clock)
    dog.tick()
    assert state(dog, r) == "healthy"


async def test_a_rank_without_progress_turns_suspect_then_stalled(world, clock):
    _, registry, dog, pid = world  # floor 10 s, suspect at half
    r = register(registry, pid)
    step(registry, r, 1, clock)
    dog.tick()
    clock.advance(4.9)
    dog.tick()
    assert state(dog, r) == "healthy"
    clock.advance(0.2)
    dog.tick()
    assert state(dog, r) == "suspect"
    clock.advance(5.0)
    dog.tick()
    assert state(dog, r) == "stalled"


async def test_progress_brings_a_suspect_rank_back_to_healthy(world, clock):
    _, registry, dog, pid = world
    r = register(registry, pid)
    step(registry, r, 1, clock)
    clock.advance(6)
    dog.tick()
    assert state(dog, r) == "suspect"
    step(registry, r, 2, clock)
    dog.tick()
    assert state(dog, r) == "healthy"


async def test_a_stall_opens_one_incident_per_episode(world, clock):
    _, registry, dog, pid = world
    r = register(registry, pid)
    step(registry, r, 1, clock)
    clock.advance(11)
    dog.tick()
    clock.advance(5)
    dog.tick()
    assert state(dog, r) == "stalled"
    assert dog.counters.stalls["job"] == 1
    assert len(dog.incidents()) == 1


async def test_a_rank_registering_with_a_step_is_healthy_with_a_fresh_timer(world, clock):
    """After a sidecar restart the hooks re-register with their step: watched, never a stall."""
    _, registry, dog, pid = world
    r = register(registry, pid, step=500)
    clock.advance(1)
    dog.tick()
    assert state(dog, r) == "healthy"
    assert dog.deadline(r).age < 2


async def test_a_new_registration_replaces_the_old_rank(world, clock, spawn):
    _, registry, dog, pid = world
    old = register(registry, pid)
    step(registry, old, 3, clock)
    dog.tick()
    new = register(registry, spawn().pid, restart_count=1)  # a restarted worker (registry: rank_taken otherwise)
    dog.tick()
    assert state(dog, new) == "starting"
    assert dog.counters.transitions[("healthy", "gone")] == 1


async def test_a_deregistered_rank_is_gone_without_incident(world, clock):
    _, registry, dog, pid = world
    r = register(registry, pid)
    step(registry, r, 1, clock)
    dog.tick()
    registry.deregister(Deregistration("job", 0, pid, "finished"))
    clock.advance(60)
    dog.tick()
    assert state(dog, r) == "gone"
    assert dog.incidents() == []


async def test_a_deregistered_rank_is_gone_in_status_before_the_next_tick(world, clock):
    # CI: `sidecar status` read right after torchrun exited showed its ranks healthy: the watchdog's
    # track moves at its next tick, but the registry already knew the rank had said goodbye.
    _, registry, dog, pid = world
    r = register(registry, pid)
    step(registry, r, 1, clock)
    dog.tick()
    registry.deregister(Deregistration("job", 0, pid, "finished"))
    assert state(dog, r) == "gone"
    assert dog.timeout_for(r) is None


async def test_a_rank_whose_process_died_is_gone_without_incident(world, clock, spawn):
    _, registry, dog, _ = world
    p = spawn()
    r = register(registry, p.pid)
    step(registry, r, 1, clock)
    dog.tick()
    p.kill()
    p.wait()
    clock.advance(60)
    dog.tick()
    assert state(dog, r) == "gone"
    assert registry.get("job", 0).gone
    assert dog.incidents() == []


async def test_a_declared_phase_longer_than_the_step_timeout_is_not_a_stall(world, clock):
    _, registry, dog, pid = world
    r = register(registry, pid)
    step(registry, r, 1, clock)
    phase(registry, r, "checkpoint_save", "start", clock, timeout=100)
    clock.advance(40)
    dog.tick()
    assert state(dog, r) == "healthy"
    assert dog.timeout_for(r) == 100
    phase(registry, r, "checkpoint_save", "end", clock)
    clock.advance(4)
    dog.tick()
    assert state(dog, r) == "healthy", "the end of a phase restarts the step timer"


async def test_a_declared_phase_past_its_budget_is_a_stall(world, clock):
    _, registry, dog, pid = world
    r = register(registry, pid)
    step(registry, r, 1, clock)
    phase(registry, r, "eval", "start", clock, timeout=20)
    clock.advance(21)
    dog.tick()
    assert state(dog, r) == "stalled"


async def test_a_phase_without_its_own_budget_uses_phase_timeouts(tmp_path, clock, spawn):
    s = make_settings(tmp_path, WATCHDOG, **{"watchdog.observe_only": True, "watchdog.phase_timeouts": {"eval": 33}})
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=clock)
    r = register(registry, spawn().pid)
    step(registry, r, 1, clock)
    phase(registry, r, "eval", "start", clock)
    assert dog.timeout_for(r) == 33
    phase(registry, r, "something_else", "start", clock)
    assert dog.timeout_for(r) == s.watchdog.default_phase_timeout_seconds


async def test_start_up_has_its_own_budget(world, clock):
    _, registry, dog, pid = world  # startup 60 s, step floor 10 s
    r = register(registry, pid)
    clock.advance(25)
    dog.tick()
    assert state(dog, r) == "starting"
    clock.advance(10)
    dog.tick()
    assert state(dog, r) == "suspect"
    clock.advance(30)
    dog.tick()
    assert state(dog, r) == "stalled"


async def test_every_transition_is_counted(world, clock):
    _, registry, dog, pid = world
    r = register(registry, pid)
    dog.tick()
    step(registry, r, 1, clock)
    dog.tick()
    clock.advance(6)
    dog.tick()
    clock.advance(6)
    dog.tick()
    t = dog.counters.transitions
    assert (t[("starting", "healthy")], t[("healthy", "suspect")], t[("suspect", "stalled")]) == (1, 1, 1)
    text = "".join(str(m.samples) for m in dog.families())
    assert "'from_state': 'suspect', 'to_state': 'stalled'" in text


async def test_a_transition_outside_the_table_is_refused(world):
    _, registry, dog, pid = world
    r = register(registry, pid)
    dog.tick()
    track = dog._tracks[r.key]
    track.state = RankState.GONE
    with pytest.raises(IllegalTransition):
        dog._transition(track, RankState.HEALTHY, 0.0, "test")
    assert ALLOWED[RankState.GONE] == frozenset()


async def test_rank_state_metric_has_one_series_per_state(world, clock):
    _, registry, dog, pid = world
    register(registry, pid)
    dog.tick()
    fam = next(f for f in dog.families() if f.name == "sidecar_rank_state")
    current = {s.labels["state"]: s.value for s in fam.samples}
    assert current == {"starting": 1, "healthy": 0, "suspect": 0, "stalled": 0, "remediating": 0, "gone": 0}


async def test_the_next_tick_comes_when_a_rank_crosses_a_threshold_not_an_interval_later(world, clock):
    _, registry, dog, pid = world  # floor 10 s, suspect at half
    interval = 1.0
    r = register(registry, pid)
    step(registry, r, 1, clock)
    dog.tick()
    assert dog.next_tick_in(interval) == interval  # 5 s to go before suspect: a plain interval

    clock.advance(4.7)
    dog.tick()
    wait = dog.next_tick_in(interval)
    # woken as the rank turns suspect (at 5.0 s), not at 5.7 s; EPS: the fake clock starts at the real
    # monotonic time, and the larger it is the coarser its float sums (this failed on a host up 70 min)
    assert 0.3 - EPS <= wait < 0.31
    clock.advance(wait)
    dog.tick()
    assert state(dog, r) == "suspect"

    clock.advance(4.6)  # 9.6 s without progress
    dog.tick()
    wait = dog.next_tick_in(interval)
    assert 0.4 - EPS <= wait < 0.41  # 10 - 9.602 s, plus the 2 ms slack
    clock.advance(wait)
    dog.tick()
    assert state(dog, r) == "stalled"  # at 10.0 s, the timeout itself


async def test_a_stepping_rank_never_shortens_the_interval(world, clock):
    _, registry, dog, pid = world
    r = register(registry, pid)
    for n in range(1, 30):
        step(registry, r, n, clock)
        dog.tick()
        assert dog.next_tick_in(0.5) == 0.5
        clock.advance(0.3)


async def test_early_ticks_are_spaced_by_what_a_tick_costs(world, clock):
    _, registry, dog, pid = world
    r = register(registry, pid)
    step(registry, r, 1, clock)
    dog.tick()
    clock.advance(4.99)  # the suspect threshold 10 ms away
    dog.tick()
    assert dog.next_tick_in(1.0, tick_seconds=0.0001) < 0.02
    assert dog.next_tick_in(1.0, tick_seconds=0.03) == pytest.approx(0.3)  # ten times the tick's cost
    assert dog.next_tick_in(1.0, tick_seconds=0.5) == 1.0  # never past the interval


class _JobView:
    """This node's reporter as the watchdog sees it (coordination.JobView), holding a verdict the
    job's coordinator sent: a real `Verdict`, as sidecar/jobview/report.py parses it off the wire."""

    def __init__(self, verdict):
        self._verdict = verdict

    def verdict(self, job_id):
        return self._verdict if self._verdict is not None and job_id == self._verdict.job_id else None

    def coordinator(self, job_id):
        return None

    def reachable(self, job_id):
        return True

    def wake(self, job_id):
        pass

    async def wait_for(self, job_id, ready, timeout):
        return self.verdict(job_id)


@pytest.mark.parametrize(
    "named",
    [None, "this rank, rank_late", "another rank", "another node", "stacks, not the record", "busy", "closed"],
)
async def test_a_frozen_rank_its_peers_wait_for_in_a_collective_is_stalled_at_the_floor(world, clock, named):
    """A frozen rank's hooks stop pushing, so it may have stepped unseen after its last push: it is
    declared a push gap after the floor (issue 29). Across nodes that cost a frozen rank alone on its
    node 2.5 s on every peer (issue 32, the race with NVRx: 3 nodes killed at 7.5 s, 1 node at
    5.1 s). When the job's verdict, from the collective record, names it as the rank its peers wait
    for in a collective it never entered, it could not have stepped unseen: stalled at the floor
    from its own last step, as its peers are. Any other verdict keeps the gap."""
    from sidecar.jobview.report import Culprit, Verdict

    s, registry, dog, pid = world  # floor 10 s
    r = register(registry, pid, rank=1)
    step(registry, r, 7, clock)
    r.pushes_promised, r.contact_at = True, clock.now  # hooks of protocol 6; its last push with step 7
    culprit = {
        "this rank, rank_late": Culprit(1, dog.node, 7, kind="rank_late", evidence="collectives"),
        "another rank": Culprit(0, dog.node, 7, kind="rank_late", evidence="collectives"),
        "another node": Culprit(1, "elsewhere", 7, kind="rank_late", evidence="collectives"),
        "stacks, not the record": Culprit(1, dog.node, 7, kind="rank_spinning", evidence="stacks"),
        "busy": Culprit(1, dog.node, 7, kind="rank_late", evidence="collectives", busy=True),
        "closed": Culprit(1, dog.node, 7, kind="rank_late", evidence="collectives"),
    }.get(named or "")
    if named is not None:
        verdict = Verdict("job", "incident-1", 3, opened=0.0, culprit=culprit, closed=named == "closed")
        dog.job_view = _JobView(verdict)
    dog.tick()
    clock.advance(10.1)  # the floor from its last step (and push) has passed
    dog.tick()
    if named == "this rank, rank_late":
        assert state(dog, r) == "stalled"
    else:
        assert state(dog, r) == "suspect", "its last push plus the gap: 2.5 s to go"
        clock.advance(2.5)
        dog.tick()
        assert state(dog, r) == "stalled"


async def test_ranks_left_to_the_launcher_that_step_again_by_themselves_resumed_and_were_not_restarted(
    tmp_path, clock, spawn
):
    """Left to the launcher (the culprit on another node), the ranks here step again before anyone
    killed anything (the tail of a healthy pause: the last rank done evaluating): the outcome is
    `resumed`, not `left_to_launcher` (nothing restarted them; CI run of 2026-12-07, one node of the
    3-node evaluation pause recorded `left_to_launcher` with its rank stepping on in attempt 0)."""
    import asyncio

    from sidecar.watchdog.remediation import target_of

    s = make_settings(tmp_path, WATCHDOG, **{"watchdog.observe_only": True, "watchdog.check_interval_seconds": 0.05})
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=clock)
    r = register(registry, spawn().pid)
    step(registry, r, 1, clock)
    dog.tick()
    clock.advance(11)
    dog.tick()
    assert state(dog, r) == "stalled"
    episode = dog._episodes["job"]
    await asyncio.wait_for(episode.task, 10)  # observe-only: its stacks, no signal
    episode.task = asyncio.get_running_loop().create_task(episode.leave_to_launcher([target_of(r)]))
    await asyncio.sleep(0.1)  # it waits on the launcher: the rank is still stalled
    assert not episode.task.done()
    step(registry, r, 2, clock)
    dog.tick()
    assert state(dog, r) == "healthy"
    assert await asyncio.wait_for(episode.task, 10) == "resumed"
    events = [e["event"] for e in episode.incident.timeline]
    assert "resumed_by_itself" in events and "restarted_by_launcher" not in events, events


async def _left_to_launcher(tmp_path, clock, spawn, grace, culprit_for):
    """A rank stalled past the floor under an observe-only watchdog whose job view holds the verdict
    `culprit_for(dog)` gives; its episode, done with its stacks, then left to the launcher."""
    import asyncio
    import time as wall

    from sidecar.jobview.report import Verdict
    from sidecar.watchdog.remediation import target_of

    settings = {"watchdog.observe_only": True, "watchdog.check_interval_seconds": 0.05,
                "job_view.launcher_grace_seconds": grace}  # fmt: skip
    s = make_settings(tmp_path, WATCHDOG, **settings)
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=clock)
    view = _JobView(Verdict("job", "incident-1", 3, opened=0.0, culprit=culprit_for(dog), decided=wall.time()))
    dog.job_view = view
    proc = spawn()
    r = register(registry, proc.pid)
    step(registry, r, 1, clock)
    dog.tick()
    clock.advance(11)
    dog.tick()
    episode = dog._episodes["job"]
    await asyncio.wait_for(episode.task, 10)
    episode.task = asyncio.get_running_loop().create_task(episode.leave_to_launcher([target_of(r)]))
    return dog, view, registry, r, proc, episode


async def test_ranks_left_to_the_launcher_while_the_job_is_paused_are_held_not_killed_past_the_grace(
    tmp_path, clock, spawn
):
    """The job's verdict says `job_paused` (the tail of a pause: this node's rank is done and waits,
    another node's still works): nobody acts, so this node holds its waiting rank past
    job_view.launcher_grace_seconds (bounded by watchdog.ceiling_seconds) instead of killing it."""
    import asyncio

    from sidecar.jobview.report import Culprit

    def paused(dog):
        return Culprit(None, "node-9", None, reason="no rank waits on another", kind="job_paused", evidence="stacks")

    dog, _, registry, r, proc, episode = await _left_to_launcher(tmp_path, clock, spawn, 0.2, paused)
    for _ in range(10):  # five graces on the watchdog's clock
        clock.advance(0.1)
        await asyncio.sleep(0.06)
    assert not episode.task.done() and proc.poll() is None  # held, not killed
    step(registry, r, 2, clock)
    dog.tick()
    assert await asyncio.wait_for(episode.task, 10) == "resumed"


async def test_ranks_left_to_the_launcher_are_killed_at_once_when_the_verdict_comes_to_name_a_rank_here(
    tmp_path, clock, spawn
):
    """bench_race --field, 1 node, floor 1 s: the first verdict said `job_paused` (the deadlocked
    rank's CPU time had grown until the hang, its peer's record was a second old), which nobody acts
    on, so the node left its ranks to the launcher; 2.6 s later the verdict named rank 1 here
    (`rank_deadlocked`), but the node waited out job_view.launcher_grace_seconds (30 s) before it
    killed. A verdict that comes to name a rank here is acted on at once."""
    import asyncio
    import time as wall

    from sidecar.jobview.report import Culprit, Verdict

    def paused(dog):
        return Culprit(None, dog.node, None, reason="no rank waits on another", kind="job_paused", evidence="stacks")

    dog, view, _, _, _, episode = await _left_to_launcher(tmp_path, clock, spawn, 30.0, paused)
    await asyncio.sleep(0.2)
    assert not episode.task.done()  # a pause: nobody acts
    named = Culprit(0, dog.node, 1, reason="never entered the all-reduce", kind="rank_deadlocked",
                    evidence="collectives")  # fmt: skip
    view._verdict = Verdict("job", "incident-1", 4, opened=0.0, culprit=named, decided=wall.time() + 0.01)
    await asyncio.wait_for(episode.task, 5)  # long before the 30 s grace
    assert any("came to name a rank here" in n for n in episode.incident.notes), episode.incident.notes
    assert episode.incident.blamed_rank == 0 and episode.incident.hang_kind == "rank_deadlocked"


@pytest.mark.parametrize("resumed", [None, 3], ids=["from-scratch", "resumed-at-its-step"])
@pytest.mark.parametrize("ticked", [True, False], ids=["seen-gone", "replaced-at-once"])
async def test_a_crashed_rank_restarted_before_its_node_reported_is_its_exit_in_the_next_report(
    world, clock, spawn, ticked, resumed
):
    """Under make test-under-load a crashed rank's restart registered 0.2 s after its exception, before
    any report to the job's coordinator carried the exit: its peers' later exits were the first the
    coordinator heard of, and a consequence rank was named the crashed one (issue 48). Its node reports
    the exit in its place in its next report, once, if the restart has not stepped (whether or not a
    tick saw it gone first; a restart resumed from a snapshot registers with its step: healthy at once)."""
    _, registry, dog, pid = world
    r = register(registry, pid)
    step(registry, r, 3, clock)
    dog.tick()
    registry.deregister(Deregistration("job", 0, pid, "exception"))
    if ticked:
        dog.tick()
    new = register(registry, spawn().pid, restart_count=1, step=resumed)
    clock.advance(0.5)
    dog.tick()
    report = dog.node_report("job")
    assert report is not None and [(v.rank, v.state) for v in report.ranks] == [(0, "gone")], report
    assert report.ranks[0].exited_at is not None and report.troubled, report
    report = dog.node_report("job")  # once: the coordinator keeps it (jobview/jobs.py kept_exit)
    assert report is not None and [(v.rank, v.exited_at) for v in report.ranks] == [(0, None)], report
    step(registry, new, 4, clock)
    dog.tick()
    report = dog.node_report("job")
    assert report is not None and [(v.rank, v.state, v.exited_at) for v in report.ranks] == [(0, "healthy", None)]


async def test_a_new_registration_wakes_the_job_views_reporter(world, clock, spawn):
    """A restarted rank is news for the job's coordinator: its node's last report said its ranks
    exited, and the incident stays open until a report says otherwise. The reporter waits on the
    verdict's long poll meanwhile; without a wake, a crash loop's restarts crashed again before the
    node reported them, and the first incident swallowed every next crash (make test-under-load)."""
    from types import SimpleNamespace

    _, registry, dog, pid = world
    woken: list[str] = []
    dog.job_view = SimpleNamespace(wake=woken.append, verdict=lambda job_id: None)
    old = register(registry, pid)
    step(registry, old, 3, clock)
    dog.tick()
    registry.deregister(Deregistration("job", 0, pid, "exception"))
    dog.tick()
    woken.clear()
    register(registry, spawn().pid, restart_count=1, step=3)  # resumed: healthy at once, no transition
    dog.tick()
    assert woken == ["job"], woken
