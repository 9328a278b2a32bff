"""The drill endpoint (`POST /v1/drills`, docs/security.md): it stops a rank of a live job, so only
root may call it, on the Unix socket. An unprivileged user can start no drill, on another user's job
nor on its own, nor read one; the rank stays running."""

from __future__ import annotations

import time
from textwrap import dedent

import pytest

from tests.security.rig import attack, open_sidecar, start_as
from tests.support import kill_tree
from tests.support.unpriv import unprivileged_user

# A rank of a torchrun job (so nothing but the caller would stop a drill) that trained two steps.
RANK = """
    rank = sleeper()
    job = os.environ["JOB"]
    status, body = request("/v1/register", registration(rank.pid, job, world_size=1,
                                                        launcher={"name": "torchrun", "max_restarts": 3}))
    assert status == 200, body
    status, body = request("/v1/push", {"job_id": job, "rank": 0, "pid": rank.pid,
                                        "items": [{"type": "step", "step": s} for s in (1, 2)]})
    assert status == 200, body
    report(pid=rank.pid)
    time.sleep(600)
"""


def state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def users():
    return unprivileged_user("alice"), unprivileged_user("mallory")


def test_no_unprivileged_user_may_start_or_read_a_drill(users):
    alice, mallory = users
    with open_sidecar() as sidecar:
        victim, started = start_as(alice, sidecar, "os.environ['JOB'] = 'victim'\n" + dedent(RANK))
        try:
            for user in (mallory, alice):
                out = attack(
                    user,
                    sidecar,
                    """
                    report(start=request("/v1/drills", {"job_id": "victim"}),
                           rank=request("/v1/drills", {"job_id": "victim", "rank": 0, "timeout_seconds": 10}),
                           read=request("/v1/drills/drill-x", None, method="GET"))
                    """,
                )
                for name in ("start", "rank", "read"):
                    status, body = out[name]
                    assert status == 403 and body["code"] == "forbidden" and "root" in body["error"], (user, out)
            assert state_of(started["pid"]) != "T", "the rank was stopped"
            assert sidecar.status()["watchdog"]["active"] == []
        finally:
            kill_tree(victim)


def start_drill_as_root(sidecar, job: str) -> tuple[int, dict]:
    """POST /v1/drills as root over the Unix socket (who may start one): (status, body)."""
    import json
    import socket

    body = json.dumps({"job_id": job, "timeout_seconds": 600}).encode()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sidecar.socket)
        s.sendall(b"POST /v1/drills HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_rank_stopped_by_a_drill_is_continued_when_the_sidecar_dies_or_stops_mid_drill(users, how):
    """Issue 43 row 5: the drill's SIGCONT came only from its follow task. A sidecar SIGKILLed (or
    crashed, or stopped) mid-drill left alice's rank stopped for good, and unwatched once a new
    sidecar started. Now a stopping sidecar continues it, and a starting one continues what the last
    run's drills left stopped (the same process only: its pid and start time)."""
    import signal

    from tests.security.rig import OPEN_SOCKET
    from tests.support import Sidecar, wait_until

    alice, _ = users
    with open_sidecar() as sidecar:
        victim, started = start_as(alice, sidecar, "os.environ['JOB'] = 'drilled'\n" + dedent(RANK))
        try:
            status, body = start_drill_as_root(sidecar, "drilled")
            assert status == 200, body
            wait_until(lambda: state_of(started["pid"]) == "T", 10, what="the drill to stop the rank")
            assert sidecar.proc is not None
            if how == "killed":
                sidecar.proc.send_signal(signal.SIGKILL)
                sidecar.proc.wait(10)
                time.sleep(1.0)
                assert state_of(started["pid"]) == "T"  # nothing could continue it: the next start must
                with Sidecar(sidecar.workdir, *OPEN_SOCKET, name="again") as again:
                    wait_until(lambda: state_of(started["pid"]) != "T", 15, what="the next start to continue it")
                    assert "left stopped by the previous run" in again.log.read_text()
            else:
                sidecar.stop()
                assert state_of(started["pid"]) != "T", "a stopping sidecar continues its drills' ranks"
        finally:
            kill_tree(victim)
