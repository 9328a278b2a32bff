"""The rank registry: what a push does to a rank, and the bounds that keep it small."""

from __future__ import annotations

import math

import pytest

from sidecar.ranks.errors import LimitExceeded, RankTaken, StepNotIncreasing, UnknownRank
from sidecar.ranks.protocol import EventItem, PhaseItem, Push, Registration, StepItem
from sidecar.ranks.registry import Registry
from tests.support import make_settings

T0 = 1_800_000_000.0  # the rank's wall clock at its first step


@pytest.fixture
def registry(tmp_path) -> Registry:
    return Registry(
        make_settings(
            tmp_path,
            limits__max_jobs=3,
            limits__max_custom_metrics=2,
            limits__max_phases=1,
            limits__max_ranks_per_job=4,
            watchdog__window=5,
        )
    )


def register(registry: Registry, job: str = "j", rank: int = 0, pid: int = 100, **kw):
    reg = Registration(job_id=job, rank=rank, local_rank=0, world_size=8, local_world_size=1, pid=pid, **kw)
    return registry.register(reg, pid_start_time=None, peer_verified=True)


def push(registry: Registry, *items, job: str = "j", rank: int = 0, pid: int = 100, dropped: int = 0) -> int:
    return registry.apply_push(Push(job, rank, pid, dropped, list(items)), now_mono=1e6, now_wall=T0 + 1e3)


def test_rates_are_derived_from_step_times_when_not_sent(registry):
    r = register(registry)
    push(
        registry,
        StepItem(1, T0, {"samples": 64, "tokens": 32768}),
        StepItem(2, T0 + 0.5, {"samples": 64, "tokens": 32768}),
    )
    assert r.metrics["step_time_seconds"] == 0.5
    assert r.metrics["iterations_per_second"] == 2.0
    assert r.metrics["samples_per_second"] == 128.0
    assert r.metrics["tokens_per_second"] == 65536.0


def test_rates_sent_by_the_rank_win(registry):
    r = register(registry)
    push(registry, StepItem(1, T0, {"step_time_seconds": 0.25, "iterations_per_second": 3.0, "samples": 8}))
    assert r.metrics["iterations_per_second"] == 3.0 and r.metrics["samples_per_second"] == 32.0


def test_step_times_skip_intervals_that_overlapped_a_phase(registry):
    r = register(registry)
    push(
        registry,
        StepItem(1, T0, {}),
        StepItem(2, T0 + 1, {}),
        PhaseItem("checkpoint_save", "start", T0 + 1.1),
        PhaseItem("checkpoint_save", "end", T0 + 30),
        StepItem(3, T0 + 31, {}),
        StepItem(4, T0 + 32, {}),
    )
    assert list(r.step_times) == [1.0, 1.0]


def test_step_times_are_per_step_when_reports_skip_steps(registry):
    r = register(registry)
    push(registry, StepItem(10, T0, {}), StepItem(20, T0 + 5, {}))
    assert list(r.step_times) == [0.5]


def test_step_times_keep_the_configured_window(registry):
    r = register(registry)
    push(registry, *(StepItem(i, T0 + i, {}) for i in range(1, 20)))
    assert len(r.step_times) == 5


def test_steps_must_increase_and_a_refused_push_changes_nothing(registry):
    r = register(registry)
    push(registry, StepItem(5, T0, {"loss": 1.0}))
    with pytest.raises(StepNotIncreasing, match=r"items\[1\]\.step: 5 is not greater than the previous step 6"):
        push(registry, StepItem(6, T0 + 1, {"loss": 2.0}), StepItem(5, T0 + 2, {}))
    assert r.step == 5 and r.metrics["loss"] == 1.0 and r.records == 1


def test_phases_nest_and_end_by_name(registry):
    r = register(registry)
    push(registry, PhaseItem("eval", "start", T0, 120.0), PhaseItem("compile", "start", T0 + 1))
    assert (r.phase, r.phase_timeout) == ("compile", None)
    push(registry, PhaseItem("compile", "end", T0 + 2))
    assert (r.phase, r.phase_timeout) == ("eval", 120.0)
    push(registry, PhaseItem("eval", "end", T0 + 3))
    assert r.phase is None and r.phase_started is None


def test_non_finite_values_are_counted_per_metric(registry):
    r = register(registry)
    push(registry, StepItem(1, T0, {"loss": math.nan}), StepItem(2, T0 + 1, {"loss": math.inf, "grad_norm": 1.0}))
    assert r.nonfinite == {"loss": 2} and math.isinf(r.metrics["loss"])


def test_checkpoint_saved_event_records_step_and_time(registry):
    r = register(registry)
    push(registry, EventItem("checkpoint_saved", T0 + 9, {"step": 17, "path": "/ckpt/step-17"}))
    assert (r.last_checkpoint_step, r.last_checkpoint_time) == (17, T0 + 9)


