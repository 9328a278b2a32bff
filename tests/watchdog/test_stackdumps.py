"""When a rank's stack dump is complete: the file held still, or sooner, when no thread of the
rank runs any more (its faulthandler handler has returned). Real processes and real dumps."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from functools import partial
from pathlib import Path

import pytest

from sidecar.host.procs import at_rest
from sidecar.host.stackfiles import StackFile
from sidecar.watchdog.stackdumps import wait_until_written
from tests.support import PYTHON, wait_until

# A rank whose faulthandler dumps every thread into its file on SIGUSR1 (a long dump; its second
# thread sleeps, so walking it is safe; the hooks dump the main thread alone, trainer_hooks/stacks.py).
RANK = """
import faulthandler, signal, sys, threading, time
out = open(sys.argv[1], "a")
faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
print("ready", flush=True)
{body}
"""
SLEEPS = "time.sleep(600)"
SPINS = "while True:\n    pass"


def start(tmp_path: Path, body: str) -> tuple[subprocess.Popen, Path]:
    dump = tmp_path / "rank.stacks"
    dump.touch()
    proc = subprocess.Popen([PYTHON, "-c", RANK.format(body=body), str(dump)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc, dump


@pytest.fixture
def rank(tmp_path):
    procs: list[subprocess.Popen] = []

    def started(body: str) -> tuple[subprocess.Popen, Path]:
        proc, dump = start(tmp_path, body)
        procs.append(proc)
        return proc, dump

    yield started
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_sleeping_or_stopped_rank_is_at_rest_a_spinning_one_and_an_unreadable_one_are_not(rank):
    sleeper, _ = rank(SLEEPS)
    spinner, _ = rank(SPINS)

    wait_until(lambda: at_rest([sleeper.pid]), 30, what="the sleeping rank at rest")
    assert not any(at_rest([spinner.pid]) for _ in range(20))  # it runs or waits to run, always
    assert not at_rest([sleeper.pid, spinner.pid])
    os.kill(spinner.pid, signal.SIGSTOP)
    wait_until(lambda: at_rest([spinner.pid]), 30, what="the stopped rank at rest")
    assert not at_rest([2**22 + 1])  # no such process: cannot say, so not at rest


def dump_wait(dump: Path, size_before: int, still_for: float, writers_at_rest=None) -> tuple[bool, float]:
    started = time.monotonic()
    settled = asyncio.run(
        wait_until_written(
            [StackFile.existing(dump)],
            [size_before],
            still_for=still_for,
            at_most=still_for + 20,
            poll=0.02,
            writers_at_rest=writers_at_rest,
        )
    )
    return settled, time.monotonic() - started


def test_a_dump_is_complete_once_the_rank_sleeps_again_without_waiting_for_the_file_to_hold_still(rank):
    proc, dump = rank(SLEEPS)
    wait_until(lambda: at_rest([proc.pid]), 30, what="the rank at rest")

    os.kill(proc.pid, signal.SIGUSR1)
    settled, took = dump_wait(dump, 0, still_for=30.0, writers_at_rest=partial(at_rest, [proc.pid]))

    assert settled and took < 15.0  # not the 30 s stillness
    text = dump.read_text()
    assert text.count("(most recent call first)") == 2  # both threads: the dump is whole
    assert "Current thread" in text and 'File "<string>"' in text


def test_a_spinning_rank_is_given_the_whole_stillness_as_before(rank):
    proc, dump = rank(SPINS)

    os.kill(proc.pid, signal.SIGUSR1)
    settled, took = dump_wait(dump, 0, still_for=0.5, writers_at_rest=partial(at_rest, [proc.pid]))

    assert settled and took >= 0.5
    assert dump.read_text().count("(most recent call first)") == 2
