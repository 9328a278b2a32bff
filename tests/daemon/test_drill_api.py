"""The drill endpoints (`POST /v1/drills`, `GET /v1/drills/ID`, sidecar/daemon/operations.py) on the
real application, called as root over the Unix socket: the request is validated, a job that nothing
would restart is refused, and what is stopped is a registered rank of the job, chosen by the daemon."""

from __future__ import annotations

import asyncio

import pytest

from tests.daemon.helpers import push_body, registration, step_item

TORCHRUN = {"name": "torchrun", "max_restarts": 3}


def state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


async def stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait for `pid` to be in the stopped state (T), within `timeout` (a loaded machine may take a moment)."""
    for _ in range(int(timeout / 0.05)):
        if state_of(pid) == "T":
            return
        await asyncio.sleep(0.05)
    assert state_of(pid) == "T", f"pid {pid} not stopped within {timeout} s"


async def register(sidecar, pid: int, job: str = "run-42", rank: int = 0, steps: int = 2, **extra) -> None:
    reply = await sidecar.post("/v1/register", registration(pid, job=job, rank=rank, **extra))
    assert reply.status == 200, reply.body
    if steps:
        items = [step_item(s, loss=2.0) for s in range(1, steps + 1)]
        reply = await sidecar.post("/v1/push", push_body(pid, items, job=job, rank=rank))
        assert reply.status == 200, reply.body


@pytest.mark.parametrize(
    "body, field",
    [
        ([], "body"),
        ({"job_id": "run-42", "pid": 1}, "'pid'"),
        ({"job_id": ""}, "job_id"),
        ({"job_id": "x" * 500}, "job_id"),
        ({"job_id": "run-42", "rank": -1}, "rank"),
        ({"job_id": "run-42", "rank": "1"}, "rank"),
        ({"job_id": "run-42", "timeout_seconds": 1e9}, "timeout_seconds"),
        ({"job_id": "run-42", "timeout_seconds": True}, "timeout_seconds"),
    ],
)
async def test_a_bad_drill_request_is_refused_naming_the_field(sidecar, body, field):
    reply = await sidecar.post("/v1/drills", body)
    assert reply.status == 400 and reply.body["error"].startswith(field), reply.body


async def test_a_job_without_ranks_here_is_not_found(sidecar):
    reply = await sidecar.post("/v1/drills", {"job_id": "nobody"})
    assert reply.status == 404 and "no live rank" in reply.body["error"], reply.body


@pytest.mark.parametrize(
    "extra, why",
    [
        ({"launcher": {"name": "none"}}, "not started by a launcher that restarts it"),
        ({"launcher": {"name": "torchrun", "max_restarts": 0}}, "no restart left"),
        ({}, "did not say what restarts it"),
        ({"launcher": TORCHRUN, "restart_safe": False}, "would not come back after a restart"),
        ({"launcher": TORCHRUN, "observe_only": True}, "observed only"),
        # a job of several nodes is drilled only once the job view tells its other nodes (none here)
        ({"launcher": TORCHRUN, "world_size": 4, "local_world_size": 2}, "does not report it to the job's coordinator"),
    ],
)
async def test_a_job_that_nothing_would_restart_is_refused_and_left_running(sidecar, child_pid, extra, why):
    await register(sidecar, child_pid, **extra)
    reply = await sidecar.post("/v1/drills", {"job_id": "run-42"})
    assert reply.status == 409 and reply.body["code"] == "drill_refused", reply.body
    assert why in reply.body["error"], reply.body
    assert state_of(child_pid) != "T"


async def test_a_job_before_its_first_step_is_refused(sidecar, child_pid):
    await register(sidecar, child_pid, steps=0, launcher=TORCHRUN)
    reply = await sidecar.post("/v1/drills", {"job_id": "run-42"})
    assert reply.status == 409 and "first step" in reply.body["error"], reply.body


async def test_a_rank_not_of_the_job_is_not_found(sidecar, child_pid):
    await register(sidecar, child_pid, launcher=TORCHRUN)
    reply = await sidecar.post("/v1/drills", {"job_id": "run-42", "rank": 1})
    assert reply.status == 404 and reply.body["error"].startswith("rank:"), reply.body


async def test_over_tcp_even_loopback_nobody_may_drill(sidecar, child_pid):
    await register(sidecar, child_pid, launcher=TORCHRUN)
    reply = await sidecar.post("/v1/drills", {"job_id": "run-42"}, tcp=True)
    assert reply.status == 403 and reply.body["code"] == "forbidden", reply.body
    reply = await sidecar.get("/v1/drills/drill-x", tcp=True)
    assert reply.status == 403
    assert state_of(child_pid) != "T"


@pytest.mark.slow  # 10 s: the drill waits out its shortest timeout
async def test_a_drill_stops_the_registered_rank_and_continues_it_when_nothing_kills_it(serve, child_pid):
    """With the watchdog off here nothing would detect the stall: refused. With a long floor the
    watchdog does not act within the drill's 10 s: the rank is stopped, then continued."""
    off = await serve(**{"watchdog.enabled": False})
    await register(off, child_pid, launcher=TORCHRUN)
    reply = await off.post("/v1/drills", {"job_id": "run-42"})
    assert reply.status == 409 and "watchdog is off" in reply.body["error"]

    sidecar = await serve(**{"watchdog.floor_seconds": 300})
    await register(sidecar, child_pid, launcher=TORCHRUN)
    reply = await sidecar.post("/v1/drills", {"job_id": "run-42", "timeout_seconds": 10})
    assert reply.status == 200, reply.body
    drill = reply.body["drill"]
    assert (drill["rank"], drill["pid"], drill["step_at_stop"]) == (0, child_pid, 2)
    await stopped(child_pid)  # SIGSTOP is sent; the kernel stops the process when it next runs
    again = await sidecar.post("/v1/drills", {"job_id": "run-42"})
    assert again.status == 409 and "already running" in again.body["error"]
    for _ in range(100):
        answer = (await sidecar.get(f"/v1/drills/{drill['id']}")).body["drill"]
        if answer["finished"]:
            break
        await asyncio.sleep(0.2)
    assert answer["finished"] == "timed_out", answer
    assert state_of(child_pid) != "T", "a drill the watchdog did not end leaves no rank stopped"
    assert (await sidecar.get("/v1/drills/drill-unknown")).status == 404
    assert (await sidecar.get("/v1/drills/" + "%2E" * 3)).status in (400, 404)


async def test_status_and_metrics_carry_the_golive_checks(sidecar, child_pid):
    await register(sidecar, child_pid, launcher=TORCHRUN)
    status = (await sidecar.get("/v1/status")).body
    job = status["golive"]["run-42"]
    assert job["checks"]["ranks_joined"] == {"state": "pending", "text": "1 of 2 local ranks registered (world size 2)"}
    assert job["checks"]["first_batch"]["state"] == "ok"
    assert job["checks"]["loss"]["state"] == "pending"
    metrics = await sidecar.metrics()
    assert 'sidecar_job_golive_check{check="ranks_joined",job_id="run-42"} -1.0' in metrics
    assert 'sidecar_job_golive_check{check="first_batch",job_id="run-42"} 1.0' in metrics
