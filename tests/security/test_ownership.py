"""Rows 6 and 7 of the security issue: a job_id belongs to the uid whose processes registered
it first, until its ranks are gone and its reservation has ended. Another user can neither join
it, take over one of its ranks with a higher restart count, push to it nor deregister it.
Round 2, rows 2 and 6: nothing a user leaves under a job_id reaches its next owner, and its
owner keeps it between its own restart attempts and across a sidecar restart
(ranks/ownership.py). Each attack runs as an unprivileged user against a real sidecar and a
victim job of another unprivileged user."""

from __future__ import annotations

import time

import pytest

from tests.security.rig import attack, open_sidecar, ranks_of, start_as
from tests.support import kill_tree, wait_until
from tests.support.unpriv import unprivileged_user

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


RESERVATION = 2.0  # limits.job_reservation_seconds in these tests (300 s by default)


@pytest.fixture
def rig():
    alice, mallory = unprivileged_user("alice"), unprivileged_user("mallory")
    with open_sidecar(f"limits.job_reservation_seconds={RESERVATION:g}") as sidecar:
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


REGISTER_AS_VICTIM = """
    mine = sleeper()
    report(reply=request("/v1/register", registration(mine.pid, "victim", rank=0)))
    mine.kill()
"""


def test_a_job_id_is_free_again_once_its_ranks_are_gone_and_its_reservation_ended(rig):
    sidecar, mallory, victim_pid, victim = rig
    kill_tree(victim)
    wait_until(lambda: ranks_of(sidecar, "victim")[0]["state"] == "gone", 30, what="the victim's rank gone")
    time.sleep(RESERVATION + 0.5)
    out = attack(mallory, sidecar, REGISTER_AS_VICTIM)
    assert out["reply"][0] == 200, out


# ---------------------------------------------------------------- round 2, row 6: the gap between attempts

NEXT_ATTEMPT = """
    rank = sleeper()
    status, body = request("/v1/register", registration(rank.pid, "victim", restart_count=1))
    report(reply=[status, body], pid=rank.pid)
    time.sleep(600)
"""


def test_row6_a_job_id_stays_its_owners_between_two_restart_attempts(rig):
    """The victim's worker group is gone (torchrun is about to start the next attempt): another
    user polling /v1/status takes the job_id at once. It used to get it, and the victim's next
    attempt got 403 on every registration, so its real hang was never remediated."""
    sidecar, mallory, victim_pid, victim = rig
    alice = unprivileged_user("alice")
    kill_tree(victim)
    wait_until(lambda: ranks_of(sidecar, "victim")[0]["state"] == "gone", 30, what="the victim's rank gone")
    squat = attack(mallory, sidecar, REGISTER_AS_VICTIM)
    status, body = squat["reply"]
    assert (status, body["code"]) == (403, "job_owned"), body
    assert "reserved for uid" in body["error"] and "limits.job_reservation_seconds" in body["error"]
    attempt, out = start_as(alice, sidecar, NEXT_ATTEMPT)
    try:
        assert out["reply"][0] == 200, out
        assert ranks_of(sidecar, "victim")[0]["pid"] == out["pid"]
    finally:
        kill_tree(attempt)


def test_row6_a_job_id_stays_its_owners_across_a_sidecar_restart():
    """Right after a sidecar restart nothing is registered until the hooks register again: the
    first to register a job_id used to get it. The owners are kept in the diagnostics directory,
    so the job stays reserved for its owner's ranks, which re-register with their step."""
    alice, mallory = unprivileged_user("alice"), unprivileged_user("mallory")
    with open_sidecar(f"limits.job_reservation_seconds={RESERVATION:g}") as sidecar:
        victim, _ = start_as(alice, sidecar, VICTIM)
        try:
            sidecar.stop()
            sidecar.start()
            squat = attack(mallory, sidecar, REGISTER_AS_VICTIM)
            status, body = squat["reply"]
            assert (status, body["code"]) == (403, "job_owned"), body
            again = attack(
                alice,
                sidecar,
                """
                rank = sleeper()  # the owner's rank registering again, with the step it had reached
                report(reply=request("/v1/register", registration(rank.pid, "victim", step=1)))
                rank.kill()
            """,
            )
            assert again["reply"][0] == 200, again
        finally:
            kill_tree(victim)


# ---------------------------------------------------------------- round 2, row 2: what a squatter leaves behind

SQUAT_AND_LEAVE = """
    rank = sleeper()
    request("/v1/register", registration(rank.pid, "shared", world_size=1))
    ident = {"job_id": "shared", "rank": 0, "pid": rank.pid}
    names = {f"m{i}": 1.0 for i in range(32)}
    names["samples"] = 1e15
    pushes = [request("/v1/push", dict(ident, items=[
        {"type": "step", "step": 1, "metrics": names},
        *[{"type": "phase", "name": f"p{i}", "action": "start"} for i in range(16)]]))]
    pushes.append(request("/v1/deregister", dict(ident, reason="finished")))
    rank.kill()
    report(pushes=pushes)
"""

OWNER_ARRIVES = """
    rank = sleeper()
    ident = {"job_id": "shared", "rank": 0, "pid": rank.pid}
    reg = request("/v1/register", registration(rank.pid, "shared", world_size=1))
    push = request("/v1/push", dict(ident, items=[
        {"type": "step", "step": 1, "metrics": {"my_metric": 1.0, "samples": 8}},
        {"type": "phase", "name": "my_phase", "action": "start"}]))
    report(reg=reg, push=push)
    time.sleep(600)
"""


def samples_total(sidecar, job_id: str) -> float | None:
    for line in sidecar.metrics().splitlines():
        if line.startswith("sidecar_training_samples_total{") and f'job_id="{job_id}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_row2_a_job_id_used_first_by_another_user_leaves_its_next_owner_nothing():
    """A user registers a job_id before its owner does, fills its custom-metric and phase-name
    tables and its counters, and leaves. Those used to outlive the ranks: the owner's job got
    `429 too many custom metric names` on every batch (and was killed as stalled) and inherited
    samples_total 1e15."""
    alice, mallory = unprivileged_user("alice"), unprivileged_user("mallory")
    with open_sidecar(f"limits.job_reservation_seconds={RESERVATION:g}") as sidecar:
        left = attack(mallory, sidecar, SQUAT_AND_LEAVE)
        assert [status for status, _ in left["pushes"]] == [200, 200], left
        wait_until(lambda: ranks_of(sidecar, "shared")[0]["state"] == "gone", 30, what="the squatter gone")
        time.sleep(RESERVATION + 0.5)  # the squatter's own reservation ends
        owner, out = start_as(alice, sidecar, OWNER_ARRIVES)
        try:
            assert out["reg"][0] == 200, out
            assert out["push"][0] == 200, out
            assert samples_total(sidecar, "shared") == 8.0
        finally:
            kill_tree(owner)
