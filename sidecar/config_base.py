"""What every part of the settings shares: the defaults the rest name, the collectors there are,
`ConfigError` and the checks the sections and `Settings` use (sidecar/config.py is the public face)."""

from __future__ import annotations

import math
import re
import typing
import urllib.parse
from typing import Any

DEFAULT_PORT = 9402
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"
DEFAULT_SOCKET = "/run/sidecar/sidecar.sock"
ENV_PREFIX = "SIDECAR_"
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")

# The hardware collectors there are, name -> the module that implements it: the one list the
# settings (`collectors.enabled` and its default), the collector factory
# (sidecar/collectors/factory.py) and the metrics reference read. Each module defines `NAME`,
# `METRICS` and `build(context)`. In build order: the node collector reads the GPU collector's
# driver versions, so gpu comes first.
COLLECTORS: dict[str, str] = {
    "gpu": "sidecar.collectors.gpu",
    "nic": "sidecar.collectors.nic",
    "process": "sidecar.collectors.process",
    "node": "sidecar.collectors.node",
}


class ConfigError(ValueError):
    """A setting is invalid. The message names the setting and what is wrong, on one line."""


def doc(text: str, **kw: Any) -> dict:
    return {"help": text, **kw}


def _fail(name: str, problem: str) -> typing.NoReturn:
    raise ConfigError(f"setting {name}: {problem}")


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        _fail(name, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


PEER_URL = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):\d{1,5}/?")


def check_url(url: str) -> str | None:
    """Why `url` cannot be a coordinator's address (None when it can): `http(s)://HOST:PORT` and
    nothing else, no user, path or query."""
    if not isinstance(url, str) or len(url) > 240 or not PEER_URL.fullmatch(url):
        return "expected http://HOST:PORT"
    port = urllib.parse.urlsplit(url).port
    if port is None or not 0 < port < 65536:
        return "port out of range"
    return None


def parse_hostport(value: str, name: str = "listen") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not (0 <= int(port) <= 65535):
        _fail(name, f"expected HOST:PORT, got {value!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)
