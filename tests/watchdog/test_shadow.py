"""Shadow mode and false alarms (sidecar/watchdog/shadow.py), tick by tick with a hand-moved clock
over a real Registry of real (sleeping) processes: what an observe-only watchdog would have
killed, the stalls that ended by themselves, what they teach the job's budgets (never above the
ceiling), and a job's own observe-only request."""

from __future__ import annotations

import pytest

from sidecar.host import procs
from sidecar.ranks.model import Rank
from sidecar.ranks.protocol import Launcher, Registration
from sidecar.ranks.registry import Registry
from sidecar.watchdog.machine import Watchdog
from sidecar.watchdog.shadow import Shadow
from sidecar.watchdog.timeouts import Timeouts
from tests.support import make_settings
from tests.watchdog.helpers import WATCHDOG, phase, register, step

pytestmark = pytest.mark.asyncio

JOB = "job"


@pytest.fixture
def observe(tmp_path, clock, spawn):
    """An observe-only watchdog (floor 10 s, ceiling 100 s, a tick of 0.5 s) and a sleeping process."""
    s = make_settings(tmp_path, WATCHDOG, **{"watchdog.observe_only": True})
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=clock)
    yield s, registry, dog, spawn().pid
    dog.close().close()  # the observe tasks never ran (no await): nothing to cancel


