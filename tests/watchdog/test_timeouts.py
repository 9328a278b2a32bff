"""The adaptive training-step timeout: multiplier x quantile of recent step times, clamped."""

from __future__ import annotations

import pytest

from sidecar.ranks.registry import Registry
from sidecar.watchdog.machine import Watchdog
from sidecar.watchdog.timeouts import Timeouts, quantile
from tests.support import make_settings
from tests.watchdog.helpers import WATCHDOG, register, step


def policy(tmp_path, **kw) -> Timeouts:
    return Timeouts(make_settings(tmp_path, WATCHDOG, **kw).watchdog)


def test_without_step_history_the_timeout_is_the_floor(tmp_path):
    assert policy(tmp_path).step_timeout([]) == 10


def test_the_timeout_is_multiplier_times_the_quantile(tmp_path):
    d = policy(tmp_path, **{"watchdog.multiplier": 4, "watchdog.quantile": 0.5})
    assert d.step_timeout([3.0, 4.0, 5.0]) == 16


def test_short_steps_are_clamped_to_the_floor(tmp_path):
    assert policy(tmp_path).step_timeout([0.01] * 50) == 10


def test_long_steps_are_clamped_to_the_ceiling(tmp_path):
    assert policy(tmp_path).step_timeout([60.0] * 50) == 100


def test_the_quantile_follows_the_recent_window_only(tmp_path):
    d = policy(tmp_path, **{"watchdog.window": 3, "watchdog.multiplier": 2, "watchdog.quantile": 1})
    assert d.step_timeout([50.0, 6.0, 6.0, 7.0]) == 14


def test_quantile_is_nearest_rank_and_ignores_non_finite_values():
    assert quantile([1, 2, 3, 4], 0.5) == 2
    assert quantile([1, float("nan"), 9], 0.99) == 9
    assert quantile([], 0.9) is None


def test_a_rank_s_timeout_follows_its_reported_steps(tmp_path, clock, spawn):
    s = make_settings(tmp_path, WATCHDOG, **{"watchdog.multiplier": 5, "watchdog.quantile": 1})
    registry = Registry(s)
    d = Watchdog(s, registry, clock=clock)
    r = register(registry, spawn().pid)
    for n in range(1, 6):
        step(registry, r, n, clock)
        clock.advance(3.0)
    assert d.timeout_for(r) == pytest.approx(15)


def test_before_any_interval_the_reported_step_time_stands_in(tmp_path):
    """A first step slower than the floor must not make the second one look like a stall."""
    assert policy(tmp_path).step_timeout([], last_step_time=4.0) == 32
    assert policy(tmp_path).step_timeout([], last_step_time=float("nan")) == 10


def test_a_slow_first_step_does_not_stall_the_second(tmp_path, clock, spawn):
    s = make_settings(tmp_path, WATCHDOG)
    registry = Registry(s)
    d = Watchdog(s, registry, clock=clock)
    r = register(registry, spawn().pid)
    clock.advance(5.0)
    step(registry, r, 1, clock, step_time=5.0)
    clock.advance(12.0)
    assert d.deadline(r).timeout == 40 and d.deadline(r).age == pytest.approx(12)


def test_the_age_runs_from_the_ranks_own_progress_or_from_when_it_could_last_have_stepped(tmp_path):
    """Issue 29, item 0. Hooks of protocol 6 push at least every push gap and send a pause's end at
    once: while they push, the rank's own last step is its progress; once they stop (a frozen
    process), steps it made after its last push may never have been sent, so its progress is taken
    to have lasted until its last push plus the gap: declared at most a gap late, never early.
    Hooks that promise nothing (older ones) keep the plain age."""
    from sidecar.ranks.model import Rank

    t = Timeouts(make_settings(tmp_path, WATCHDOG).watchdog, push_gap=2.5)
    r = Rank("j", 0, 0, 1, 1, pid=1, pid_start_time=None, pushes_promised=True)
    r.last_progress, r.contact_at, r.step = 100.0, 101.9, 5  # its last step at 100, a push at 101.9
    assert t.progress_horizon(r, 104.0) == 100.0  # it pushed 2.1 s ago: no step since 100
    assert t.deadline(r, 104.0).age == pytest.approx(4.0)
    assert t.progress_horizon(r, 105.0) == pytest.approx(104.4)  # silent past the gap: it may have stepped
    assert t.deadline(r, 110.0).age == pytest.approx(5.6)
    r.pushes_promised, r.contact_at = False, None  # older hooks: nothing is known of their pushes
    assert t.deadline(r, 110.0).age == pytest.approx(10.0)


def test_a_job_id_reused_by_another_uid_shows_none_of_the_first_owner_s_learned_budgets(tmp_path):
    """`learned` respects the owner as `deadline` does: what uid 1000 taught the job is not uid 2000's."""
    t = policy(tmp_path)
    t.learn("job", "eval", 40, owner_uid=1000)
    t.learn("job", "steps", 12, owner_uid=1000)
    assert t.learned("job", 1000) == {"eval": 60, "steps": 18}
    assert t.learned("job", 2000) == {} and t.learned("job") == {}
    t.learn("job", "steps", 4, owner_uid=2000)  # the new owner learns anew
    assert t.learned("job", 2000) == {"steps": 6} and t.learned("job", 1000) == {}
