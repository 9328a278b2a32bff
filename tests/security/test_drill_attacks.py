"""The drill endpoint (`POST /v1/drills`, docs/security.md): it stops a rank of a live job, so only
root may call it, on the Unix socket. An unprivileged user can start no drill, on another user's job
nor on its own, nor read one; the rank stays running."""

from __future__ import annotations

from textwrap import dedent

import pytest

from tests.security.rig import attack, open_sidecar, start_as
from tests.support import kill_tree
from tests.unpriv import unprivileged_user

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