def samples(dog: Watchdog) -> dict[tuple, float]:
    """The watchdog's exported samples by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in dog.families() for s in family.samples}


def value(dog: Watchdog, name: str, **labels: str) -> float | None:
    return samples(dog).get((name, tuple(sorted(labels.items()))))


def figures(dog: Watchdog, job: str = JOB) -> dict:
    return dog.status()["shadow"].get(job, {"would_kill": 0, "false_alarms": 0})


def steady(registry, r, clock, steps: int = 250, every: float = 0.1) -> None:
    """Steps every 100 ms: the step timeout is the floor (8 x 0.1 s), and one pause among them is
    not what the 0.99 quantile of the last 200 step times follows."""
    start = (r.step or 0) + 1
    for n in range(start, start + steps):
        clock.advance(every)
        step(registry, r, n, clock)


async def test_an_observe_only_stall_of_a_verified_restartable_job_is_a_would_be_kill(observe, clock):
    _, registry, dog, pid = observe
    r = register(registry, pid)
    step(registry, r, 1, clock)
    dog.tick()
    clock.advance(11)
    dog.tick()
    assert dog.rank_state(r) == "stalled"
    assert value(dog, "sidecar_watchdog_would_kill_total", job_id=JOB) == 1
    assert figures(dog)["would_kill"] == 1 and figures(dog)["observe_only"] is True
    assert "a would-be kill" in " ".join(dog._episodes[JOB].incident.notes)
    assert value(dog, "sidecar_watchdog_remediations_total", job_id=JOB, outcome="observe_only") is None  # pending


async def test_a_stall_the_watchdog_would_not_have_killed_is_no_would_be_kill(observe, clock):
    """Nothing would restart it (no launcher), or no verified caller registered it."""
    _, registry, dog, pid = observe
    lone = Registration(
        job_id="lone", rank=0, local_rank=0, world_size=1, local_world_size=1, pid=pid, launcher=Launcher("none")
    )
    a = registry.register(lone, pid_start_time=None, peer_verified=True)
    stranger = Registration(job_id="tcp", rank=0, local_rank=0, world_size=1, local_world_size=1, pid=pid)
    b = registry.register(stranger, pid_start_time=None, peer_verified=False)
    for r in (a, b):
        step(registry, r, 1, clock)
    dog.tick()
    clock.advance(11)
    dog.tick()
    assert dog.rank_state(a) == dog.rank_state(b) == "stalled"
    assert figures(dog, "lone")["would_kill"] == figures(dog, "tcp")["would_kill"] == 0
    assert value(dog, "sidecar_watchdog_would_kill_total", job_id="lone") is None


async def test_a_stall_that_ends_by_itself_is_a_false_alarm_with_its_whole_pause(observe, clock):
    _, registry, dog, pid = observe
    r = register(registry, pid)
    step(registry, r, 1, clock)
    dog.tick()
    clock.advance(11)
    dog.tick()
    incident = dog._episodes[JOB].incident
    clock.advance(1)
    step(registry, r, 2, clock)  # 12 s after step 1
    dog.tick()
    assert dog.rank_state(r) == "healthy"
    steps = {"job_id": JOB, "phase": "steps"}
    assert value(dog, "sidecar_watchdog_false_alarms_total", **steps) == 1
    assert value(dog, "sidecar_watchdog_false_alarm_duration_seconds_count", **steps) == 1
    assert value(dog, "sidecar_watchdog_false_alarm_duration_seconds_sum", **steps) == pytest.approx(12, abs=0.05)
    assert value(dog, "sidecar_watchdog_false_alarm_duration_seconds_bucket", le="10.0", **steps) == 0
    assert value(dog, "sidecar_watchdog_false_alarm_duration_seconds_bucket", le="30.0", **steps) == 1
    f = figures(dog)
    assert f["false_alarms"] == 1 and f["would_kill"] == 1
    assert f["phases"]["steps"]["longest_pause_seconds"] == pytest.approx(12, abs=0.05)
    assert f["floor_killing_none_seconds"] == pytest.approx(12.5, abs=0.05)  # the pause and a tick (0.5 s)
    assert f["learned_budgets_seconds"] == {"steps": pytest.approx(18, abs=0.1)}
    note = [n for n in incident.notes if n.startswith("false alarm")]
    assert note and "after 12.0s" in note[0] and "step timeout is now at least 18.0s" in note[0], incident.notes


async def test_the_same_pause_again_is_no_stall_once_learned(observe, clock):
    _, registry, dog, pid = observe
    r = register(registry, pid)
    steady(registry, r, clock)
    dog.tick()
    clock.advance(12)
    dog.tick()
    assert dog.rank_state(r) == "stalled"
    step(registry, r, r.step + 1, clock)
    dog.tick()  # the tick that sees it back ends its pause
    steady(registry, r, clock, 20)
    dog.tick()
    assert dog.counters.stalls[JOB] == 1
    assert dog.timeout_for(r) == pytest.approx(18, abs=0.1)  # 1.5 x the 12 s pause, above the 10 s floor
    clock.advance(12)
    dog.tick()
    assert dog.rank_state(r) == "suspect"  # 12 s of its 18 s
    step(registry, r, r.step + 1, clock)
    dog.tick()
    assert dog.rank_state(r) == "healthy" and dog.counters.stalls[JOB] == 1
    clock.advance(18.1)
    dog.tick()
    assert dog.rank_state(r) == "stalled"  # a longer pause still is one


async def test_what_a_pause_teaches_is_bounded_by_the_ceiling(observe, clock):
    _, registry, dog, pid = observe  # ceiling 100 s
    r = register(registry, pid)
    steady(registry, r, clock)
    dog.tick()
    clock.advance(90)
    dog.tick()
    incident = dog._episodes[JOB].incident
    step(registry, r, r.step + 1, clock)
    dog.tick()
    assert figures(dog)["learned_budgets_seconds"] == {"steps": 100}  # not 135
    assert "cut to watchdog.ceiling_seconds 100s" in incident.notes[-1], incident.notes
    assert dog.timeout_for(r) == 100
    clock.advance(100.1)
    dog.tick()
    assert dog.rank_state(r) == "stalled"


async def test_a_pause_in_a_declared_phase_teaches_that_phase_s_budget(observe, clock):
    _, registry, dog, pid = observe
    r = register(registry, pid)
    step(registry, r, 1, clock)
    phase(registry, r, "eval", "start", clock, timeout=5)
    dog.tick()
    clock.advance(6)
    dog.tick()
    assert dog.rank_state(r) == "stalled"
    clock.advance(2)
    phase(registry, r, "eval", "end", clock)  # 8 s in eval
    dog.tick()
    assert value(dog, "sidecar_watchdog_false_alarms_total", job_id=JOB, phase="eval") == 1
    assert figures(dog)["learned_budgets_seconds"] == {"eval": pytest.approx(12, abs=0.05)}
    assert figures(dog)["phases"]["eval"]["budget_killing_none_seconds"] == pytest.approx(8.5, abs=0.05)
    step(registry, r, 2, clock)
    phase(registry, r, "eval", "start", clock, timeout=5)
    dog.tick()
    assert dog.timeout_for(r) == pytest.approx(12, abs=0.05)  # its own 5 s budget, raised for this job
    clock.advance(8)
    dog.tick()
    assert dog.rank_state(r) == "suspect"


async def test_a_deadline_that_grows_without_progress_is_no_false_alarm(observe, clock, spawn):
    """Two ranks stall; one comes back (the job learns 18 s), the other's deadline grows past its
    age: it turns suspect, but it did not progress."""
    _, registry, dog, pid = observe
    a, b = register(registry, pid, rank=0), register(registry, spawn().pid, rank=1)
    step(registry, a, 1, clock)
    step(registry, b, 1, clock)
    dog.tick()
    clock.advance(11)
    dog.tick()
    assert dog.rank_state(a) == dog.rank_state(b) == "stalled"
    clock.advance(1)
    step(registry, a, 2, clock)
    dog.tick()
    assert dog.rank_state(b) == "suspect"
    assert figures(dog)["false_alarms"] == 1
    clock.advance(7)
    dog.tick()
    assert dog.rank_state(b) == "stalled"
    step(registry, b, 2, clock)  # now it comes back: 19 s
    dog.tick()
    assert figures(dog)["false_alarms"] == 2
    assert figures(dog)["phases"]["steps"]["longest_pause_seconds"] == pytest.approx(19, abs=0.05)


async def test_a_rank_that_progresses_while_its_kill_is_under_way_is_no_false_alarm(tmp_path, clock, spawn):
    s = make_settings(tmp_path, WATCHDOG)
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=clock)
    r = register(registry, spawn().pid)
    step(registry, r, 1, clock)
    dog.tick()
    clock.advance(11)
    dog.tick()
    assert dog._episodes[JOB].outcome == "pending"  # remediating (its task has not run: no await)
    step(registry, r, 2, clock)
    dog.tick()
    await dog.close()  # cancelled before it signalled anything
    assert JOB not in dog.status()["shadow"] or dog.status()["shadow"][JOB]["false_alarms"] == 0
    assert value(dog, "sidecar_watchdog_false_alarms_total", job_id=JOB, phase="steps") is None


@pytest.mark.parametrize("allowed", [True, False])
async def test_a_job_may_ask_for_observe_only_at_registration_unless_the_node_forbids_it(
    tmp_path, clock, spawn, allowed
):
    s = make_settings(tmp_path, WATCHDOG, **{"watchdog.allow_job_observe_only": allowed})
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=clock)
    pid = spawn().pid
    reg = Registration(job_id=JOB, rank=0, local_rank=0, world_size=1, local_world_size=1, pid=pid, observe_only=True)
    r = registry.register(reg, pid_start_time=procs.start_time(pid), peer_verified=True)
    other = register(registry, spawn().pid, job="other")  # another job of the node: its own mode
    assert r.observe_only is allowed
    step(registry, r, 1, clock)
    step(registry, other, 1, clock)
    dog.tick()
    clock.advance(11)
    dog.tick()
    episode = dog._episodes[JOB]
    try:
        assert (episode.outcome == "observe_only") is allowed
        assert episode.incident.observe_only is allowed
        assert figures(dog)["would_kill"] == (1 if allowed else 0)
        assert dog._episodes["other"].outcome == "pending"  # the node enforces; only the asking job is spared
    finally:
        await dog.close()  # the kills never ran


@pytest.mark.filterwarnings("ignore::pytest.PytestWarning")
def test_learned_budgets_live_as_long_as_the_job_is_known(tmp_path):
    s = make_settings(tmp_path, WATCHDOG)
    t = Timeouts(s.watchdog)
    assert t.learn("a", "steps", 12) == 18 and t.learn("a", "steps", 4) == 18  # never lowered
    assert t.learn("b", "eval", 1000) == 100  # the ceiling
    t.keep_jobs({"b"})
    assert t.learned("a") == {} and t.learned("b") == {"eval": 100}
    assert t.learn("b", "steps", 10, owner_uid=1000) == 15  # the job_id passed to another user: anew
    assert t.learned("b", 1000) == {"steps": 15} and t.learned("b") == {}


@pytest.mark.filterwarnings("ignore::pytest.PytestWarning")
def test_a_job_id_reused_by_another_uid_shows_none_of_the_first_owner_s_learned_budgets(tmp_path):
    """/v1/status (watchdog.shadow) shows the budgets the job's current owner taught it: once the
    job_id's ranks are another uid's, none of the first owner's."""
    s = make_settings(tmp_path, WATCHDOG)
    shadow = Shadow(s, Timeouts(s.watchdog))

    def rank(uid: int, progress: float) -> Rank:
        return Rank(JOB, 0, 0, 1, 1, pid=1, pid_start_time=None, owner_uid=uid, step=1, last_progress=progress)

    first = rank(1000, 100.0)
    shadow.stalled(first)
    first.last_progress = 112.0
    assert shadow.resumed(first, killing=False) is not None  # a false alarm of 12 s: 18 s learned
    assert shadow.status()[JOB]["learned_budgets_seconds"] == {"steps": 18}
    second = rank(2000, 200.0)  # the job_id passed to uid 2000
    shadow.stalled(second)
    assert shadow.status()[JOB]["learned_budgets_seconds"] == {}
    second.last_progress = 204.0
    note = shadow.resumed(second, killing=False)
    assert note is not None and "is now at least 6.0s" in note  # learned anew, not "stays at least 18.0s"
    assert shadow.status()[JOB]["learned_budgets_seconds"] == {"steps": 6}
