"""What a troubled rank's process does (Liveness.activity), read from the kernel: a tracing stop
(state t) is a stop only once it lasts TRACE_STOP_SECONDS. py-spy holds a rank in it for the moment
it reads the stack: under make test's load a spinning rank was read `stopped` then and judged
`rank_stopped` (tests/jobview/test_multinode.py, [spin]). A SIGSTOP (state T) is a stop at once.
Real processes; the tracing stop is a real ptrace interrupt, as py-spy's."""

from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest

from sidecar.host import procs
from sidecar.ranks.model import Rank
from sidecar.watchdog.liveness import TRACE_STOP_SECONDS, Liveness, _Watch
from tests.support import make_settings

PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT = 17, 0x4206, 0x4207
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


def ptrace(request: int, pid: int) -> None:
    if LIBC.ptrace(request, pid, None, None) != 0:
        err = ctypes.get_errno()
        pytest.skip(f"ptrace {request:#x}: {os.strerror(err)}")


def state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def watched(tmp_path, pid: int) -> tuple[Liveness, Rank]:
    rank = Rank("j", 1, 1, 2, 1, pid, procs.start_time(pid), peer_verified=True)
    liveness = Liveness(make_settings(tmp_path, {}), want_probe=lambda job: None)
    liveness._watch[rank.key] = _Watch(rank, cpu=0.0, at=0.0)
    return liveness, rank


def wait_state(pid: int, letter: str) -> None:
    deadline = time.monotonic() + 10
    while state_of(pid) != letter:
        assert time.monotonic() < deadline, f"pid {pid} never in state {letter}: {state_of(pid)}"
        time.sleep(0.01)


def test_a_moment_in_a_tracing_stop_is_not_a_stop_but_a_lasting_one_is(tmp_path, spawn):
    spinner = spawn(["python3", "-c", "while True: pass"])
    liveness, rank = watched(tmp_path, spinner.pid)
    ptrace(PTRACE_SEIZE, spinner.pid)
    try:
        ptrace(PTRACE_INTERRUPT, spinner.pid)
        wait_state(spinner.pid, "t")
        assert liveness.activity(rank, 100.0) is None  # its stack being read: too soon to tell
        assert liveness.activity(rank, 100.0 + TRACE_STOP_SECONDS / 2) is None
        assert liveness.activity(rank, 100.0 + TRACE_STOP_SECONDS) == "stopped"  # a tracer holds it
    finally:
        os.waitpid(spinner.pid, os.WNOHANG | getattr(os, "__WALL", 0x40000000))
        LIBC.ptrace(PTRACE_DETACH, spinner.pid, None, None)
    wait_state(spinner.pid, "R")
    assert liveness.activity(rank, 103.0) == "cpu"  # running again


def test_a_sigstopped_rank_is_stopped_at_once(tmp_path, spawn):
    sleeper = spawn()
    liveness, rank = watched(tmp_path, sleeper.pid)
    os.kill(sleeper.pid, signal.SIGSTOP)
    try:
        wait_state(sleeper.pid, "T")
        assert liveness.activity(rank, 100.0) == "stopped"
    finally:
        os.kill(sleeper.pid, signal.SIGCONT)
