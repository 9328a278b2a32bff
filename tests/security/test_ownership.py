"""Rows 6 and 7 of the security issue: a job_id belongs to the uid whose processes registered
it first, until its ranks are gone. Another user can neither join it, take over one of its
ranks with a higher restart count, push to it nor deregister it. Each attack runs as an
unprivileged user against a real sidecar and a victim job of another unprivileged user."""

from __future__ import annotations

import pytest

from tests.security.rig import attack, open_sidecar, ranks_of, start_as
from tests.support import kill_tree, wait_until
from tests.unpriv import unprivileged_user

VICTIM = """
    rank = sleeper()
    status, body = request("/v1/register", registration(rank.pid, "victim"))
    assert status == 200, body
    status, body = request("/v1/push", {"job_id": "victim", "rank": 0, "pid": rank.pid,
                                        "items": [{"type": "step", "step": 1}]})
    assert status == 200, body
    report(pid=rank.pid)
    time.sleep(600)
"""


@pytest.fixture
def rig():
    alice, mallory = unprivileged_user("alice"), unprivileged_user("mallory")
    with open_sidecar() as sidecar:
        victim, info = start_as(alice, sidecar, VICTIM)
        try:
            yield sidecar, mallory, info["pid"], victim
        finally:
            kill_tree(victim)


def test_another_user_cannot_join_a_job(rig):
    """Row 6: an extra rank under someone else's job_id would make a stall of the attacker's
    own process kill the victim's whole job (a stall covers every local rank of the job)."""
    sidecar, mallory, victim_pid, _ = rig
    out = attack(
        mallory,
        sidecar,
        """
        mine = sleeper()
        report(reply=request("/v1/register", registration(mine.pid, "victim", rank=1)))
        mine.kill()
    """,
    )
    status, body = out["reply"]
    assert (status, body["code"]) == (403, "job_owned"), body
    assert "victim" in body["error"] and "uid" in body["error"]
    assert set(ranks_of(sidecar, "victim")) == {0}


def test_another_user_cannot_take_over_a_rank_with_a_higher_restart_count(rig):
    """Row 7: the real rank would be locked out and its real hang never acted on."""
    sidecar, mallory, victim_pid, _ = rig
    out = attack(
        mallory,
        sidecar,
        """
        mine = sleeper()
        report(reply=request("/v1/register", registration(mine.pid, "victim", rank=0, restart_count=7)))
        mine.kill()
    """,
    )
    status, body = out["reply"]
    assert (status, body["code"]) == (403, "job_owned"), body
    rank = ranks_of(sidecar, "victim")[0]
    assert rank["pid"] == victim_pid and rank["restart_count"] == 0


def test_another_user_cannot_push_to_or_deregister_a_rank(rig):
    sidecar, mallory, victim_pid, _ = rig
    out = attack(
        mallory,
        sidecar,
        f"""
        ident = {{"job_id": "victim", "rank": 0, "pid": {victim_pid}}}
        push = request("/v1/push", dict(ident, items=[{{"type": "step", "step": 99}}]))
        dereg = request("/v1/deregister", dict(ident, reason="finished"))
        report(push=push, dereg=dereg)
    """,
    )
    assert out["push"][0] == 403 and out["dereg"][0] == 403, out
    rank = ranks_of(sidecar, "victim")[0]
    assert rank["step"] == 1 and rank["state"] != "gone"


def test_a_job_id_is_free_again_once_its_ranks_are_gone(rig):
    sidecar, mallory, victim_pid, victim = rig
    kill_tree(victim)
    wait_until(lambda: ranks_of(sidecar, "victim")[0]["state"] == "gone", 30, what="the victim's rank gone")
    out = attack(
        mallory,
        sidecar,
        """
        mine = sleeper()
        report(reply=request("/v1/register", registration(mine.pid, "victim", rank=0)))
        mine.kill()
    """,
    )
    assert out["reply"][0] == 200, out
