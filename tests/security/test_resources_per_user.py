"""Round 2, rows 3, 4 and 13: what one user makes the sidecar hold (memory, descriptors, files)
is bounded per user, and the bounds never take anything from another user.

Each attack runs as an unprivileged user against a real sidecar; the figures are read from the
sidecar process itself (`/proc/<pid>`: resident memory, open descriptors) and its diagnostics
directory.
"""

from __future__ import annotations

import os
import signal

import psutil

from tests.security.rig import open_sidecar, ranks_of, start_as
from tests.support import kill_tree, wait_until
from tests.support.unpriv import unprivileged_user

# ---------------------------------------------------------------- row 3: event fields

# Each push carries one event whose one field is a 1 MiB-ish array of empty objects: parsed, a
# field like that is ~25 times its size in Python objects. 2 ranks x 16 events (the issue: 32).
HUGE_EVENTS = """
    field = [{}] * 240_000  # "{}, " x 240,000: just under the 1 MiB body limit
    ranks = [sleeper() for _ in range(2)]
    replies = []
    for r, p in enumerate(ranks):
        request("/v1/register", registration(p.pid, "fat", rank=r, world_size=2))
        for i in range(16):
            status, body = request("/v1/push", {"job_id": "fat", "rank": r, "pid": p.pid,
                "items": [{"type": "event", "name": "blob", "fields": {"f": field}}]})
            replies.append(status)
    report(replies=replies)
    time.sleep(600)
"""


def test_row3_huge_event_fields_are_kept_as_bounded_text():
    mallory = unprivileged_user("mallory")
    with open_sidecar() as sidecar:
        process = psutil.Process(sidecar.proc.pid)
        before = process.memory_info().rss
        attacker, out = start_as(mallory, sidecar, HUGE_EVENTS, timeout=120)
        try:
            after = process.memory_info().rss
            grown = (after - before) / 2**20
            print(f"row 3: sidecar RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB")
            assert set(out["replies"]) == {200}, out
            assert grown < 96, f"the sidecar grew {grown:.0f} MiB for 32 events"
        finally:
            kill_tree(attacker)


# ---------------------------------------------------------------- row 4: watches

# Register a process, deregister it (it "left"), keep it running: its exit is still watched
# (a pidfd and a cgroup descriptor). 150 such processes of one user.
LEFT_BUT_RUNNING = """
    kept, refused = [], []
    for i in range(150):
        p = sleeper()
        kept.append(p)
        status, body = request("/v1/register", registration(p.pid, "watches", rank=i, world_size=1000))
        if status == 200:
            status, body = request("/v1/deregister",
                                   {"job_id": "watches", "rank": i, "pid": p.pid, "reason": "crashed"})
        if status != 200:
            refused.append(body)
    report(refused=refused[:3])
    time.sleep(600)
"""

VICTIM_RANK = """
    rank = sleeper()
    status, body = request("/v1/register", registration(rank.pid, "victim", world_size=1))
    report(reply=[status, body], pid=rank.pid)
    rank.wait()
"""


def test_row4_watches_of_ranks_a_user_left_running_are_bounded_per_user():
    """Each registered-then-deregistered process used to keep a pidfd and a cgroup descriptor
    until it exited, with no bound per user (the node-wide one dropped the oldest watch,
    anyone's): 20,000 descriptors after 11 minutes, accept() failing. Now at most
    limits.max_ranks_per_user such watches per uid, the user's own oldest dropped."""
    mallory, alice = unprivileged_user("mallory"), unprivileged_user("alice")
    with open_sidecar("limits.max_ranks_per_user=8") as sidecar:
        process = psutil.Process(sidecar.proc.pid)
        victim, info = start_as(alice, sidecar, VICTIM_RANK)
        assert info["reply"][0] == 200, info
        before = process.num_fds()
        attacker, out = start_as(mallory, sidecar, LEFT_BUT_RUNNING, timeout=120)
        try:
            assert out["refused"] == [], out
            after = process.num_fds()
            print(f"row 4: sidecar descriptors {before} -> {after} after 150 processes left running")
            assert after - before <= 2 * 8 + 8, f"{after - before} more descriptors"
            os.kill(info["pid"], signal.SIGKILL)  # the other user's rank dies: still classified
            wait_until(
                lambda: any(i["job_id"] == "victim" for i in sidecar.status()["incidents"]),
                30,
                what="the victim's exit incident",
            )
            (incident,) = [i for i in sidecar.status()["incidents"] if i["job_id"] == "victim"]
            assert incident["outcome"] == "signal", incident
        finally:
            kill_tree(attacker)
            kill_tree(victim)


# ---------------------------------------------------------------- row 13: dump files

DUMP_FILES = """
    me = os.getpid()
    paths = []
    for i in range(120):
        status, body = request("/v1/register", registration(me, "dumps", rank=i, world_size=1000,
                                                            stack_dump={"signal": 10}))
        path = body["stack_dump"]["path"]
        paths.append(path)
        with open(path, "a") as f:
            f.write("x" * (3 << 20 if i == 0 else 100))  # the first one big
        request("/v1/deregister", {"job_id": "dumps", "rank": i, "pid": me, "reason": "finished"})
    report(paths=paths)
    time.sleep(600)
"""


def dump_files_of(sidecar, uid: int) -> list[os.stat_result]:
    out = []
    for path in (sidecar.workdir / "diag").glob("*/*.stacks"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if st.st_uid == uid:
            out.append(st)
    return out


def test_row13_dump_files_a_user_leaves_are_bounded_in_number_and_size():
    """Dump files with content were never pruned and their size never capped: 9,000 stayed
    (about 90 a second per process). Now at most limits.max_ranks_per_user + 16 per uid exist,
    the sweep keeps 16 of those no live rank holds, and none outgrows 1 MiB."""
    mallory = unprivileged_user("mallory")
    with open_sidecar("limits.max_ranks_per_user=8", "limits.gone_retention_seconds=2") as sidecar:
        attacker, out = start_as(mallory, sidecar, DUMP_FILES, timeout=120)
        try:
            assert len(out["paths"]) == 120
            right_after = dump_files_of(sidecar, mallory.uid)
            print(f"row 13: {len(right_after)} of 120 dump files right after")
            assert len(right_after) <= 8 + 16, len(right_after)
            wait_until(lambda: len(dump_files_of(sidecar, mallory.uid)) <= 16, 30, what="the sweep")
            assert all(st.st_size <= 1 << 20 for st in dump_files_of(sidecar, mallory.uid))
            assert ranks_of(sidecar, "dumps") == {} or all(
                r["state"] == "gone" for r in ranks_of(sidecar, "dumps").values()
            )
        finally:
            kill_tree(attacker)
