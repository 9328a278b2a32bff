"""Row 8 of the security issue: quotas per owner, not per node. One unprivileged user filling
every job slot, or spending the storm cap with stalls of its own, used to leave other users'
jobs unwatched (429) and a root job's real hang unremediated ("storm cap reached"). Each
attack runs as an unprivileged user against a real sidecar."""

from __future__ import annotations

import textwrap

from tests.security.rig import attack, open_sidecar, register_as_root, start_as
from tests.support import kill_tree, wait_until
from tests.support.unpriv import unprivileged_user

FILL_JOBS = """
    kept, replies = [], []
    for i in range(20):
        p = sleeper()
        kept.append(p)
        replies.append(request("/v1/register", registration(p.pid, f"hog-{i}", world_size=1)))
    report(replies=replies)
    time.sleep(600)
"""


def test_one_user_cannot_take_every_job_slot():
    mallory, alice = unprivileged_user("mallory"), unprivileged_user("alice")
    with open_sidecar() as sidecar:
        hog_process, hog = start_as(mallory, sidecar, FILL_JOBS)
        kill_tree_later = hog_process
        statuses = [status for status, _ in hog["replies"]]
        assert statuses[:4] == [200] * 4 and set(statuses[4:]) == {429}, statuses
        assert "limits.max_jobs_per_user is 4" in hog["replies"][4][1]["error"]
        out = attack(
            alice,
            sidecar,
            """
            p = sleeper()
            report(reply=request("/v1/register", registration(p.pid, "alices-job", world_size=1)))
            p.kill()
        """,
        )
        assert out["reply"][0] == 200, out
        kill_tree(kill_tree_later)


def test_one_user_cannot_take_every_rank_or_custom_metric_name():
    mallory, alice = unprivileged_user("mallory"), unprivileged_user("alice")
    with open_sidecar("limits.max_ranks_per_user=6", "limits.max_custom_metrics_per_user=40") as sidecar:
        code = textwrap.dedent("""
            kept, ranks, pushes = [], [], []
            for i in range(4):
                p = sleeper()
                kept.append(p)
                ranks.append(request("/v1/register", registration(p.pid, JOB, rank=i, world_size=8))[0])
            for i in range(2):  # 32 custom names per job at most; 40 per user
                p = sleeper()
                kept.append(p)
                request("/v1/register", registration(p.pid, JOB + str(i), world_size=1))
                metrics = {f"m{i}_{n}": 1.0 for n in range(30)}
                pushes.append(request("/v1/push", {"job_id": JOB + str(i), "rank": 0, "pid": p.pid,
                                                   "items": [{"type": "step", "step": 1, "metrics": metrics}]}))
            p = sleeper()  # the seventh rank of this user
            kept.append(p)
            ranks.append(request("/v1/register", registration(p.pid, JOB, rank=5, world_size=8))[0])
            report(ranks=ranks, pushes=pushes)
            for p in kept:
                p.kill()
        """)
        hog = attack(mallory, sidecar, "JOB = 'hog'\n" + code)
        assert hog["ranks"] == [200, 200, 200, 200, 429], hog
        assert hog["pushes"][0][0] == 200 and hog["pushes"][1][0] == 429, hog["pushes"]
        assert "limits.max_custom_metrics_per_user is 40" in hog["pushes"][1][1]["error"]
        out = attack(alice, sidecar, "JOB = 'fair'\n" + code.replace("range(4)", "range(3)"))
        assert out["ranks"] == [200, 200, 200, 200] and out["pushes"][0][0] == 200, out


STORM = (
    "watchdog.startup_timeout_seconds=2",
    "watchdog.floor_seconds=3",
    "hooks_flush_interval_seconds=0.5",
    "watchdog.check_interval_seconds=0.25",
    "remediation.dump_wait_seconds=0",
    "remediation.grace_seconds=1",
)

OWN_STALLS = """
    kept = [subprocess.Popen(["sleep", "600"], start_new_session=True) for _ in range(4)]
    replies = [request("/v1/register", registration(p.pid, f"storm-{i}", world_size=1))[0] for i, p in enumerate(kept)]
    deadline = time.time() + 60
    while time.time() < deadline and sum(p.poll() is not None for p in kept) < 3:
        time.sleep(0.2)
    time.sleep(3)  # the fourth stalls too, and must be left alone
    report(replies=replies, killed=[p.poll() is not None for p in kept])
    for p in kept:
        p.kill()
"""


def test_one_user_s_stalls_do_not_spend_the_storm_cap_of_a_root_job(spawn):
    mallory = unprivileged_user("mallory")
    with open_sidecar(*STORM) as sidecar:
        out = attack(mallory, sidecar, OWN_STALLS, timeout=120)
        assert out["replies"] == [200] * 4
        assert sorted(out["killed"]) == [False, True, True, True], out  # 3 per user per window
        outcomes = {i["job_id"]: i["outcome"] for i in sidecar.status()["incidents"]}
        assert sorted(outcomes.values()) == ["killed", "killed", "killed", "suppressed"], outcomes
        root_rank = spawn()
        assert register_as_root(sidecar, root_rank.pid, "root-job") == 200
        wait_until(lambda: root_rank.poll() is not None, 60, what="the root job's hang remediated")
        wait_until(
            lambda: any(i["job_id"] == "root-job" and i["outcome"] == "killed" for i in sidecar.status()["incidents"]),
            30,
            what="the root job's incident",
        )
