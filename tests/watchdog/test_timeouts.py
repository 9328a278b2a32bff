"""The adaptive training-step timeout: multiplier x quantile of recent step times, clamped."""
from __future__ import annotations

import pytest

from sidecar.registry import Registry
from sidecar.watchdog import Watchdog, quantile
from tests.watchdog.conftest import register, settings, step


def dog(tmp_path, **kw) -> Watchdog:
    s = settings(tmp_path, **kw)
    return Watchdog(s, Registry(s))


def test_without_step_history_the_timeout_is_the_floor(tmp_path):
    assert dog(tmp_path).step_timeout([]) == 10


def test_the_timeout_is_multiplier_times_the_quantile(tmp_path):
    d = dog(tmp_path, **{"watchdog.multiplier": 4, "watchdog.quantile": 0.5})
    assert d.step_timeout([3.0, 4.0, 5.0]) == 16


def test_short_steps_are_clamped_to_the_floor(tmp_path):
    assert dog(tmp_path).step_timeout([0.01] * 50) == 10


def test_long_steps_are_clamped_to_the_ceiling(tmp_path):
    assert dog(tmp_path).step_timeout([60.0] * 50) == 100


def test_the_quantile_follows_the_recent_window_only(tmp_path):
    d = dog(tmp_path, **{"watchdog.window": 3, "watchdog.multiplier": 2, "watchdog.quantile": 1})
    assert d.step_timeout([50.0, 6.0, 6.0, 7.0]) == 14


def test_quantile_is_nearest_rank_and_ignores_non_finite_values():
    assert quantile([1, 2, 3, 4], 0.5) == 2
    assert quantile([1, float("nan"), 9], 0.99) == 9
    assert quantile([], 0.9) is None


def test_a_rank_s_timeout_follows_its_reported_steps(tmp_path, clock, spawn):
    s = settings(tmp_path, **{"watchdog.multiplier": 5, "watchdog.quantile": 1})
    registry = Registry(s)
    d = Watchdog(s, registry, clock=clock)
    r = register(registry, spawn().pid)
    for n in range(1, 6):
        step(registry, r, n, clock)
        clock.advance(3.0)
    assert d.timeout_for(r) == pytest.approx(15)
