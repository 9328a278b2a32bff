"""Goodput, live (sidecar/watchdog/goodput.py) and where a recovery's time goes
(sidecar/watchdog/recovery.py): each job's wall time classified when the job progresses, and
the stages of a recovery from the incident's timeline and the next attempt's ranks."""

from __future__ import annotations

from sidecar.incidents.store import Incident, RankSnapshot
from sidecar.ranks.model import Rank
from sidecar.ranks.protocol import EventItem, StepItem
from sidecar.watchdog.goodput import Goodput
from sidecar.watchdog.recovery import Recoveries


def rank(r: int, step: int | None, at: float, job: str = "j1", registered: float = 0.0) -> Rank:
    x = Rank(job_id=job, rank=r, local_rank=r, world_size=2, local_world_size=2, pid=1000 + r, pid_start_time=1.0)
    x.registered_wall = registered
    if step is not None:
        x.apply_step(StepItem(step, at, {}), now_mono=x.registered_at, now_wall=at)
    return x


def test_steady_progress_is_productive():
    g = Goodput()
    g.tick({"j1": [rank(0, 1, 100.0), rank(1, 1, 100.0)]})
    g.tick({"j1": [rank(0, 11, 110.0), rank(1, 11, 110.5)]})
    assert g._jobs["j1"].seconds["productive"] == 10.5 and g.ratio("j1") == 1.0


def test_a_stall_and_its_recovery_split_at_the_detection_then_redone_steps_until_the_old_step():
    g = Goodput()
    g.tick({"j1": [rank(0, 100, 1000.0)]})
    g.tick({"j1": [rank(0, 200, 1100.0)]})  # 100 s productive
    g.stalled("j1", 1130.0)  # hung at 1100, detected 30 s later
    g.tick({"j1": [rank(0, None, 0.0, registered=1140.0)]})  # restarted, no step yet: nothing classified
    g.tick({"j1": [rank(0, 151, 1150.0)]})  # resumed from checkpoint 150
    g.tick({"j1": [rank(0, 200, 1175.0)]})  # steps 151..200 again
    g.tick({"j1": [rank(0, 220, 1185.0)]})  # new ground
    s = g._jobs["j1"].seconds
    assert (s["productive"], s["stalled"], s["recovering"], s["redone"]) == (110.0, 30.0, 20.0, 25.0)
    assert g.ratio("j1") == 110.0 / 185.0


def test_a_slow_step_without_a_detected_stall_stays_productive():
    g = Goodput()
    g.tick({"j1": [rank(0, 1, 10.0)]})
    g.tick({"j1": [rank(0, 2, 25.0)]})
    assert g._jobs["j1"].seconds["stalled"] == 0.0 and g._jobs["j1"].seconds["productive"] == 15.0


def incident() -> Incident:
    inc = Incident(
        id="i1", time=1005.0, job_id="j1", node="n1", blamed_rank=1, blame_reason="", timeout_seconds=5.0,
        observe_only=False,
        ranks=[RankSnapshot(1, 1, 1001, "stalled", 200, None, 5.0, 5.0), RankSnapshot(0, 0, 1000, "stalled", 200,
               None, 4.5, 5.0)],
    )  # fmt: skip
    inc.event("dumps_received", at=1005.5)
    inc.event("sigterm", at=1006.0)
    inc.event("exit_observed", at=1006.2)
    return inc


def test_a_recovery_is_followed_stage_by_stage_and_unknown_stages_stay_unknown():
    saved = []
    rec = Recoveries(saved.append, wall=lambda: 1020.0, boot_time=1000.0)
    inc = incident()
    rec.start(inc, [], hang_step=200, step_time=0.1)
    new = rank(0, None, 0.0, registered=1008.5)
    new.pid_start_time = 8.0  # started at 1008.0, 8 s after boot
    new.apply_event(EventItem("checkpoint_loaded", 1011.0, {"step": 150}))
    rec.tick({"j1": [new]})
    assert inc.recovery is not None and inc.recovery["stages_seconds"]["rendezvous"] is None  # no event: unknown
    new.apply_step(StepItem(151, 1012.0, {}), now_mono=new.registered_at, now_wall=1012.0)
    new.apply_step(StepItem(200, 1017.0, {}), now_mono=new.registered_at, now_wall=1017.0)
    rec.tick({"j1": [new]})
    r = inc.recovery
    assert r["stages_seconds"] == {
        "detect": 5.0, "dump": 0.5, "decide": 0.5, "kill": 0.2, "restart": 1.8, "rendezvous": None, "load": None,
        "first_step": 1.0, "redo": 5.0,
    }  # fmt: skip
    assert r["hang_to_training_seconds"] == 12.0 and r["steps_redone"] == 50 and r["complete"]
    assert rec.histograms["detect"][2] == 1 and "rendezvous" not in rec.histograms
    assert "recovery  hang -> training again 12.00s" in inc.text()


def test_ranks_seen_gone_after_their_successors_started_count_as_gone_when_those_started():
    saved = []
    rec = Recoveries(saved.append, wall=lambda: 1020.0, boot_time=1000.0)
    inc = incident()  # SIGTERM at 1006.0, the exit seen at 1006.2
    rec.start(inc, [], hang_step=200, step_time=0.1)
    new = rank(0, None, 0.0, registered=1006.3)
    new.pid_start_time = 6.1  # the launcher restarted it at 1006.1, before the sidecar looked again
    rec.tick({"j1": [new]})
    assert inc.recovery is not None
    assert inc.recovery["milestones"]["ranks_gone"] == 1006.1
    stages = inc.recovery["stages_seconds"]
    assert (stages["kill"], stages["restart"]) == (0.1, 0.0)  # known, not left unknown as a negative span
