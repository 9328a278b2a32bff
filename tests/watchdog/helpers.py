"""Helpers of the watchdog's unit-level tests: the settings they share, a clock the test moves
by hand, registering ranks and their progress in a real Registry, and a stand-in rank that
hangs and dumps its stacks."""

from __future__ import annotations

import time

from sidecar.host import procs
from sidecar.ranks.protocol import PhaseItem, Push, Registration, StepItem
from sidecar.ranks.registry import Registry

# Short timeouts and waits; no py-spy (the stand-in ranks dump their own stacks).
WATCHDOG = {
    "watchdog.floor_seconds": 10,
    "watchdog.ceiling_seconds": 100,
    "watchdog.startup_timeout_seconds": 60,
    "watchdog.suspect_ratio": 0.5,
    "remediation.py_spy": False,
    "remediation.dump_wait_seconds": 0.5,
    "remediation.grace_seconds": 2,
}


CURRENT_CLOCK: FakeClock | None = None  # set by the `clock` fixture while its test runs


class FakeClock:
    """Monotonic time that only moves when the test says so (starts at the real monotonic
    time, so the registry's own timestamps line up with it)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def register(
    registry: Registry,
    pid: int,
    rank: int = 0,
    job: str = "job",
    step: int | None = None,
    start_time: float | None = ...,
    restart_count: int = 0,
):
    reg = Registration(
        job_id=job,
        rank=rank,
        local_rank=rank,
        world_size=2,
        local_world_size=2,
        pid=pid,
        step=step,
        restart_count=restart_count,
    )
    started = procs.start_time(pid) if start_time is ... else start_time
    rank = registry.register(reg, pid_start_time=started, peer_verified=True)
    if CURRENT_CLOCK is not None:  # the test's fake clock (the `clock` fixture): registered at its now
        rank.registered_at = rank.last_progress = CURRENT_CLOCK.now
    return rank


# The wall clock's lead on the monotonic one, read once: two reads per step differed by the
# scheduling between them (microseconds, 0.03 ms under the suite's load), and the steps' intervals
# then were not the fake clock's.
WALL_OFFSET = time.time() - time.monotonic()


def step(registry: Registry, r, n: int, clock: FakeClock, step_time: float | None = None) -> None:
    """Report step n at the fake clock's now (the wall time moves with it)."""
    wall = clock.now + WALL_OFFSET
    metrics = {"step_time_seconds": step_time} if step_time is not None else {}
    registry.apply_push(
        Push(r.job_id, r.rank, r.pid, 0, [StepItem(n, wall, metrics)]), now_mono=clock.now, now_wall=wall
    )


def phase(registry: Registry, r, name: str, action: str, clock: FakeClock, timeout: float | None = None) -> None:
    wall = clock.now + WALL_OFFSET
    registry.apply_push(
        Push(r.job_id, r.rank, r.pid, 0, [PhaseItem(name, action, wall, timeout)]), now_mono=clock.now, now_wall=wall
    )


# A stand-in rank: dumps its stacks on SIGUSR2 into a file (as the hooks arrange) and hangs
# in a named function, optionally ignoring SIGTERM. Prints "ready" once set up.
HUNG_RANK = r"""
import faulthandler, signal, sys, time
dump = open(sys.argv[1], "a")
faulthandler.register(signal.SIGUSR2, file=dump, all_threads=False)  # as the hooks do
if "ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1] + ".ready", "w").close()
def hang_in_the_training_step():
    time.sleep(600)
hang_in_the_training_step()
"""


def register_hung(registry: Registry, proc, stack_path, rank: int = 0, job: str = "job"):
    import signal as _signal

    from sidecar.host.stackfiles import StackFile

    reg = Registration(
        job_id=job,
        rank=rank,
        local_rank=rank,
        world_size=2,
        local_world_size=2,
        pid=proc.pid,
        stack_signal=int(_signal.SIGUSR2),
    )
    r = registry.register(reg, pid_start_time=procs.start_time(proc.pid), peer_verified=True)
    r.stack_file = StackFile.existing(stack_path)  # the stand-in opened it before it said "ready"
    return r
