"""Round 2, rows 7 and 9: registrations over TCP that no process could be found for.

TCP carries no peer credentials: the sidecar looks up the local process that holds the client end
of the connection. A client that sends its whole registration and exits before the lookup
(here: the last byte held back with TCP_CORK, flushed by the kernel when the process has
already closed the socket) leaves nothing to find: the registration is recorded *unverified*,
naming any pid it likes. Such a rank is never signalled; it must also cost nobody anything:
no slot of the storm cap another job's real hang needs (row 7), no py-spy of a process the
caller could not read itself (row 9).
"""

from __future__ import annotations

import json

from tests.security.rig import attack, open_sidecar, ranks_of, register_as_root
from tests.support import kill_tree, wait_until
from tests.support.unpriv import run_as, unprivileged_user

STALLS = (
    "watchdog.startup_timeout_seconds=2",
    "watchdog.floor_seconds=3",
    "hooks_flush_interval_seconds=0.5",
    "watchdog.check_interval_seconds=0.25",
    "remediation.dump_wait_seconds=0",
    "remediation.grace_seconds=1",
)

# Register `claimed` under `job` over TCP, then exit before the sidecar looks for the caller.
UNVERIFIED = """
    def unverified(port, claimed, job):
        body = json.dumps(registration(claimed, job, world_size=1)).encode()
        head = (f"POST /v1/register HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n"
                f"Content-Length: {{len(body)}}\\r\\nConnection: close\\r\\n\\r\\n").encode()
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head + body[:-1])
        time.sleep(0.2)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
        s.send(body[-1:])  # held back by the cork until the socket closes, when this process exits
        os._exit(0)

    for job, claimed in {claims}:
        child = os.fork()
        if child == 0:
            unverified({port}, claimed, job)
        os.waitpid(child, 0)
    report(done=True)
"""


def register_unverified(user, sidecar, claims: list[tuple[str, int]]) -> None:
    attack(user, sidecar, UNVERIFIED.format(port=sidecar.port, claims=repr(claims)))
    jobs = {job for job, _ in claims}
    wait_until(
        lambda: jobs <= {r["job_id"] for r in sidecar.status()["ranks"]},
        30,
        what="the unverified registrations",
    )


def test_row7_stalls_of_unverified_registrations_spend_no_slot_of_the_storm_cap(spawn):
    mallory = unprivileged_user("mallory")
    with open_sidecar(*STALLS, "remediation.max_per_window=3", "remediation.max_per_window_node=3") as sidecar:
        sleepers = [spawn() for _ in range(3)]
        register_unverified(mallory, sidecar, [(f"unverified-{i}", p.pid) for i, p in enumerate(sleepers)])
        wait_until(
            lambda: len([i for i in sidecar.status()["incidents"] if i["job_id"].startswith("unverified-")]) == 3,
            30,
            what="the three unverified stalls",
        )
        outcomes = {i["job_id"]: i["outcome"] for i in sidecar.status()["incidents"]}
        assert all(p.poll() is None for p in sleepers), "an unverified rank was signalled"
        root_rank = spawn()
        assert register_as_root(sidecar, root_rank.pid, "root-job") == 200
        wait_until(lambda: root_rank.poll() is not None, 60, what="the root job's hang remediated")
        root = [i for i in sidecar.status()["incidents"] if i["job_id"] == "root-job"]
        assert root and root[0]["outcome"] in ("pending", "killed"), (root, outcomes)


def settled(sidecar, job: str) -> list[dict]:
    return [i for i in sidecar.status()["incidents"] if i["job_id"] == job and i["outcome"] != "pending"]


SECRET = "secret_frame_s3cr3t_token"
VICTIM = f"""
import time
def {SECRET}():
    time.sleep(600)
{SECRET}()
"""


def test_row9_an_unverified_registration_gets_no_py_spy_of_another_users_process():
    """The registration names another user's process; when it "stalls", the sidecar used to run
    `py-spy dump` on it as root (pausing it) and put its stack, and whatever a frame's name
    says, into the incident. The docs say: verified ranks only."""
    mallory, alice = unprivileged_user("mallory"), unprivileged_user("alice")
    with open_sidecar(*STALLS, "remediation.py_spy=true") as sidecar:
        victim = run_as(alice, ["/usr/bin/python3", "-c", VICTIM])
        try:
            register_unverified(mallory, sidecar, [("spy", victim.pid)])
            wait_until(
                lambda: [
                    i for i in sidecar.status()["incidents"] if i["job_id"] == "spy" and i["outcome"] != "pending"
                ],
                60,
                what="the unverified stall's incident",
            )
            (record,) = (sidecar.workdir / "diag" / "incidents").glob("*spy.json")
            text = record.read_text()
            assert SECRET not in text, "py-spy read another user's process for an unverified caller"
            assert json.loads(text)["outcome"] == "unverified"
            assert victim.poll() is None
            assert ranks_of(sidecar, "spy")[0]["pid"] == victim.pid
        finally:
            kill_tree(victim)