def test_a_batch_sent_again_repeats_no_checkpoint_and_opens_no_phase_twice(registry):
    """The hooks send an unanswered batch's events and phases again (trainer_hooks/sender.py); a
    sidecar that did take it, only too late to answer, sees them twice, on the rank's record kept
    across its re-registration from the same process."""
    r = register(registry)
    push(registry, EventItem("checkpoint_saved", T0 + 5, {"step": 16, "path": "/c/16"}))
    again = register(registry)  # the hooks re-register: their batch went unanswered (nothing of it acknowledged)
    assert again is not r and list(again.checkpoints) == [(16, "/c/16", T0 + 5)]  # kept: the same process
    batch = [EventItem("checkpoint_saved", T0 + 9, {"step": 17, "path": "/c/17"}), PhaseItem("eval", "start", T0 + 9)]
    push(registry, *batch)  # the unanswered batch, taken late
    push(registry, *batch)  # ... and sent again
    assert [c[0] for c in again.checkpoints] == [16, 17]
    push(registry, PhaseItem("eval", "end", T0 + 10))
    assert again.phase is None  # one end closes it: the repeated start was taken as the same one


def test_dropped_is_the_hooks_running_count(registry):
    r = register(registry)
    push(registry, dropped=7)
    push(registry, dropped=3)  # an older batch arriving late never lowers it
    assert r.dropped == 7


def test_a_push_from_another_pid_is_an_unknown_rank(registry):
    register(registry, pid=100)
    with pytest.raises(UnknownRank, match="registered by pid 100, not 999"):
        push(registry, StepItem(1, T0, {}), pid=999)


def test_re_registration_replaces_the_rank_and_resumes_its_step(registry):
    old = register(registry)
    push(registry, StepItem(40, T0, {}))
    new = register(registry, pid=200, step=40, restart_count=1)
    assert registry.get("j", 0) is new and new is not old and new.step == 40
    with pytest.raises(StepNotIncreasing):
        push(registry, StepItem(40, T0 + 1, {}), pid=200)


def test_jobs_are_bounded_but_a_finished_job_makes_room(registry):
    for job in ("a", "b", "c"):
        register(registry, job=job)
    with pytest.raises(LimitExceeded, match="limits.max_jobs is 3"):
        register(registry, job="d")
    registry.mark_gone(("a", 0), "finished")
    register(registry, job="d")
    assert sorted(registry.jobs()) == ["b", "c", "d"]


def test_ranks_per_job_are_bounded(registry):
    for rank in range(4):
        register(registry, rank=rank)
    with pytest.raises(LimitExceeded, match="limits.max_ranks_per_job is 4"):
        register(registry, rank=4)


def test_custom_metric_names_are_bounded_per_job(registry):
    register(registry)
    push(registry, StepItem(1, T0, {"a": 1.0, "b": 2.0, "loss": 1.0}))
    with pytest.raises(LimitExceeded, match=r"items\[0\]\.metrics\.c: .*limits.max_custom_metrics is 2"):
        push(registry, StepItem(2, T0 + 1, {"a": 1.0, "c": 3.0}))
    push(registry, StepItem(2, T0 + 1, {"a": 5.0}))  # known names still flow
    assert registry.get("j", 0).custom == {"a": 5.0, "b": 2.0}


def test_phase_names_beyond_the_well_known_are_bounded(registry):
    register(registry)
    push(registry, PhaseItem("warmup", "start", T0), PhaseItem("eval", "start", T0))
    with pytest.raises(LimitExceeded, match="limits.max_phases is 1"):
        push(registry, PhaseItem("profiling", "start", T0))


def test_gone_ranks_are_dropped_after_retention(registry):
    register(registry)
    registry.mark_gone(("j", 0), "exited")
    r = registry.get("j", 0)
    assert r.gone and r.gone_reason == "exited"
    assert registry.sweep(now=r.gone_at + 1) == 0
    assert registry.sweep(now=r.gone_at + registry.settings.limits.gone_retention_seconds + 1) == 1
    assert registry.ranks() == []


def test_versions_by_job_merge_the_ranks_reports(registry):
    register(registry, versions={"torch": "2.13.0"})
    register(registry, rank=1, versions={"nccl": "2.27.3"})
    assert registry.versions_by_job() == {"j": {"torch": "2.13.0", "nccl": "2.27.3"}}


def test_a_rank_held_by_a_live_process_of_the_same_attempt_is_not_taken_over(tmp_path):
    """The rank_taken rule is the registry's; whether the holder still runs is asked of the
    injected `alive`."""
    running = {100}
    registry = Registry(make_settings(tmp_path), alive=lambda pid, start: pid in running)
    register(registry, pid=100)
    with pytest.raises(RankTaken, match="held by pid 100, still running at restart 0"):
        register(registry, pid=200)
    assert register(registry, pid=200, restart_count=1).pid == 200  # a restarted worker replaces it
    running.clear()
    assert register(registry, pid=300, restart_count=1).pid == 300  # so does anyone, once the holder is dead
