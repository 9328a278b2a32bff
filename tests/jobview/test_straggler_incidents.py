"""Straggler incidents (sidecar/jobview/straggler_incidents.py): one incident of kind `straggler`
per episode of a local rank being named its job's straggler, opened, updated and closed with a fake
clock over the judgements `/v1/status` shows; none for a healthy job; and, with a real sidecar and
real rank processes, the incident written and listed while nothing is signalled."""

from __future__ import annotations

import json
import time

import pytest

from sidecar.incidents.store import IncidentStore, load_incidents
from sidecar.jobview import stragglers
from sidecar.jobview.straggler_incidents import CLOSE_AFTER_SECONDS, StragglerIncidents
from sidecar.ranks.collectives import parse_collectives
from sidecar.ranks.lateness import Tracker
from sidecar.ranks.model import Rank
from tests.ops.helpers import Rank as LiveRank
from tests.ops.helpers import post, run_cli
from tests.support import Sidecar, wait_until

T0 = 1_800_000_000.0
STEP = 0.4  # 16 collectives span 6 s: lateness.CONFIRM_SECONDS


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def judged(job_id: str, *named: tuple[int, float], by: str = "node", on: str = "node-0", node: str = "node-0"):
    return {"job_id": job_id, "judged_by": by, "judged_on": on, "ranks_judged": 2,
            "stragglers": [{"rank": r, "node": node, "lateness_seconds": late, "pg": "0", "interval_seconds": STEP,
                            "threshold_seconds": 0.0375} for r, late in named]}  # fmt: skip


LOCAL = {("job", 0), ("job", 1)}


@pytest.fixture
def watched(tmp_path):
    clock = Clock()
    store = IncidentStore(tmp_path, node="node-0")
    return store, clock, StragglerIncidents(store, clock=clock, wall=lambda: T0 + clock.now)


def look(incidents: StragglerIncidents, judgements: list[dict], local=LOCAL) -> list:
    changed = incidents.observe(judgements, local)
    for incident in changed:
        incidents.store.save(incident)
    return changed


def test_one_episode_is_opened_once_updated_while_named_and_closed_after_a_minute_unnamed(watched):
    store, clock, incidents = watched
    assert [i.blamed_rank for i in look(incidents, [judged("job", (1, 0.1))])] == [1]
    first = store.recent[-1]
    for late in (0.12, 0.09, 0.11):  # a minute of looks: the same incident, its lateness followed
        clock.now += 10
        look(incidents, [judged("job", (1, late))])
    clock.now += 30
    look(incidents, [judged("job")])  # not named for 30 s: a lateness at the threshold, still one episode
    clock.now += 20
    look(incidents, [judged("job", (1, 0.1))])
    assert len(store.recent) == 1 and first.ended is None and first.outcome == "straggler"
    assert first.straggler["lateness_seconds"] == 0.1 and first.straggler["max_lateness_seconds"] == 0.12
    clock.now += CLOSE_AFTER_SECONDS - 1
    assert look(incidents, [judged("job")]) == [] and first.ended is None
    clock.now += 1
    assert look(incidents, [judged("job")]) == [first]
    assert first.outcome == "recovered" and first.ended == T0 + clock.now and first.started == T0 + 1000.0
    assert [e["event"] for e in first.timeline] == ["detected", "recovered"]
    (record,) = load_incidents(store.diag_dir)
    assert record["kind"] == "straggler" and record["ended"] == first.ended and record["blamed_rank"] == 1
    assert "never killed" in record["summary"] and "recovered after" in record["summary"]
    clock.now += 10
    look(incidents, [judged("job", (1, 0.1))])  # named again later: a new episode
    assert len(store.recent) == 2 and store.recent[-1] is not first


def test_an_open_episode_is_written_on_a_change_of_judge_and_at_most_once_a_minute_otherwise(watched):
    store, clock, incidents = watched
    look(incidents, [judged("job", (1, 0.1))])
    clock.now += 10
    assert look(incidents, [judged("job", (1, 0.1))]) == []
    clock.now += 10  # the coordinator's judgement (listed first by stragglers.status) wins over the node's
    (changed,) = look(incidents, [judged("job", (1, 0.105), by="coordinator"), judged("job", (1, 0.1))])
    assert changed.straggler["judged_by"] == "coordinator" and changed.straggler["lateness_seconds"] == 0.105
    assert [e["event"] for e in changed.timeline] == ["detected", "judged_again"]
    clock.now += 30
    assert look(incidents, [judged("job", (1, 0.1), by="coordinator")]) == []
    clock.now += 30
    assert look(incidents, [judged("job", (1, 0.1), by="coordinator")]) == [changed]
    assert json.loads(open(changed.path).read())["straggler"]["judged_by"] == "coordinator"


