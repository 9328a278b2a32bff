"""The floor means what it says (issue 29, item 0): no rank is declared stalled before its timeout
has passed since its own last progress, as the rank knows it. Measured before: a rank stepping
every 50 ms and pausing 4.6 s at a 5 s floor was declared "5.0s without progress" (the step that
ended the pause was still in the hooks' buffer, up to the 2 s flush interval); a SIGSTOPped rank was
judged at its step 9 while it had reached step 20, 4.3 s after the stop.

Real sidecar, real hooks (`Monitor`) at their default flush interval, a rank stepping every 50 ms."""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.support import Sidecar, kill_tree, wait_until

pytestmark = pytest.mark.slow

FLOOR = 5.0  # the least the default 2 s flush allows (2 x flush + a tick)
SETTINGS = (
    f"watchdog.floor_seconds={FLOOR}",
    "watchdog.check_interval_seconds=0.25",
    "remediation.dump_wait_seconds=0.5",
    "remediation.grace_seconds=1",
    "remediation.py_spy=false",
)

# Steps every 50 ms, pauses of PAUSE seconds after every 20 steps, each step's time appended to LOG
# after mon.step (so the log's last time is never later than the rank's last progress).
RANK = r"""
import os, sys, time
from trainer_hooks import Monitor
log = open(sys.argv[1], "a", buffering=1)
pause, pauses = float(sys.argv[2]), int(sys.argv[3])
mon = Monitor(job_id="floor", rank=0, local_rank=0, world_size=1, local_world_size=1)
step = 0
for round_ in range(pauses + 1):
    for _ in range(20):
        step += 1
        time.sleep(0.05)
        mon.step(step, loss=1.0)
        log.write(f"{step} {time.time():.4f}\n")
    if round_ < pauses:
        time.sleep(pause)
if pauses < 0:
    while True:
        step += 1
        time.sleep(0.05)
        mon.step(step, loss=1.0)
        log.write(f"{step} {time.time():.4f}\n")
mon.close()
"""


def start_rank(sidecar: Sidecar, log, pause: float, pauses: int) -> subprocess.Popen:
    env = {**os.environ, **sidecar.hook_env()}
    env.pop("SIDECAR_FLUSH_INTERVAL", None)  # the hooks' default: the sidecar's 2 s
    return subprocess.Popen([sys.executable, "-c", RANK, str(log), str(pause), str(pauses)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip


def stalled_at(sidecar: Sidecar, who: str = "rank floor/0") -> list[float]:
    """Wall times of the sidecar's "-> stalled" transitions of the job's rank (its log's stamps)."""
    found = []
    for line in sidecar.log.read_text(errors="replace").splitlines():
        if who in line and "-> stalled" in line:
            stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
            assert stamp is not None, line
            found.append(datetime.datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return found


def test_pauses_just_under_the_floor_are_never_stalls(tmp_path):
    """Four pauses of 0.9 x the floor at the hooks' default 2 s flush: before, the step that ended
    a pause reached the sidecar up to 2 s later, and most such pauses were declared stalls."""
    with Sidecar(tmp_path, *SETTINGS) as sidecar:
        rank = start_rank(sidecar, tmp_path / "steps.log", 0.9 * FLOOR, 4)
        try:
            assert rank.wait(timeout=60) == 0, rank.stderr.read() if rank.stderr else ""
            assert stalled_at(sidecar) == [], [ln for ln in sidecar.log.read_text().splitlines() if "floor/0" in ln]
            assert not [i for i in sidecar.status()["incidents"] if i["job_id"] == "floor"]
        finally:
            kill_tree(rank)


@pytest.mark.parametrize("after", [1.3, 2.2])
def test_a_frozen_rank_is_stalled_at_the_floor_after_its_own_last_step_not_before(tmp_path, after):
    """SIGSTOP at different moments of the hooks' 2 s flush cycle: the stall is declared no sooner
    than the floor after the rank's own last step (its steps since the last push never reached
    the sidecar), and at most the hooks' push interval (2 s), a tick and a margin later."""
    log = tmp_path / "steps.log"
    with Sidecar(tmp_path, *SETTINGS) as sidecar:
        rank = start_rank(sidecar, log, 0.0, -1)  # steps until stopped
        try:
            wait_until(lambda: log.exists() and len(log.read_text().splitlines()) >= 20, 30, what="20 steps")
            time.sleep(after)
            rank.send_signal(signal.SIGSTOP)
            stopped = time.time()
            time.sleep(0.2)  # the signal taken; what the log holds now is all the rank did
            last_step = float(log.read_text().splitlines()[-1].split()[1])
            wait_until(lambda: stalled_at(sidecar), 30, what="the stall")
            declared = stalled_at(sidecar)[0]
            print(f"stopped {stopped - last_step:.3f}s after its last step; stalled {declared - last_step:.2f}s "
                  f"after it (floor {FLOOR}s)")  # fmt: skip
            assert declared >= last_step + FLOOR, (declared - last_step, FLOOR)
            assert declared <= stopped + FLOOR + 2.5 + 0.25 + 1.0, (declared - stopped, FLOOR)
        finally:
            rank.send_signal(signal.SIGCONT)
            kill_tree(rank)
