"""Helpers of the daemon's tests: the application served in-process on a real Unix socket and
a real TCP port with a client for each, the settings they share, and request bodies."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

# The daemon's tests: no collectors, an ephemeral TCP port, and /metrics
# rendered at every scrape (these tests read /metrics right after each change).
DAEMON = {"listen": "127.0.0.1:0", "collectors.enabled": [], "watchdog.floor_seconds": 30, "metrics_reuse_seconds": 0}


@dataclass
class Reply:
    status: int
    body: Any  # parsed JSON, or text when the body is not JSON

    @property
    def code(self) -> str | None:
        return self.body.get("code") if isinstance(self.body, dict) else None


class Served:
    """The application on a Unix socket and a TCP port, with a client for each."""

    def __init__(self, app: web.Application, socket_path: str):
        self.app = app
        self.socket_path = socket_path
        self.runner = web.AppRunner(app, access_log=None)
        self.port = 0
        self._unix: aiohttp.ClientSession | None = None
        self._tcp: aiohttp.ClientSession | None = None

    async def start(self) -> Served:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        await web.UnixSite(self.runner, self.socket_path).start()
        self.port = next(a[1] for a in self.runner.addresses if isinstance(a, tuple))
        self._unix = aiohttp.ClientSession(connector=aiohttp.UnixConnector(self.socket_path))
        self._tcp = aiohttp.ClientSession()
        return self

    async def close(self) -> None:
        for session in (self._unix, self._tcp):
            if session is not None:
                await session.close()
        await self.runner.cleanup()

    async def request(
        self, method: str, path: str, body: Any = None, *, tcp: bool = False, headers: dict | None = None
    ) -> Reply:
        session = self._tcp if tcp else self._unix
        base = f"http://127.0.0.1:{self.port}" if tcp else "http://sidecar"
        raw = body is None or isinstance(body, (bytes, str)) or hasattr(body, "__aiter__")
        data = body if raw else json.dumps(body)
        async with session.request(method, base + path, data=data, headers=headers) as resp:
            text = await resp.text()
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = text
            return Reply(resp.status, parsed)

    async def post(self, path: str, body: Any, **kw) -> Reply:
        return await self.request("POST", path, body, **kw)

    async def get(self, path: str, **kw) -> Reply:
        return await self.request("GET", path, **kw)

    async def metrics(self) -> str:
        reply = await self.get("/metrics")
        assert reply.status == 200
        return reply.body


def registration(pid: int, job: str = "run-42", rank: int = 0, world_size: int = 2, **extra) -> dict:
    body = {
        "job_id": job,
        "rank": rank,
        "local_rank": rank % 2,
        "world_size": world_size,
        "local_world_size": min(2, world_size),
        "restart_count": 0,
        "pid": pid,
        "versions": {"torch": "2.13.0", "python": "3.11.7"},
        "hooks_version": "0.1.0",
    }
    body.update(extra)
    return body


def step_item(step: int, at: float | None = None, **metrics) -> dict:
    return {"type": "step", "step": step, "time": time.time() if at is None else at, "metrics": metrics}


def push_body(pid: int, items: list[dict], job: str = "run-42", rank: int = 0, dropped: int = 0) -> dict:
    return {"job_id": job, "rank": rank, "pid": pid, "dropped": dropped, "items": items}


def series(exposition: str, name: str) -> list[str]:
    """The sample lines of one metric name in a text exposition."""
    return [line for line in exposition.splitlines() if line.startswith(name + "{") or line.startswith(name + " ")]
