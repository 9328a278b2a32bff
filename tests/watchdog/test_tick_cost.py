"""A watchdog tick's cost is bounded (issue 9, row 9): with thousands of ranks it looks up at
most LIVENESS_CHECKS_PER_TICK processes in /proc (in turn), plus the ranks about to turn
suspect or stalled, and the step timeout's quantile is computed once per new step."""

from __future__ import annotations

import os

from sidecar.ranks.registry import Registry
from sidecar.watchdog import machine as watchdog_module
from sidecar.watchdog.machine import LIVENESS_CHECKS_PER_TICK, RankState, Watchdog
from tests.support import make_settings
from tests.watchdog.helpers import WATCHDOG, phase, register, step


def counting_liveness(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = watchdog_module._process_alive

    def alive(rank):
        calls.append(rank.pid)
        return real(rank)

    monkeypatch.setattr(watchdog_module, "_process_alive", alive)
    return calls


MANY_RANKS = {"limits.max_ranks_per_job": 5000, "limits.max_ranks": 5000, "limits.max_ranks_per_user": 5000}


def test_a_tick_reads_proc_for_a_bounded_number_of_ranks(tmp_path, clock, monkeypatch):
    registry = Registry(make_settings(tmp_path, WATCHDOG, **MANY_RANKS))
    wd = Watchdog(registry.settings, registry, clock=clock)
    for rank in range(1000):
        register(registry, os.getpid(), rank=rank)
    calls = counting_liveness(monkeypatch)
    wd.tick()
    assert len(calls) == LIVENESS_CHECKS_PER_TICK
    for _ in range(1000 // LIVENESS_CHECKS_PER_TICK):
        wd.tick()
    assert len(calls) >= 1000  # everyone was looked at within a round of ticks


def test_a_dead_rank_past_its_deadline_is_gone_not_stalled_even_out_of_turn(tmp_path, clock, monkeypatch, spawn):
    registry = Registry(make_settings(tmp_path, WATCHDOG, **MANY_RANKS))
    wd = Watchdog(registry.settings, registry, clock=clock)
    for rank in range(200):  # in a long phase: they stay healthy
        phase(registry, register(registry, os.getpid(), rank=rank, job="filler"), "eval", "start", clock)
    proc = spawn()
    dead = register(registry, proc.pid, rank=0)
    step(registry, dead, 1, clock)
    wd.tick()
    proc.kill()
    proc.wait()
    wd._liveness_cursor = 0  # the dead rank (last registered) is out of this tick's turn
    clock.advance(registry.settings.watchdog.floor_seconds + 1)
    wd.tick()
    assert wd._tracks[dead.key].state is RankState.GONE
    assert not wd._episodes.get("job")


def test_the_step_timeout_is_computed_once_per_step(tmp_path, clock, monkeypatch):
    registry = Registry(make_settings(tmp_path, WATCHDOG))
    wd = Watchdog(registry.settings, registry, clock=clock)
    r = register(registry, os.getpid())
    for n in range(1, 4):
        clock.advance(1.0)
        step(registry, r, n, clock)
    computed = []
    real = wd.timeouts.step_timeout
    monkeypatch.setattr(wd.timeouts, "step_timeout", lambda *a: computed.append(1) or real(*a))
    for _ in range(5):
        wd.tick()
    assert len(computed) == 1
    clock.advance(1.0)
    step(registry, r, 4, clock)
    wd.tick()
    assert len(computed) == 2