def test_a_straggler_on_another_node_opens_no_incident_here(watched):
    store, _, incidents = watched
    look(incidents, [judged("job", (5, 0.1), by="coordinator", node="node-2")])
    assert store.recent == [] and not (store.directory.exists() and any(store.directory.iterdir()))


def _rank(rank: int, delay: float, job: str = "job") -> Rank:
    r = Rank(job_id=job, rank=rank, local_rank=rank, world_size=2, local_world_size=2, pid=1000 + rank,
             pid_start_time=1.0)  # fmt: skip
    seqs = range(1, 33)
    group = {"pg": "0", "desc": "", "size": 2, "ranks": [0, 1], "enqueued": 32, "started": -1, "completed": 32,
             "pending": [], "recent": [[s, T0 + s * STEP + delay] for s in seqs]}  # fmt: skip
    r.take_collectives(parse_collectives({"time": T0 + 10, "groups": [group]}), None, 0.0)
    return r


def test_a_healthy_job_judged_by_this_node_opens_no_incident_and_a_late_rank_does(watched):
    store, clock, incidents = watched
    healthy = [_rank(0, 0.0), _rank(1, 0.002)]
    for _ in range(12):  # two minutes of looks
        look(incidents, stragglers.status("node-0", healthy, lambda j: None, lambda j: None, Tracker()), LOCAL)
        clock.now += 10
    assert store.recent == []
    slow = [_rank(0, 0.0), _rank(1, 0.1)]
    look(incidents, stragglers.status("node-0", slow, lambda j: None, lambda j: None, Tracker()), LOCAL)
    (opened,) = store.recent
    assert (opened.blamed_rank, opened.blamed_node, opened.straggler["judged_by"]) == (1, "node-0", "node")
    assert opened.straggler["lateness_seconds"] == pytest.approx(0.1, abs=1e-3)


def test_a_real_sidecar_writes_the_incident_lists_it_and_signals_no_rank(tmp_path):
    """Two ranks of one job on this node (real processes), rank 1 entering each collective 100 ms after
    rank 0; a second job's ranks enter together. The daemon opens one straggler incident, for rank 1
    of the slow job, `sidecar incidents` lists it, and both processes run on, healthy."""
    sidecar = Sidecar(tmp_path, "watchdog.floor_seconds=600").start()
    made = [LiveRank(sidecar, job, r) for job in ("slow-job", "even-job") for r in (0, 1)]
    try:
        now = time.time()
        for r in made:
            r.push_step()
            late = 0.1 * r.rank if r.job_id == "slow-job" else 0.0
            group = {"pg": "0", "desc": "default_pg", "size": 2, "ranks": [0, 1], "enqueued": 32, "started": -1,
                     "completed": 32, "pending": [],
                     "recent": [[s, now - 10 + s * 0.25 + late] for s in range(1, 33)]}  # fmt: skip
            body = {"job_id": r.job_id, "rank": r.rank, "pid": r.proc.pid, "dropped": 0, "items": [],
                    "collectives": {"time": now, "groups": [group]}}  # fmt: skip
            status, answer = post(sidecar.socket, "/v1/push", body)
            assert status == 200, answer
        wait_until(lambda: any(i.get("kind") == "straggler" for i in sidecar.status()["incidents"]), timeout=20)
        time.sleep(0.5)
        out = run_cli("incidents", "--json", "--socket", sidecar.socket)
        assert out.returncode == 0, out.stdout + out.stderr
        found = [i for i in json.loads(out.stdout) if i.get("kind") == "straggler"]
        assert [(i["job_id"], i["blamed_rank"], i["outcome"]) for i in found] == [("slow-job", 1, "straggler")]
        assert found[0]["straggler"]["lateness_seconds"] == pytest.approx(0.1, abs=1e-3)
        # /v1/status names its cause with the evidence: its sleep process is not throttled, so `compute`
        # once its counters were read twice (`unknown` until then)
        named = [s for j in sidecar.status()["stragglers"] if j["job_id"] == "slow-job" for s in j["stragglers"]]
        assert named and all(s["cause"] in ("unknown", "compute") and s["cause_evidence"] for s in named), named
        # reported, never remediated
        assert {(r["job_id"], r["state"]) for r in sidecar.status()["ranks"]} == {
            ("slow-job", "healthy"),
            ("even-job", "healthy"),
        }
        assert all(r.proc.poll() is None for r in made)
    finally:
        for r in made:
            r.close()
        sidecar.stop()


