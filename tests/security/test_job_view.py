"""The job view's trust model (docs/security.md, "The job view"): a peer or a rank may lie. A lie
may mislabel a report; it can never get a process of another user or another job signalled, nor
stop a real hang from being remediated (at most delay it by job_view.launcher_grace_seconds).
Each attack runs as an unprivileged user against a real sidecar, next to another user's job."""

from __future__ import annotations

import http.client
import json
import time
from textwrap import dedent

import pytest

from tests.security.rig import attack, open_sidecar, ranks_of, start_as
from tests.support import free_port, kill_tree, wait_until
from tests.unpriv import unprivileged_user

FAST = (
    "node_name=n1",
    "hooks_flush_interval_seconds=0.5",
    "watchdog.check_interval_seconds=0.25",
    "watchdog.floor_seconds=3",
    "remediation.dump_wait_seconds=0.5",
    "remediation.grace_seconds=1",
    "job_view.verdict_wait_seconds=1",
    "job_view.report_interval_seconds=1",
    "job_view.lost_after_seconds=5",
    "job_view.launcher_grace_seconds=6",
)

# A rank of a 2-rank job that trains a few steps, names this node's sidecar as its job's
# coordinator (as rank 0's hooks do through the job's store), then hangs.
HANGING_RANK = """
    rank = sleeper()
    job = os.environ["JOB"]
    status, body = request("/v1/register", registration(rank.pid, job, world_size=2))
    assert status == 200, body
    offer = body["job_view"]
    items = [{"type": "step", "step": s} for s in (1, 2, 3)]
    items.append({"type": "event", "name": "job_coordinator", "fields": {"url": offer["url"], "node": offer["node"]}})
    status, body = request("/v1/push", {"job_id": job, "rank": 0, "pid": rank.pid, "items": items})
    assert status == 200, body
    report(pid=rank.pid, offer=offer)
    time.sleep(600)
"""


def start_job(user, sidecar, job: str, code: str = HANGING_RANK, before: str = ""):
    return start_as(user, sidecar, dedent(before) + f"os.environ['JOB'] = {job!r}\n" + dedent(code))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def users():
    return unprivileged_user("alice"), unprivileged_user("mallory")


def test_forged_reports_for_another_users_job_delay_its_remediation_but_never_stop_it(users):
    """Mallory reports a fake node of alice's job whose rank sits at a lower step and does not
    wait: the coordinator names it, alice's node leaves its own (really hung) rank to the
    launcher, and kills it itself once job_view.launcher_grace_seconds have passed."""
    alice, mallory = users
    with open_sidecar(*FAST) as sidecar:
        victim, info = start_job(alice, sidecar, "victim")
        try:
            forger, _ = start_as(
                mallory,
                sidecar,
                """
                forged = {"job_id": "victim", "node": "evil", "world_size": 2, "time": time.time(),
                          "ranks": [{"rank": 1, "local_rank": 0, "state": "stalled", "step": 0, "phase": None,
                                     "progress_age_seconds": 99.0, "waiting": False, "stack_top": "lie (x.py:1)"}]}
                report(first=request("/v1/jobs/victim/report", forged))
                while True:  # keep the fake node fresh
                    forged["time"] = time.time()
                    request("/v1/jobs/victim/report", forged)
                    time.sleep(0.5)
                """,
            )
            try:
                started = time.monotonic()
                wait_until(lambda: not alive(info["pid"]), 60, what="alice's hung rank killed")
                took = time.monotonic() - started
            finally:
                kill_tree(forger)
            record = next(i for i in sidecar.status()["incidents"] if i["job_id"] == "victim")
            full = json.loads(open(record["path"]).read())
            assert full["outcome"] == "killed" and (full["blamed_rank"], full["blamed_node"]) == (1, "evil")
            assert any("job_view.launcher_grace_seconds" in n for n in full["notes"]), full["notes"]
            assert took < 3 + 1 + 6 + 20, took  # floor + verdict wait + launcher grace + a loaded machine
        finally:
            kill_tree(victim)


