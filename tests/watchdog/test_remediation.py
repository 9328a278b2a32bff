"""Remediation of real (stand-in) rank processes: stacks, SIGTERM, grace, SIGKILL, the
incident's timeline; observe-only and the storm cap never signal."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from sidecar.host import procs
from sidecar.problems import Kind
from sidecar.ranks.registry import Registry
from sidecar.watchdog.machine import Watchdog
from sidecar.watchdog.stackdumps import py_spy_path
from tests.support import PYTHON, make_settings, wait_until
from tests.watchdog.helpers import WATCHDOG, register_hung, step

pytestmark = pytest.mark.asyncio


async def stall(dog, registry, clock, ranks, steps=None) -> None:
    """Report a step for each rank, then let time pass beyond the 10 s floor and tick."""
    for i, r in enumerate(ranks):
        step(registry, r, (steps or [1] * len(ranks))[i], clock)
    dog.tick()
    clock.advance(11)
    dog.tick()


async def finish(dog) -> None:
    for episode in list(dog._episodes.values()):
        await episode.task
    dog.tick()


def stop(pid: int) -> None:
    """SIGSTOP a rank and wait until it is stopped: the stop takes effect when the kernel next
    schedules the process, which on a loaded machine can be after the watchdog looks."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: procs.is_stopped(pid), 10, what="the rank to be stopped")


# A rank stopped in the middle of Python code: it writes a byte per loop to `beats`.
SPINNING_RANK = r"""
import faulthandler, signal, sys
dump = open(sys.argv[1], "a")
faulthandler.register(signal.SIGUSR2, file=dump, all_threads=False)  # as the hooks do
beats = open(sys.argv[2], "a", buffering=1)
def spin_in_python():
    n = 0
    while True:
        n += 1
        if n % 100000 == 0:
            beats.write("x\n")
spin_in_python()
"""


def watchdog(tmp_path, clock, **settings) -> tuple[Registry, Watchdog]:
    """A registry and its watchdog with the tests' settings (WATCHDOG), and `settings` on top."""
    s = make_settings(tmp_path, WATCHDOG, **settings)
    registry = Registry(s)
    return registry, Watchdog(s, registry, clock=clock)


def events(incident: dict) -> list[str]:
    return [e["event"] for e in incident["timeline"]]


async def test_a_hung_rank_is_dumped_terminated_and_recorded(tmp_path, clock, hung_rank):
    registry, dog = watchdog(tmp_path, clock)
    proc, stacks = hung_rank()
    r = register_hung(registry, proc, stacks)
    await stall(dog, registry, clock, [r])
    assert dog.rank_state(r) == "remediating"
    await finish(dog)
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert dog.rank_state(r) == "gone"
    (brief,) = dog.incidents()
    record = json.loads(Path(brief["path"]).read_text())
    assert record["outcome"] == "killed" and record["blamed_rank"] == 0
    assert events(record) == ["detected", "dumps_requested", "dumps_received", "sigterm", "exit_observed"]
    (rank,) = record["ranks"]
    assert any("hang_in_the_training_step" in line for line in rank["stack_head"])
    assert rank["in_collective"] is False
    text = Path(brief["path"]).with_suffix(".txt").read_text()
    assert "hang_in_the_training_step" in text and "sigterm" in text
    assert dog.counters.remediations[("job", "killed")] == 1


async def test_a_rank_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path, clock, hung_rank):
    registry, dog = watchdog(tmp_path, clock, **{"remediation.grace_seconds": 0.5})
    proc, stacks = hung_rank("ignore-term")
    r = register_hung(registry, proc, stacks)
    await stall(dog, registry, clock, [r])
    await finish(dog)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    record = json.loads(Path(dog.incidents()[0]["path"]).read_text())
    assert events(record)[-3:] == ["sigterm", "sigkill", "exit_observed"]


async def test_a_stopped_rank_dumps_its_stacks_and_dies(tmp_path, clock, hung_rank):
    registry, dog = watchdog(tmp_path, clock)
    proc, stacks = hung_rank()
    r = register_hung(registry, proc, stacks)
    stop(proc.pid)
    await stall(dog, registry, clock, [r])
    await finish(dog)
    assert proc.wait(timeout=10) in (-signal.SIGTERM, -signal.SIGKILL)
    record = json.loads(Path(dog.incidents()[0]["path"]).read_text())
    assert record["ranks"][0]["stack_head"], "the stopped rank dumped its stacks"


