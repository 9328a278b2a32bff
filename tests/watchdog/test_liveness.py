"""Busy, not hung (sidecar/watchdog/liveness.py): the evidence of life a rank past its deadline must
show to be spared (CPU and a moving stack, both), with a CPU reader and stack probes the test
hands in; then the watchdog holding such a rank with a hand-moved clock. Real ranks:
tests/watchdog/test_busy_is_alive.py."""

from __future__ import annotations

import pytest

from sidecar.ranks.registry import Registry
from sidecar.watchdog.coordination import Probe
from sidecar.watchdog.liveness import MIN_LOOKS, Liveness, moved
from sidecar.watchdog.machine import Watchdog
from sidecar.watchdog.stackdumps import main_frames
from sidecar.watchdog.timeouts import Deadline
from tests.support import make_settings
from tests.watchdog.helpers import WATCHDOG, register, step

FLOOR, CEILING = 10.0, 100.0  # WATCHDOG's
A = (("train.py", "evaluate", 40), ("train.py", "main", 90), ("train.py", "<module>", 99))
A_NEXT_LINE = (("train.py", "evaluate", 41),) + A[1:]
B = (("train.py", "score", 12), ("train.py", "evaluate", 44), ("train.py", "main", 90), ("train.py", "<module>", 99))
DUMP = """Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/opt/hooks/sender.py", line 170 in _run

Current thread 0x00007f0000000001 (most recent call first):
  File "train.py", line 12 in score
  File "train.py", line 44 in evaluate
  File "<string>", line 99 in <module>
"""


def test_the_main_thread_s_frames_are_read_from_a_dump():
    assert main_frames(DUMP) == (("train.py", "score", 12), ("train.py", "evaluate", 44), ("<string>", "<module>", 99))
    spy = 'Thread 7 (active): "MainThread"\n    score (train.py:12)\n    evaluate (train.py:44)\n'
    assert main_frames(spy) == (("train.py", "score", 12), ("train.py", "evaluate", 44))
    assert main_frames("") == ()


def test_the_hooks_dump_is_the_main_thread_and_a_read_holding_two_dumps_gives_the_first():
    """The hooks dump the thread the signal lands on (the main thread): faulthandler's
    `Stack (most recent call first):`. A read from the file's size before a look may hold a
    later look's dump too: the two were one moving stack to the watchdog, and a spinning rank was
    spared for a floor (tests/watchdog/test_busy_peer_waits.py, 12.3 s instead of <= 5 s)."""
    spin = (
        'Stack (most recent call first):\n  File "<string>", line {} in spin\n  File "<string>", line 29 in <module>\n'
    )
    assert main_frames(spin.format(23)) == (("<string>", "spin", 23), ("<string>", "<module>", 29))
    assert main_frames(spin.format(22) + spin.format(23)) == main_frames(spin.format(22))
    assert not moved(main_frames(spin.format(23)), main_frames(spin.format(22) + spin.format(23)))


def test_a_stack_moved_unless_only_the_innermost_line_changed():
    assert not moved(A, A)
    assert not moved(A, A_NEXT_LINE)  # a loop inside one function: `while True: x += 1`
    assert moved(A, B)  # another innermost function
    assert moved(A, (("train.py", "evaluate", 40), ("train.py", "main", 91), ("train.py", "<module>", 99)))
    assert not moved((), A) and not moved(A, ())  # no look: no evidence


class World:
    """A Liveness over a real registry's rank, its CPU seconds and stack probes set by the test."""

    def __init__(self, tmp_path, spawn, verified: bool = True, **overrides):
        self.settings = make_settings(tmp_path, WATCHDOG, **overrides)
        self.registry = Registry(self.settings)
        pid = spawn().pid
        self.rank = register(self.registry, pid)
        self.rank.peer_verified = verified
        self.cpu_seconds = 100.0
        self.reads: list[int] = []
        self.asked: list[str] = []
        self.live = Liveness(self.settings, self.asked.append, self.read)

    def read(self, pid: int, started: float | None) -> float | None:
        self.reads.append(pid)
        return self.cpu_seconds

    def hold(self, age: float, now: float, probe: Probe | None, timeout: float = FLOOR) -> float | None:
        return self.live.hold(self.rank, probe, Deadline(timeout, age, "steps"), timeout / 2, now)


@pytest.fixture
def world(tmp_path, spawn):
    return lambda **kw: World(tmp_path, spawn, **kw)


