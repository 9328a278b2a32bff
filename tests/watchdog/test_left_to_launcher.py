"""A rank the watchdog left to the launcher (its job's culprit on another node) whose exit is then
the job incident's consequence, unless it stepped again first: a stall that ended by itself leaves
no mark, and a later crash of that rank is its own (a real process, a real Registry, the real
ExitTracker polled until it decides)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from sidecar.exits.tracker import ExitTracker
from sidecar.incidents.store import IncidentStore
from sidecar.ranks.registry import Registry
from tests.support import make_settings
from tests.watchdog.helpers import register, step

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("stepped_again", [False, True])
async def test_an_exit_after_being_left_to_the_launcher_is_a_consequence_unless_the_rank_stepped_again(
    tmp_path, clock, spawn, stepped_again
):
    settings = make_settings(tmp_path, {})
    registry = Registry(settings)
    tracker = ExitTracker(settings, IncidentStore.for_settings(settings))
    proc = spawn()
    r = register(registry, proc.pid)
    step(registry, r, 1, clock)
    tracker.watch(r)
    tracker.left_to_launcher(r, "job-incident-1", "rank 1 on node-1")
    if stepped_again:
        clock.advance(2)
        step(registry, r, 2, clock)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while tracker.last is None and time.monotonic() < deadline:
        await tracker.poll()
        await asyncio.sleep(0.2)
    entry = tracker.last
    assert entry is not None and entry["rank"] == r.rank, entry
    if stepped_again:
        assert entry["role"] == "cause" and "consequence_of" not in entry, entry
    else:
        assert entry["role"] == "consequence" and entry["consequence_of"] == "rank 1 on node-1", entry
