"""Input from anyone on the node: a fuzz of the push API (fixed seed, thousands of bodies,
never a 5xx), a non-ASCII session over TCP (row 10 of the security issue: it used to raise
TypeError in hmac.compare_digest and answer 500), and connections that never finish a request."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time

from tests.daemon.helpers import push_body, registration, step_item
from tests.support import Sidecar, wait_until

FUZZ_SEED = 20261202
FUZZ_BODIES = 6000


async def test_a_non_ascii_session_over_tcp_is_a_4xx(sidecar, child_pid):
    assert (await sidecar.post("/v1/register", registration(child_pid), tcp=True)).status == 200
    for session in ("sessión", "\udcff", "ß" * 100):
        body = dict(push_body(child_pid, [step_item(1)]), session=session)
        reply = await sidecar.post("/v1/push", json.dumps(body, ensure_ascii=True), tcp=True)
        assert (reply.status, reply.code) == (409, "unknown_rank"), reply.body
        body = {"job_id": "run-42", "rank": 0, "pid": child_pid, "session": session}
        assert (await sidecar.post("/v1/deregister", body, tcp=True)).status == 409
    assert (await sidecar.get("/healthz")).status == 200


def _mutate(rng: random.Random, value, depth: int = 0):
    """A random variation of a JSON value: wrong types, extreme numbers, odd strings."""
    choices = [
        None,
        True,
        False,
        0,
        -1,
        1 << 64,
        -(1 << 63),
        1e308,
        -0.0,
        3.5,
        "",
        "x" * 300,
        "é\u2028\x00",
        "nan",
        "inf",
        "-inf",
        [],
        {},
        [1, "a"],
        {"a": {"b": [None]}},
    ]
    roll = rng.random()
    if roll < 0.3:
        return rng.choice(choices)
    if isinstance(value, dict) and depth < 4:
        out = dict(value)
        for key in list(out):
            if rng.random() < 0.3:
                out[key] = _mutate(rng, out[key], depth + 1)
            elif rng.random() < 0.1:
                del out[key]
        if rng.random() < 0.2:
            out[rng.choice(["extra", "session", "type", "metrics", "\u00e9", "x" * 200])] = rng.choice(choices)
        return out
    if isinstance(value, list) and depth < 4:
        return [_mutate(rng, v, depth + 1) for v in value] * rng.choice([0, 1, 1, 2])
    return value if roll < 0.6 else rng.choice(choices)


def _bodies(rng: random.Random, pid: int):
    t = time.time()
    push = push_body(
        pid,
        [
            step_item(1, t, loss=1.0, tokens=3),
            {"type": "phase", "name": "eval", "action": "start", "time": t, "timeout_seconds": 5},
            {"type": "event", "name": "checkpoint_saved", "time": t, "fields": {"step": 1}},
        ],
    )
    templates = {
        "/v1/push": push,
        "/v1/register": registration(pid, stack_dump=None, phase="eval", phase_timeout_seconds=60),
        "/v1/deregister": {"job_id": "run-42", "rank": 0, "pid": pid, "reason": "finished"},
    }
    for _ in range(FUZZ_BODIES):
        path = rng.choice(list(templates))
        roll = rng.random()
        if roll < 0.08:
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        elif roll < 0.12:
            body = json.dumps(templates[path])[: rng.randrange(1, 40)].encode()
        else:
            body = json.dumps(_mutate(rng, templates[path])).encode()
        yield path, body, rng.random() < 0.25


async def test_fuzzed_push_api_bodies_never_get_a_5xx(sidecar, child_pid):
    rng = random.Random(FUZZ_SEED)
    assert (await sidecar.post("/v1/register", registration(child_pid))).status == 200
    statuses: dict[int, int] = {}
    server_errors = []
    bodies = list(_bodies(rng, child_pid))
    started = time.monotonic()
    for i in range(0, len(bodies), 50):
        replies = await asyncio.gather(*(sidecar.post(path, body, tcp=tcp) for path, body, tcp in bodies[i : i + 50]))
        for (path, body, _), reply in zip(bodies[i : i + 50], replies, strict=True):
            statuses[reply.status] = statuses.get(reply.status, 0) + 1
            if reply.status >= 500:
                server_errors.append((path, body[:200], reply.body))
    assert sum(statuses.values()) == FUZZ_BODIES >= 5000
    assert not server_errors, server_errors[:5]
    assert set(statuses) - {200, 400, 401, 403, 409, 413, 429} == set(), statuses
    assert statuses.get(400, 0) > FUZZ_BODIES // 4, statuses  # the fuzz reaches the validation
    assert (await sidecar.get("/healthz")).status == 200
    print(f"{FUZZ_BODIES} fuzzed bodies in {time.monotonic() - started:.1f}s: {statuses}")


def test_connections_that_never_finish_a_request_are_closed_after_the_idle_timeout(tmp_path):
    with Sidecar(tmp_path, "idle_timeout_seconds=1") as sc:
        idle = socket.create_connection(("127.0.0.1", sc.port))
        half = socket.create_connection(("127.0.0.1", sc.port))
        half.sendall(b"POST /v1/register HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
        slow = socket.create_connection(("127.0.0.1", sc.port))  # announces a body it never sends
        slow.sendall(b"POST /v1/register HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        started = time.monotonic()
        for conn in (idle, half, slow):
            conn.settimeout(20)
            data = conn.recv(1024)
            assert data == b"" or data.startswith(b"HTTP/1.1 4"), data
            conn.close()
        assert b" 408 " in data and b'"code": "timeout"' in data, data
        closed_after = time.monotonic() - started
        assert closed_after < 15, closed_after
        # The sidecar still serves everybody else.
        wait_until(lambda: sc.status()["health"], 10, what="status")