def test_a_lying_coordinator_gets_no_other_users_process_signalled(users, tmp_path):
    """Mallory points her own job at a coordinator she runs, which blames rank 0 of node n1 (the
    rank number alice's job uses too) with a verdict that says every node has dumped. Her job's
    stall ends with her own process killed; alice's healthy rank is never touched."""
    alice, mallory = users
    with open_sidecar(*FAST) as sidecar:
        healthy = """
            rank = sleeper()
            status, body = request("/v1/register", registration(rank.pid, "alice-job", world_size=2))
            assert status == 200, body
            report(pid=rank.pid)
            step = 1
            while True:
                request("/v1/push", {"job_id": "alice-job", "rank": 0, "pid": rank.pid,
                                     "items": [{"type": "step", "step": step}]})
                step += 1
                time.sleep(0.3)
        """
        victim, vinfo = start_as(alice, sidecar, healthy)
        port = free_port()
        liar = f"""
            import http.server, threading
            VERDICT = {{"job_id": "evil", "job_incident": "lie-1", "version": 7, "opened": time.time(),
                        "culprit": {{"rank": 0, "node": "n1", "step": 1, "reason": "a lie"}},
                        "nodes": ["n1"], "dumped": ["n1"], "lost_nodes": []}}
            class Liar(http.server.BaseHTTPRequestHandler):
                def answer(self):
                    body = json.dumps({{"ok": True, "verdict": VERDICT}}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                def do_POST(self):
                    self.rfile.read(int(self.headers.get("Content-Length", 0)))
                    self.answer()
                do_GET = answer
                def log_message(self, *a):
                    pass
            server = http.server.ThreadingHTTPServer(("127.0.0.1", {port}), Liar)
            threading.Thread(target=server.serve_forever, daemon=True).start()
        """
        own = HANGING_RANK.replace('offer["url"]', f'"http://127.0.0.1:{port}"')
        mine, minfo = start_job(mallory, sidecar, "evil", own, before=liar)
        try:
            wait_until(lambda: not alive(minfo["pid"]), 60, what="mallory's own stalled rank killed")
            assert alive(vinfo["pid"]), "alice's process was signalled"
            assert ranks_of(sidecar, "alice-job")[0]["state"] == "healthy"
            jobs = sidecar.status()["jobs"]
            assert jobs["evil"]["url"] == f"http://127.0.0.1:{port}" and "alice-job" not in jobs
        finally:
            kill_tree(mine)
            kill_tree(victim)


def test_a_rank_cannot_name_the_coordinator_of_another_users_job(users):
    alice, mallory = users
    with open_sidecar(*FAST) as sidecar:
        victim, info = start_job(alice, sidecar, "victim")
        try:
            out = attack(
                mallory,
                sidecar,
                """
                item = {"type": "event", "name": "job_coordinator",
                        "fields": {"url": "http://127.0.0.1:1", "node": "evil"}}
                report(reply=request("/v1/push", {"job_id": "victim", "rank": 0, "pid": PID, "items": [item]}))
                """.replace("PID", str(info["pid"])),
            )
            assert out["reply"][0] == 403, out
            assert sidecar.status()["jobs"]["victim"]["coordinator"] == "n1"
        finally:
            kill_tree(victim)


def test_another_user_cannot_read_a_jobs_story_over_the_socket(users):
    alice, mallory = users
    with open_sidecar(*FAST) as sidecar:
        victim, _ = start_job(alice, sidecar, "victim")
        try:
            out = attack(mallory, sidecar, 'report(reply=request("/v1/jobs/victim/story", None, method="GET"))')
            assert out["reply"][0] == 403 and "root only" in out["reply"][1]["error"], out
        finally:
            kill_tree(victim)


def get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_with_a_token_an_unsigned_or_forged_peer_request_is_refused(tmp_path):
    from sidecar.jobview import auth
    from tests.support import Sidecar

    with Sidecar(tmp_path, *FAST, env={"SIDECAR_TOKEN": "cluster-secret"}) as sidecar:
        status, body = get(sidecar.port, "/v1/jobs/j1/verdict")
        assert (status, body["code"]) == (401, "unauthorized")
        forged, _ = auth.sign_request("a-guess", "GET", "/v1/jobs/j1/verdict", b"")
        status, body = get(sidecar.port, "/v1/jobs/j1/verdict", {auth.REQUEST_HEADER: forged})
        assert (status, body["code"]) == (401, "unauthorized")
        header, _ = auth.sign_request("cluster-secret", "GET", "/v1/jobs/j1/verdict", b"")
        status, body = get(sidecar.port, "/v1/jobs/j1/verdict", {auth.REQUEST_HEADER: header})
        assert (status, body["code"]) == (404, "not_coordinator")  # signed: past the door, no such job here