def test_a_busy_rank_whose_stack_moves_is_held_and_checked_again_every_floor(world, caplog):
    w = world()
    suspect = Probe(False, None, 5.0, A)
    assert w.hold(5.0, 5.0, None) is None  # turned suspect: CPU read
    assert w.hold(5.5, 5.5, suspect) is None  # its probe came
    w.cpu_seconds += 2.0  # 40% of a core over 5 s
    assert w.hold(10.0, 10.0, suspect) == pytest.approx(10.05)  # a fresh look is asked for
    assert w.asked == ["job"] and w.live.wants_probe(w.rank.key)
    assert w.hold(10.05, 10.05, suspect) == pytest.approx(10.1)  # not there yet
    fresh = Probe(False, None, 10.08, B)
    assert w.hold(10.1, 10.1, fresh) == pytest.approx(20.1)  # busy: again in a floor
    assert not w.live.wants_probe(w.rank.key)
    assert "busy, not hung: cpu +2.0s in 5.0s, stack moved (evaluate (train.py:40) -> score (train.py:12))" in (
        caplog.text
    )
    assert w.hold(15.0, 15.0, fresh) == pytest.approx(20.1)  # nothing read meanwhile
    reads = len(w.reads)
    w.cpu_seconds += 3.0
    assert w.hold(20.1, 20.1, fresh) == pytest.approx(20.15)
    assert len(w.reads) == reads + 1
    assert w.hold(20.2, 20.2, Probe(False, None, 20.15, A)) == pytest.approx(30.2)  # moved back: moved
    assert caplog.text.count("busy, not hung") == 1  # logged once


def test_the_ceiling_since_its_progress_ends_the_reprieve(world):
    w = world()
    suspect = Probe(False, None, 5.0, A)
    w.hold(5.0, 5.0, suspect)
    w.cpu_seconds += 5.0
    w.hold(10.0, 10.0, suspect)
    assert w.hold(95.0, 10.1, Probe(False, None, 10.05, B)) == pytest.approx(15.1)  # 5 s left to the ceiling
    assert w.hold(CEILING, 15.1, Probe(False, None, 10.05, B)) is None
    assert w.hold(CEILING + 1, 16, Probe(False, None, 10.05, B)) is None  # declared: stays so


def test_a_hang_without_cpu_is_declared_at_its_deadline_without_a_second_look(world):
    """SIGSTOP, a lock, a collective: no CPU. One /proc read, no probe (none in between either), no delay."""
    w = world()
    suspect = Probe(False, None, 5.0, A)
    w.hold(5.0, 5.0, suspect)
    w.cpu_seconds += 0.2
    assert w.hold(7.5, 7.5, suspect) is None  # between suspect and deadline: no CPU to speak of, no look
    w.cpu_seconds += 0.3  # 10% of a core: the hooks' thread, the probe's own dump
    assert w.hold(10.0, 10.0, suspect) is None
    assert w.asked == []
    assert not w.live.alive(w.rank.key, 10.0)


def test_a_busy_loop_is_declared_once_enough_looks_show_the_same_function(world, caplog):
    """CPU, and a stack that holds still at every look: `while True: x += 1`. One look is not
    enough to trust (a tokenizer loop's C calls look the same at most looks): MIN_LOOKS are."""
    caplog.set_level("INFO")
    w = world()
    suspect = Probe(False, None, 5.0, A)
    w.hold(5.0, 5.0, suspect)
    w.cpu_seconds += 5.0
    assert w.hold(10.0, 10.0, suspect) is not None
    now = 10.0
    for _ in range(MIN_LOOKS - 1):  # too few looks yet: another is asked for each time
        now += 0.1
        assert w.hold(now, now, Probe(False, None, now - 0.05, A_NEXT_LINE)) == pytest.approx(now + 0.05)
        assert w.live.alive(w.rank.key, now)  # being checked: its job's stall waits for the verdict
    now += 0.1
    assert w.hold(now, now, Probe(False, None, now - 0.05, A_NEXT_LINE)) is None
    assert f"its stack did not move in {MIN_LOOKS} looks" in caplog.text
    assert not w.live.alive(w.rank.key, now)


def test_a_look_in_between_that_moved_spares_work_spent_mostly_in_one_function(world, caplog):
    """A rank whose CPU time grows while suspect is looked at in between too: one of those looks
    in another function is enough, though every look at the deadline lands on the same line
    (bench_field_pauses' barrier pause: a shard prepared in one function, mostly in C calls)."""
    w = world()
    suspect = Probe(False, None, 5.0, A)
    assert w.hold(5.0, 5.0, None) is None
    assert w.hold(5.2, 5.2, suspect) is None  # its first probe: no CPU gained yet, no look
    assert w.asked == []
    w.cpu_seconds += 0.5
    assert w.hold(6.0, 6.0, suspect) is None and w.asked == ["job"]  # CPU grows: a look in between
    assert w.live.alive(w.rank.key, 6.0)  # CPU growing while suspect: alive, not judged yet
    assert w.hold(6.2, 6.2, Probe(False, None, 6.1, B)) is None  # that look: another function
    w.cpu_seconds += 3.5
    assert w.hold(10.0, 10.0, Probe(False, None, 6.1, B)) is not None  # the check at the deadline
    assert w.hold(10.1, 10.1, Probe(False, None, 10.05, A_NEXT_LINE)) == pytest.approx(20.1)  # busy
    assert "stack moved (evaluate (train.py:40) -> score (train.py:12))" in caplog.text
    assert w.live.alive(w.rank.key, 10.1)