def test_the_cause_found_on_its_node_is_kept_in_the_incident_and_shown_with_the_straggler(watched):
    from sidecar.commands import status_stragglers
    from sidecar.jobview.straggler_incidents import with_causes
    from sidecar.ranks.straggler_cause import Cause

    store, clock, incidents = watched
    found = {("job", 1): Cause("unknown", "CPU cgroup counters taken; throttling is judged from the next look")}
    look_with = lambda: incidents.observe([judged("job", (1, 0.1))], LOCAL, found.get)  # noqa: E731
    (opened,) = look_with()
    assert opened.straggler["cause"] == "unknown"
    clock.now += 5
    found[("job", 1)] = Cause("throttled", "CPU cgroup throttled 2.00 s in 5 s (40 of 50 periods)")
    assert look_with() == [opened]  # a new cause is written at once
    assert opened.straggler["cause"] == "throttled" and "throttled 2.00 s" in opened.straggler["cause_evidence"]
    assert [e["event"] for e in opened.timeline] == ["detected", "cause"]
    assert "cause throttled" in opened.summary and "cause     throttled (CPU cgroup" in opened.text()
    shown = with_causes([judged("job", (1, 0.1)), judged("other", (1, 0.1))], store.recent)
    assert [s.get("cause") for j in shown for s in j["stragglers"]] == ["throttled", None]
    rows = status_stragglers.rows({"stragglers": shown})
    assert [row[-1][0] for row in rows] == ["throttled", "-"]
    assert len(status_stragglers.COLUMNS) == len(rows[0])


def test_opt_in_a_straggler_with_a_hardware_cause_for_long_enough_marks_the_node_and_a_cpu_quota_never(tmp_path):
    """`job_view.straggler_exclude_after_seconds` (issue 30, item 4): a GPU's clocks held down for the
    set time make a node fitness finding `straggler` (so `sidecar status --check node` answers unfit),
    held for the set time after the episode ends; a CPU quota (the job's setting) never does; off by
    default; a break in the hardware cause starts the count again."""
    from sidecar.fitness import Reason, judge
    from sidecar.ranks.straggler_cause import Cause

    hot = Cause("throttled", "GPU 0 clocks held down (hw_thermal_slowdown)", hardware=True)
    quota = Cause("throttled", "CPU cgroup throttled 2.00 s in 5 s (40 of 50 periods)")
    for exclude_after, cause, marks in ((0.0, hot, False), (60.0, quota, False), (60.0, hot, True)):
        clock = Clock()
        store = IncidentStore(tmp_path / f"{exclude_after}-{cause.hardware}", node="node-0")
        wall = lambda c=clock: T0 + c.now  # noqa: E731
        incidents = StragglerIncidents(store, clock=clock, wall=wall, exclude_after=exclude_after, exclude_hold=600.0)
        found = {("job", 1): cause}
        for _ in range(13):  # 120 s of looks, 10 s apart
            incidents.observe([judged("job", (1, 0.1))], LOCAL, found.get)
            clock.now += 10
        got = incidents.findings()
        assert bool(got) == marks, (exclude_after, cause, got)
        if not marks:
            continue
        (finding,) = got
        assert finding.reason is Reason.STRAGGLER and "rank 1" in finding.text and "hw_thermal_slowdown" in finding.text
        assert "leave this node out at the job's next restart" in finding.text
        assert judge(got).reasons == ["straggler"] and not judge(got).fit
        (incident,) = store.recent
        assert [e["event"] for e in incident.timeline] == ["detected", "cause", "marked_for_exclusion"]
        assert incident.straggler["hardware"] is True
        # the episode ends (the node left out names no straggler); the mark holds exclude_hold after
        clock.now += CLOSE_AFTER_SECONDS
        incidents.observe([judged("job")], LOCAL, found.get)
        assert incident.ended is not None and incidents.findings() == got
        clock.now += 599
        assert incidents.findings() == got
        clock.now += 1
        assert incidents.findings() == []


def test_a_break_in_the_hardware_cause_starts_the_count_again(tmp_path):
    from sidecar.ranks.straggler_cause import Cause

    clock = Clock()
    store = IncidentStore(tmp_path / "breaks", node="node-0")
    incidents = StragglerIncidents(store, clock=clock, wall=lambda: T0 + clock.now, exclude_after=60.0)
    hot = Cause("throttled", "GPU 0 clocks held down (sw_power_cap)", hardware=True)
    cool = Cause("compute", "CPU cgroup not throttled over 10 s; its GPUs' clocks not held down")
    for i in range(12):  # 110 s named, the GPU cool every fifth look: never 60 s of hardware cause in a row
        incidents.observe([judged("job", (1, 0.1))], LOCAL, {("job", 1): cool if i % 5 == 4 else hot}.get)
        clock.now += 10
    assert incidents.findings() == []