@pytest.mark.skipif(py_spy_path() is None, reason="needs py-spy (installed with the dev extras)")
async def test_a_stopped_rank_is_read_by_py_spy_where_it_stands_and_never_runs_again(tmp_path, clock, spawn):
    """Continued for faulthandler, a rank stopped inside Python code ran again while the handler
    walked its threads' frames, and crashed (SIGSEGV) in bench_recovery's goodput job."""
    registry, dog = watchdog(tmp_path, clock, **{"remediation.py_spy": True})
    stacks, beats = tmp_path / "rank.stacks", tmp_path / "beats"
    proc = spawn([PYTHON, "-c", SPINNING_RANK, str(stacks), str(beats)])
    wait_until(lambda: beats.exists() and beats.stat().st_size > 0, 30, what="the rank spinning")
    r = register_hung(registry, proc, stacks)
    stop(proc.pid)
    beaten = beats.stat().st_size
    await stall(dog, registry, clock, [r])
    await finish(dog)
    assert proc.wait(timeout=10) in (-signal.SIGTERM, -signal.SIGKILL)
    assert beats.stat().st_size == beaten, "the stopped rank ran again before its kill"
    assert stacks.stat().st_size == 0, "no faulthandler dump was asked of it"
    record = json.loads(Path(dog.incidents()[0]["path"]).read_text())
    (rank,) = record["ranks"]
    assert "spin_in_python" in rank["py_spy"] and any("spin_in_python" in line for line in rank["stack_head"])
    assert any("read by py-spy where it stands" in note for note in record["notes"])


async def test_observe_only_records_and_counts_but_never_signals(tmp_path, clock, hung_rank):
    registry, dog = watchdog(tmp_path, clock, **{"watchdog.observe_only": True})
    proc, stacks = hung_rank()
    r = register_hung(registry, proc, stacks)
    await stall(dog, registry, clock, [r])
    await finish(dog)
    assert proc.poll() is None
    assert stacks.stat().st_size == 0, "not even the stack-dump signal was sent"
    assert dog.rank_state(r) == "stalled"
    assert dog.counters.remediations[("job", "observe_only")] == 1
    record = json.loads(Path(dog.incidents()[0]["path"]).read_text())
    assert record["outcome"] == "observe_only" and "sigterm" not in events(record)
    observe = next(f for f in dog.families() if f.name == "sidecar_watchdog_observe_only")
    assert observe.samples[0].value == 1


async def test_the_storm_cap_suppresses_remediation_past_its_limit(tmp_path, clock, hung_rank):
    registry, dog = watchdog(tmp_path, clock, **{"remediation.max_per_window": 1})
    (p1, f1), (p2, f2) = hung_rank(), hung_rank()
    r1 = register_hung(registry, p1, f1, job="first")
    await stall(dog, registry, clock, [r1])
    await finish(dog)
    r2 = register_hung(registry, p2, f2, job="second")
    await stall(dog, registry, clock, [r2])
    await finish(dog)
    assert p1.poll() is not None and p2.poll() is None
    assert dog.counters.remediations[("second", "suppressed")] == 1
    assert any(p.kind is Kind.STORM_CAP and "storm cap" in p.text for p in dog.problems())
    assert dog.status()["remediations_in_window"] == 1


async def test_the_whole_local_group_of_the_stalled_job_is_remediated(tmp_path, clock, hung_rank):
    """The healthy-looking rank of a hung job waits for its peer: both are restarted together."""
    registry, dog = watchdog(tmp_path, clock)
    (p0, f0), (p1, f1) = hung_rank(), hung_rank()
    r0 = register_hung(registry, p0, f0, rank=0)
    r1 = register_hung(registry, p1, f1, rank=1)
    await stall(dog, registry, clock, [r0, r1], steps=[5, 4])
    await finish(dog)
    assert p0.wait(timeout=10) and p1.wait(timeout=10)
    record = json.loads(Path(dog.incidents()[0]["path"]).read_text())
    assert record["blamed_rank"] == 1 and "lowest step" in record["blame_reason"]


async def test_a_probe_leaves_a_stopped_rank_stopped_and_names_it_not_waiting(tmp_path, clock, hung_rank):
    """A suspect rank's probe must not continue a stopped rank: continued for its dump, the rank
    of bench_recovery's goodput job finished its step, turned healthy again and restarted its
    timeout (three times, then it crashed in the dump)."""
    registry, dog = watchdog(tmp_path, clock)
    proc, stacks = hung_rank()
    r = register_hung(registry, proc, stacks)
    stop(proc.pid)
    step(registry, r, 1, clock)
    dog.tick()
    clock.advance(6)  # past suspect_ratio x the 10 s floor, short of the timeout
    dog.tick()
    assert dog.rank_state(r) == "suspect"
    probes = list(dog._probes.values())
    assert probes, "a suspect rank is probed"
    for task in probes:
        await task
    assert procs.is_stopped(proc.pid), "the probe left the rank stopped"
    assert stacks.stat().st_size == 0, "the stopped rank was not continued to dump"
    (track,) = [t for t in dog._tracks.values() if t.rank.rank == r.rank]
    assert track.probe is not None and track.probe.waiting is False
    os.kill(proc.pid, signal.SIGKILL)