def test_a_rank_whose_stack_cannot_be_read_has_no_evidence(world):
    w = world()
    nothing = Probe(None, None, 5.0, ())  # no dump signal, no py-spy
    w.hold(5.0, 5.0, nothing)
    w.cpu_seconds += 5.0
    assert w.hold(10.0, 10.0, nothing) is None and w.asked == []


def test_no_second_look_in_time_is_no_evidence(world):
    w = world()
    suspect = Probe(False, None, 5.0, A)
    w.hold(5.0, 5.0, suspect)
    w.cpu_seconds += 5.0
    assert w.hold(10.0, 10.0, suspect) is not None
    assert w.hold(10.0 + w.live.probe_wait, 10.0 + w.live.probe_wait, suspect) is None


def test_a_rank_straight_past_its_deadline_has_no_interval_to_show_cpu_in(world):
    w = world()
    assert w.hold(11.0, 11.0, Probe(False, None, 11.0, A)) is None


def test_only_verified_ranks_processes_are_read(world):
    w = world(verified=False)
    suspect = Probe(False, None, 5.0, A)
    assert w.hold(5.0, 5.0, suspect) is None
    assert w.hold(10.0, 10.0, suspect) is None
    assert w.reads == []


def test_the_setting_turns_it_off(world):
    w = world(**{"watchdog.busy_is_alive": False})
    w.hold(5.0, 5.0, Probe(False, None, 5.0, A))
    w.cpu_seconds += 5.0
    assert w.hold(10.0, 10.0, Probe(False, None, 5.0, A)) is None and w.reads == []


def test_progress_forgets_the_evidence(world):
    w = world()
    suspect = Probe(False, None, 5.0, A)
    w.hold(5.0, 5.0, suspect)
    w.cpu_seconds += 5.0
    w.hold(10.0, 10.0, suspect)
    assert w.hold(1.0, 10.2, None) is None  # progressed
    assert not w.live.wants_probe(w.rank.key) and w.rank.key not in w.live._watch


@pytest.mark.asyncio
async def test_the_watchdog_holds_a_busy_rank_suspect_and_stalls_it_at_the_ceiling(tmp_path, clock, spawn):
    s = make_settings(tmp_path, WATCHDOG)
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=clock)
    r = register(registry, spawn().pid)
    cpu = [0.0]
    dog.liveness.cpu = lambda pid, started: cpu[0]
    try:
        step(registry, r, 1, clock)
        dog.tick()
        clock.advance(5.1)
        dog.tick()
        track = dog._tracks[r.key]
        assert dog.rank_state(r) == "suspect"
        track.probe = Probe(False, None, clock.now, A)  # what the probe at SUSPECT showed
        looks = [A, B]
        while clock.now - r.last_progress < CEILING:
            assert dog.rank_state(r) == "suspect", clock.now - r.last_progress
            cpu[0] += 5.0
            clock.advance(max(0.01, dog.next_tick_in(10.0)))
            dog.tick()
            if dog.liveness.wants_probe(r.key):  # the watchdog asked for a second look: here it is
                looks.reverse()
                clock.advance(0.05)
                track.probe = Probe(False, None, clock.now, looks[0])
                dog.tick()
        assert clock.now - r.last_progress < CEILING + 0.1
        assert dog.rank_state(r) == "remediating"  # stalled at the ceiling, and handed to remediation
        incident = dog._episodes["job"].incident
        busy = [e for e in incident.timeline if e["event"] == "busy_not_hung"]
        assert len(busy) >= 9, incident.timeline  # checked every floor (10 s) from 10 s to the ceiling
        assert "busy, not hung, at" in " ".join(incident.notes) and "ceiling" in " ".join(incident.notes)
    finally:
        await dog.close()


def test_a_frame_the_rank_wrote_is_logged_escaped():
    from sidecar.watchdog.liveness import describe

    assert describe((("/x/evil\x1b]52;c;ZXZpbA==\x07.py", "f\x1b[2J", 3),)) == (
        "f\\x1b[2J (x/evil\\x1b]52;c;ZXZpbA==\\x07.py:3)"
    )
