"""One HTTP/1.1 JSON request to the sidecar over its Unix socket or TCP, with short timeouts.

Standard library only (`http.client`): training processes must not pay for aiohttp or
requests. A request either returns a `Reply` or raises `Unreachable`; nothing else escapes.
"""

from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass
from typing import Any

from trainer_hooks.environment import Endpoint

CONNECT_TIMEOUT = 0.5
READ_TIMEOUT = 2.0
MAX_REPLY_BYTES = 64 * 1024


class Unreachable(Exception):
    """The sidecar could not be reached or did not answer in time (or answered garbage)."""


@dataclass(frozen=True)
class Reply:
    status: int
    body: dict

    @property
    def code(self) -> str:
        """The machine error code of a 4xx answer (`unknown_rank`, ...), or ""."""
        code = self.body.get("code")
        return code if isinstance(code, str) else ""

    @property
    def error(self) -> str:
        return str(self.body.get("error") or f"HTTP {self.status}")


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, connect_timeout: float, read_timeout: float):
        super().__init__("localhost", timeout=read_timeout)
        self._path = path
        self._connect_timeout = connect_timeout

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._connect_timeout)
            sock.connect(self._path)
            sock.settimeout(self.timeout)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class _TcpConnection(http.client.HTTPConnection):
    def __init__(self, host: str, port: int, connect_timeout: float, read_timeout: float):
        super().__init__(host, port, timeout=read_timeout)
        self._connect_timeout = connect_timeout

    def connect(self) -> None:
        self.sock = socket.create_connection((self.host, self.port), self._connect_timeout)
        self.sock.settimeout(self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def post(
    endpoint: Endpoint,
    path: str,
    body: bytes,
    connect_timeout: float = CONNECT_TIMEOUT,
    read_timeout: float = READ_TIMEOUT,
) -> Reply:
    """POST a JSON body; the reply's status and JSON object (empty when the body is not one)."""
    return request(endpoint, "POST", path, body, connect_timeout, read_timeout)


def request(
    endpoint: Endpoint,
    method: str,
    path: str,
    body: bytes | None = None,
    connect_timeout: float = CONNECT_TIMEOUT,
    read_timeout: float = READ_TIMEOUT,
) -> Reply:
    """One request; the reply's status and JSON object (empty when the body is not one)."""
    conn: http.client.HTTPConnection
    if endpoint.socket_path is not None:
        conn = _UnixConnection(endpoint.socket_path, connect_timeout, read_timeout)
    elif endpoint.host is not None and endpoint.port is not None:
        conn = _TcpConnection(endpoint.host, endpoint.port, connect_timeout, read_timeout)
    else:
        raise ValueError(f"no address in {endpoint}")
    headers = {"Content-Type": "application/json", "Connection": "close"}
    if endpoint.token:
        headers["Authorization"] = f"Bearer {endpoint.token}"
    try:
        conn.request(method, endpoint.base_path + path, body=body, headers=headers)
        resp = conn.getresponse()
        raw = resp.read(MAX_REPLY_BYTES)
        status = resp.status
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise Unreachable(f"{endpoint.describe()}: {type(e).__name__}: {e}") from None
    finally:
        conn.close()
    try:
        parsed: Any = json.loads(raw) if raw else {}
    except ValueError:
        parsed = {}
    return Reply(status, parsed if isinstance(parsed, dict) else {})
