"""A job's own observe-only (wire protocol 6, a registration's `observe_only`): honoured while
`watchdog.allow_job_observe_only`, ignored (and logged) when the node forbids it; the answer and
`/v1/status` say which. What the watchdog then does: tests/watchdog/test_shadow.py and
tests/watchdog/test_shadow_mode.py."""

from __future__ import annotations

import logging

from tests.daemon.helpers import registration


async def rank_entry(sidecar, job: str = "run-42") -> dict:
    status = (await sidecar.get("/v1/status")).body
    return next(r for r in status["ranks"] if r["job_id"] == job)


async def test_a_job_that_asks_for_observe_only_gets_it_and_is_told(sidecar, child_pid, caplog):
    caplog.set_level(logging.INFO, "sidecar.daemon.api")
    reply = await sidecar.post("/v1/register", registration(child_pid, observe_only=True))
    assert reply.status == 200, reply.body
    assert reply.body["observe_only"] is True
    assert (await rank_entry(sidecar))["observe_only"] is True
    assert "asks for observe-only (its job's stalls reported, never killed): honoured" in caplog.text


async def test_a_node_that_forbids_it_ignores_the_request_and_says_so(serve, child_pid, caplog):
    caplog.set_level(logging.INFO, "sidecar.daemon.api")
    sidecar = await serve(**{"watchdog.allow_job_observe_only": False})
    reply = await sidecar.post("/v1/register", registration(child_pid, observe_only=True))
    assert reply.status == 200, reply.body  # registered all the same: watched, and killed when hung
    assert reply.body["observe_only"] is False
    assert (await rank_entry(sidecar))["observe_only"] is False
    assert "ignored (watchdog.allow_job_observe_only is off)" in caplog.text


async def test_without_the_request_a_job_has_the_node_s_mode(sidecar, child_pid):
    reply = await sidecar.post("/v1/register", registration(child_pid, observe_only=None))
    assert reply.status == 200 and reply.body["observe_only"] is False
    assert (await rank_entry(sidecar))["observe_only"] is False


async def test_on_an_observe_only_node_every_job_is_told_so(serve, child_pid):
    sidecar = await serve(**{"watchdog.observe_only": True})
    reply = await sidecar.post("/v1/register", registration(child_pid))
    assert reply.status == 200 and reply.body["observe_only"] is True  # the node's own mode
    assert (await rank_entry(sidecar))["observe_only"] is False  # the job did not ask


async def test_observe_only_must_be_a_boolean(sidecar, child_pid):
    reply = await sidecar.post("/v1/register", registration(child_pid, observe_only="yes"))
    assert reply.status == 400 and reply.code == "bad_field"
    assert "observe_only" in reply.body["error"]
