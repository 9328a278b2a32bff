"""The push API over real sockets: what it accepts, and that every refusal is a 4xx JSON
body naming the problem while the daemon stays up and its series stay bounded."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tests.daemon.helpers import push_body, registration, series, step_item


async def still_up(sidecar) -> None:
    assert (await sidecar.get("/healthz")).status == 200


async def test_register_answers_the_key_and_the_diag_dir(sidecar, child_pid, tmp_path):
    reply = await sidecar.post("/v1/register", registration(child_pid))
    assert reply.status == 200, reply.body
    assert reply.body["ok"] is True and reply.body["key"] == "run-42/0"
    assert reply.body["diag_dir"] == str(tmp_path / "diag" / "run-42")
    assert reply.body["flush_interval_s"] > 0
    assert reply.body["stack_dump"] is None  # no dump signal asked for: no file


async def test_the_sidecar_creates_the_dump_file_and_ignores_a_path_the_rank_names(sidecar, child_pid, tmp_path):
    named = tmp_path / "named-by-the-rank.stacks"
    reply = await sidecar.post("/v1/register", registration(child_pid, stack_dump={"signal": 12, "path": str(named)}))
    assert reply.status == 200, reply.body
    path = reply.body["stack_dump"]["path"]
    assert reply.body["stack_dump"]["signal"] == 12
    assert os.path.dirname(path) == reply.body["diag_dir"] and not named.exists()
    st = os.lstat(path)
    assert st.st_size == 0 and st.st_mode & 0o777 == 0o600 and st.st_uid == os.stat(f"/proc/{child_pid}").st_uid
    assert os.stat(reply.body["diag_dir"]).st_mode & 0o022 == 0
    again = await sidecar.post("/v1/register", registration(child_pid, stack_dump={"signal": 12}))
    assert again.body["stack_dump"]["path"] == path  # the same process registering again keeps its file


async def test_registration_over_the_socket_records_a_verified_identity(sidecar, child_pid):
    import psutil

    from sidecar.daemon.api import DAEMON

    await sidecar.post("/v1/register", registration(child_pid))
    rank = sidecar.app[DAEMON].registry.get("run-42", 0)
    assert rank.peer_verified is True
    # The start time is boot-relative: psutil's wall-clock create_time less the boot time.
    process = psutil.Process(child_pid)
    assert abs(psutil.boot_time() + rank.pid_start_time - process.create_time()) < 0.05


async def test_a_pid_that_is_not_the_callers_is_refused_over_the_socket(sidecar, stranger_pid):
    reply = await sidecar.post("/v1/register", registration(stranger_pid))
    assert (reply.status, reply.code) == (403, "pid_mismatch")
    assert str(stranger_pid) in reply.body["error"]


async def test_over_loopback_tcp_the_client_process_is_looked_up(sidecar, child_pid, stranger_pid):
    from sidecar.daemon.api import DAEMON

    reply = await sidecar.post("/v1/register", registration(stranger_pid), tcp=True)
    assert (reply.status, reply.code) == (403, "pid_mismatch")
    reply = await sidecar.post("/v1/register", registration(child_pid), tcp=True)
    assert reply.status == 200
    assert sidecar.app[DAEMON].registry.get("run-42", 0).peer_verified is True


async def test_a_rank_held_by_another_live_process_of_the_same_attempt_is_refused(sidecar, spawn):
    first, second = spawn().pid, spawn().pid
    assert (await sidecar.post("/v1/register", registration(first))).status == 200
    reply = await sidecar.post("/v1/register", registration(second))
    assert (reply.status, reply.code) == (409, "rank_taken") and f"held by pid {first}" in reply.body["error"]
    # A restarted worker (torchrun's restart count went up) takes the rank over.
    assert (await sidecar.post("/v1/register", registration(second, restart_count=1))).status == 200


async def test_over_tcp_a_push_or_deregistration_needs_the_session_of_the_registration(sidecar, child_pid):
    reply = await sidecar.post("/v1/register", registration(child_pid), tcp=True)
    session = reply.body["session"]
    forged = push_body(child_pid, [step_item(1)])
    reply = await sidecar.post("/v1/push", forged, tcp=True)
    assert (reply.status, reply.code) == (409, "unknown_rank") and "session: missing" in reply.body["error"]
    reply = await sidecar.post("/v1/push", {**forged, "session": "guess"}, tcp=True)
    assert (reply.status, reply.code) == (409, "unknown_rank") and "session: stale" in reply.body["error"]
    reply = await sidecar.post("/v1/deregister", {"job_id": "run-42", "rank": 0, "pid": child_pid}, tcp=True)
    assert reply.status == 409
    reply = await sidecar.post("/v1/push", {**forged, "session": session}, tcp=True)
    assert reply.status == 200
    # A new registration makes the old session stale.
    await sidecar.post("/v1/register", registration(child_pid), tcp=True)
    reply = await sidecar.post("/v1/push", {**push_body(child_pid, [step_item(2)]), "session": session}, tcp=True)
    assert reply.status == 409


@pytest.mark.parametrize("pid", [1, "self", "parent"])
async def test_init_the_sidecar_and_its_ancestors_may_never_register(sidecar, pid):
    pid = {"self": os.getpid(), "parent": os.getppid()}.get(pid, pid)
    reply = await sidecar.post("/v1/register", registration(pid))
    assert (reply.status, reply.code) == (403, "pid_mismatch")


async def test_pushed_steps_show_as_training_series(sidecar, child_pid):
    await sidecar.post("/v1/register", registration(child_pid))
    t = time.time()
    reply = await sidecar.post(
        "/v1/push",
        push_body(
            child_pid,
            [
                step_item(1, t - 1.0, loss=2.5, lr=3e-4, samples=64),
                step_item(2, t - 0.5, loss="nan", grad_norm=0.9, samples=64, mfu=0.41),
                {"type": "event", "name": "checkpoint_saved", "time": t, "fields": {"step": 2, "path": "/c/step-2"}},
            ],
            dropped=3,
        ),
    )
    assert (reply.status, reply.body) == (200, {"ok": True, "accepted": 3})
    text = await sidecar.metrics()
    labels = '{job_id="run-42",rank="0"}'
    assert f"sidecar_training_step{labels} 2.0" in text
    assert f"sidecar_training_loss{labels} NaN" in text
    assert f"sidecar_training_learning_rate{labels} 0.0003" in text
    assert f"sidecar_training_iterations_per_second{labels} 2.0" in text
    assert f"sidecar_training_samples_per_second{labels} 128.0" in text
    assert f"sidecar_training_last_checkpoint_step{labels} 2.0" in text
    assert f"sidecar_hooks_dropped_records_total{labels} 3.0" in text
    assert 'sidecar_training_nonfinite_total{job_id="run-42",metric="loss",rank="0"} 1.0' in text
    assert 'sidecar_training_custom{job_id="run-42",name="mfu",rank="0"} 0.41' in text
    assert 'sidecar_training_ranks_registered{job_id="run-42"} 1.0' in text
    assert 'sidecar_ingest_records_total{type="step"} 2.0' in text


async def test_a_declared_phase_shows_until_it_ends(sidecar, child_pid):
    await sidecar.post("/v1/register", registration(child_pid))
    start = {"type": "phase", "name": "checkpoint_save", "action": "start", "time": time.time(), "timeout_seconds": 60}
    await sidecar.post("/v1/push", push_body(child_pid, [start]))
    assert 'sidecar_training_phase{job_id="run-42",phase="checkpoint_save",rank="0"} 1.0' in await sidecar.metrics()
    await sidecar.post("/v1/push", push_body(child_pid, [dict(start, action="end")]))
    assert series(await sidecar.metrics(), "sidecar_training_phase") == []


async def test_deregistered_ranks_take_no_more_pushes(sidecar, child_pid):
    await sidecar.post("/v1/register", registration(child_pid))
    reply = await sidecar.post(
        "/v1/deregister", {"job_id": "run-42", "rank": 0, "pid": child_pid, "reason": "finished"}
    )
    assert reply.status == 200
    reply = await sidecar.post("/v1/push", push_body(child_pid, [step_item(1)]))
    assert (reply.status, reply.code) == (409, "unknown_rank")
    assert 'sidecar_training_ranks_registered{job_id="run-42"} 0.0' in await sidecar.metrics()


@pytest.mark.parametrize(
    "body, status, code, named",
    [
        (b"{not json", 400, "bad_json", "not valid JSON"),
        (b'{"job_id": "run-42", "rank": 0, "pid": 5, "items": [], "x": NaN}', 400, "bad_json", "NaN"),
        (b'{"job_id": "run-42", "rank": 0, "pid": 5, "items": [], "x": -Infinity}', 400, "bad_json", "Infinity"),
        (b"[]", 400, "bad_json", "JSON object"),
        ({"job_id": "run-42", "rank": "0", "pid": 5, "items": []}, 400, "bad_field", "rank:"),
        ({"job_id": "run-42", "rank": 0, "pid": 5}, 400, "bad_field", "items:"),
        (
            {"job_id": "run-42", "rank": 0, "pid": 5, "items": [{"type": "step", "step": -1}]},
            400,
            "bad_field",
            "items[0].step:",
        ),
        (
            {"job_id": "nobody", "rank": 0, "pid": 5, "items": [{"type": "step", "step": 1}]},
            409,
            "unknown_rank",
            "nobody/0",
        ),
    ],
)
async def test_bad_pushes_get_a_json_error_naming_the_problem(sidecar, body, status, code, named):
    reply = await sidecar.post("/v1/push", body)
    assert (reply.status, reply.code) == (status, code), reply.body
    assert named in reply.body["error"]
    await still_up(sidecar)


async def test_decreasing_steps_are_refused(sidecar, child_pid):
    await sidecar.post("/v1/register", registration(child_pid))
    await sidecar.post("/v1/push", push_body(child_pid, [step_item(10)]))
    reply = await sidecar.post("/v1/push", push_body(child_pid, [step_item(11), step_item(9)]))
    assert (reply.status, reply.code) == (409, "step_not_increasing")
    assert "items[1].step" in reply.body["error"]
    assert 'sidecar_training_step{job_id="run-42",rank="0"} 10.0' in await sidecar.metrics()


async def test_a_body_over_the_size_limit_is_413(serve, child_pid):
    sidecar = await serve(limits__max_body_bytes=2048)
    reply = await sidecar.post("/v1/push", push_body(child_pid, [step_item(i) for i in range(200)]))
    assert (reply.status, reply.code) == (413, "too_large") and "limits.max_body_bytes" in reply.body["error"]

    async def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(10):
            yield b" " * 1024

    reply = await sidecar.post("/v1/push", chunks())
    assert (reply.status, reply.code) == (413, "too_large")
    await still_up(sidecar)


async def test_too_many_items_in_one_push_is_413(serve, child_pid):
    sidecar = await serve(limits__max_items_per_push=5)
    await sidecar.post("/v1/register", registration(child_pid))
    reply = await sidecar.post("/v1/push", push_body(child_pid, [step_item(i) for i in range(1, 7)]))
    assert (reply.status, reply.code) == (413, "too_large") and "limits.max_items_per_push" in reply.body["error"]


async def test_thousands_of_job_names_are_refused_beyond_the_limit(serve, child_pid):
    sidecar = await serve(limits__max_jobs=4)
    codes = [(await sidecar.post("/v1/register", registration(child_pid, job=f"job-{i}"))).code for i in range(1000)]
    assert codes[:4] == [None] * 4 and set(codes[4:]) == {"limit_exceeded"}
    reply = await sidecar.post("/v1/register", registration(child_pid, job="one-more"))
    assert reply.status == 429 and "limits.max_jobs is 4" in reply.body["error"]
    assert len(series(await sidecar.metrics(), "sidecar_training_world_size")) == 4
    await still_up(sidecar)


async def test_thousands_of_custom_metric_names_stay_bounded(serve, child_pid):
    sidecar = await serve(limits__max_custom_metrics=8)
    await sidecar.post("/v1/register", registration(child_pid))
    for step in range(1, 201):
        names = {f"metric_{step}_{i}": 1.0 for i in range(10)}
        reply = await sidecar.post("/v1/push", push_body(child_pid, [step_item(step, **names)]))
        assert (reply.status, reply.code) == (429, "limit_exceeded")
        assert "limits.max_custom_metrics is 8" in reply.body["error"]
    reply = await sidecar.post("/v1/push", push_body(child_pid, [step_item(1, **{f"m{i}": 1.0 for i in range(8)})]))
    assert reply.status == 200
    assert len(series(await sidecar.metrics(), "sidecar_training_custom")) == 8


async def test_unknown_paths_and_methods_answer_json(sidecar):
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/push", 405)):
        reply = await sidecar.request(method, path)
        assert reply.status == status and reply.code in ("not_found", "method_not_allowed")


async def test_garbage_never_takes_the_daemon_down(sidecar, child_pid):
    await sidecar.post("/v1/register", registration(child_pid))
    garbage = [
        b"\x00" * 100,
        b'{"job_id": {"a": 1}}',
        b'{"items": null}',
        b"1e999",
        b'"\\ud800"',
        b'{"job_id": "run-42", "rank": 1e400, "pid": 1}',
        b'{"job_id": "%s"}' % (b"\\u0000" * 10),
    ]
    for body in garbage:
        for path in ("/v1/register", "/v1/push", "/v1/deregister"):
            reply = await sidecar.post(path, body)
            assert 400 <= reply.status < 500 and reply.code, (path, body, reply)
    reply = await sidecar.post(
        "/v1/push", b'{"job_id":"run-42","rank":0,"pid":%d,"items":[{"type":"step","step":1e400}]}' % child_pid
    )
    assert (reply.status, reply.code) == (400, "bad_field")
    await still_up(sidecar)
    assert "sidecar_ingest_rejected_requests_total" in await sidecar.metrics()


async def test_a_configured_token_guards_the_push_api_over_tcp_only(serve, child_pid, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    sidecar = await serve(token_file=str(token_file))
    reply = await sidecar.post("/v1/register", registration(child_pid), tcp=True)
    assert (reply.status, reply.code) == (401, "unauthorized")
    reply = await sidecar.post(
        "/v1/register", registration(child_pid), tcp=True, headers={"Authorization": "Bearer wrong"}
    )
    assert reply.status == 401
    reply = await sidecar.post(
        "/v1/register", registration(child_pid), tcp=True, headers={"Authorization": "Bearer s3cret"}
    )
    assert reply.status == 200
    assert (await sidecar.post("/v1/register", registration(child_pid))).status == 200  # the Unix socket
    assert (await sidecar.get("/metrics", tcp=True)).status == 200
    assert (await sidecar.get("/v1/status", tcp=True)).status == 200


async def test_gone_ranks_leave_metrics_after_the_retention(serve, child_pid):
    sidecar = await serve(limits__gone_retention_seconds=0.4)
    await sidecar.post("/v1/register", registration(child_pid))
    await sidecar.post("/v1/push", push_body(child_pid, [step_item(1)]))
    await sidecar.post("/v1/deregister", {"job_id": "run-42", "rank": 0, "pid": child_pid})
    assert series(await sidecar.metrics(), "sidecar_training_step")  # still shown while retained
    for _ in range(100):
        if not series(await sidecar.metrics(), "sidecar_training_step"):
            break
        await asyncio.sleep(0.1)
    assert series(await sidecar.metrics(), "sidecar_training_step") == []
    assert (await sidecar.get("/v1/status")).body["ranks"] == []
