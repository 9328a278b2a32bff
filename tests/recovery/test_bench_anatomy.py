"""bench_recovery takes each recovery apart from the sidecar's incident and the trainer's start-up
milestones; a restart quicker than the sidecar's look at the exits must not borrow the next
recovery's milestones (it did: one hang showed a 60 s restart and -60 s of imports)."""

from __future__ import annotations

from bench.bench_recovery import anatomy
from harness.job import LogEvent


def startup(t: float, milestone: str, **fields) -> LogEvent:
    return LogEvent("startup", t, {"milestone": milestone, "t": t, **fields})


def incident(detected: float, sigterm: float, gone: float) -> dict:
    return {
        "time": detected,
        "timeline": [{"event": "sigterm", "time": sigterm}, {"event": "exit_observed", "time": gone}],
    }


def test_a_restart_started_before_the_sidecar_saw_the_ranks_gone_is_this_recoverys():
    this = [
        startup(106.10, "process_started"),
        startup(106.17, "imports_done"),
        startup(106.21, "process_group_formed"),
        startup(106.23, "model_built"),
        startup(106.25, "checkpoint_loaded", step=50, source="memory"),
        startup(106.37, "first_step", step=51),
    ]
    the_next = [startup(166.0 + i, m) for i, m in enumerate(("process_started", "imports_done", "first_step"))]

    a = anatomy(100.0, 50, incident(105.0, 106.0, 106.2), this + the_next)

    assert a.points["process_started"] == 106.10 and a.points["first_step"] == 106.37
    assert a.points["ranks_gone"] == 106.10  # gone by the time their successors started
    assert round(a.stage("kill"), 2) == 0.10 and a.stage("restart") == 0.0
    assert round(a.stage("imports"), 2) == 0.07
    assert (a.resumed_step, a.source, a.redone_steps) == (50, "memory", 0)
