"""A barrier while rank 0 works alone (issue 29): rank 1 waits in a gloo barrier past the floor
while rank 0 prepares a data shard in Python (one function whose time goes mostly to C calls:
two looks at its stack often land on the same line). Before, rank 1's stall killed the job: the
coordinator named rank 0 ("never entered the barrier") and rank 0's second look showed the same
function, or it was found busy but the job's stall was acted on anyway. Now the stall is held
while rank 0 is busy (its CPU time grows, one of several looks shows its stack moving) and ends by
itself; a rank 0 that spins in one place (CPU, a still stack) is still killed at the floor.

Real sidecar, two real gloo ranks with `Monitor` hooks at their default flush, killing allowed
without a launcher (remediation.kill_without_restart)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import CPU_FIRST, Sidecar, kill_tree, wait_until
from tests.watchdog.jobs import incidents
from tests.watchdog.test_floor_is_the_ranks_own import FLOOR, SETTINGS, stalled_at

pytestmark = pytest.mark.slow

PAUSE_SECONDS = 8.0  # past the 5 s floor, as a real shard preparation or rank-0 evaluation would be

# Two gloo ranks all-reduce each step; at step 20 rank 0 `prepare`s (or `spin`s) while rank 1
# enters the barrier; then 10 more steps.
RANK = r"""
import random, sys, time
import torch, torch.distributed as dist
from trainer_hooks import Monitor
rank, store, mode, seconds = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
mon = Monitor(job_id="barrier", rank=rank, local_rank=rank, world_size=2, local_world_size=2)
WORDS = [f"w{i}" for i in range(5000)]

def tokenize(text):
    return [hash(word) % 50_000 for word in text.split()]

def prepare(seconds):
    end, rng, packed = time.time() + seconds, random.Random(0), 0
    while time.time() < end:
        text = " ".join(rng.choices(WORDS, k=512))
        packed += int(torch.tensor(tokenize(text)).sum()) & 1
    return packed

def spin():
    x = 0
    while True:
        x += 1

t = torch.ones(4)
for step in range(1, 31):
    if step == 21:
        if rank == 0:
            prepare(seconds) if mode == "prepare" else spin()
        dist.barrier()
    dist.all_reduce(t)
    time.sleep(0.05)
    mon.step(step)
mon.close()
dist.destroy_process_group()
"""

KILLING = (*SETTINGS, "remediation.kill_without_restart=true")


def start(sidecar: Sidecar, tmp_path, mode: str) -> list[subprocess.Popen]:
    env = {**os.environ, **sidecar.hook_env()}
    env.pop("SIDECAR_FLUSH_INTERVAL", None)  # the hooks' default: the sidecar's 2 s
    return [
        subprocess.Popen(
            [*CPU_FIRST, sys.executable, "-c", RANK, str(r), str(tmp_path / "store"), mode, str(PAUSE_SECONDS)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in (0, 1)
    ]


def lines(sidecar: Sidecar, what: str) -> list[str]:
    return [line for line in sidecar.log.read_text(errors="replace").splitlines() if what in line]


def test_a_barrier_while_rank_0_works_alone_is_held_not_killed(tmp_path):
    with Sidecar(tmp_path, *KILLING) as sidecar:
        ranks = start(sidecar, tmp_path, "prepare")
        try:
            for p in ranks:
                assert p.wait(timeout=90) == 0, (p.returncode, p.stderr.read() if p.stderr else "")
            log = lines(sidecar, "barrier")
            assert stalled_at(sidecar, "rank barrier/1 "), log  # rank 1 did wait past the floor
            assert not lines(sidecar, "SIGTERM") and not lines(sidecar, "-> remediating"), log
            assert lines(sidecar, "busy, not hung"), log
            assert lines(sidecar, "not killed") or lines(sidecar, "false alarm"), log
            # the incident keeps the check that found rank 0 busy, also one found after the stall opened
            (stall,) = wait_until(lambda: [i for i in incidents(sidecar) if i["job_id"] == "barrier"], 10, what="it")
            busy = [e for e in stall["timeline"] if e["event"] == "busy_not_hung"]
            assert busy and all(e["rank"] == 0 for e in busy), stall["timeline"]
        finally:
            for p in ranks:
                kill_tree(p)


def test_a_rank_0_spinning_in_place_while_rank_1_waits_is_killed_at_the_floor(tmp_path):
    with Sidecar(tmp_path, *KILLING) as sidecar:
        ranks = start(sidecar, tmp_path, "spin")
        try:
            wait_until(lambda: all(p.poll() is not None for p in ranks), 60, what="both ranks killed")
            log = lines(sidecar, "barrier")
            assert all(p.returncode != 0 for p in ranks), log
            assert lines(sidecar, "but its stack did not move"), log
            spun = stalled_at(sidecar, "rank barrier/0 ")
            waited = stalled_at(sidecar, "rank barrier/1 ")
            assert spun and waited, log
            print(f"rank 0 (spinning) declared {spun[0] - waited[0]:.2f}s after rank 1 (waiting), floor {FLOOR}s")
            assert spun[0] - waited[0] <= FLOOR, log  # judged when its own deadline came, not held to the ceiling
            assert not lines(sidecar, "busy, not hung"), log
        finally:
            for p in ranks:
                kill_tree(p)
