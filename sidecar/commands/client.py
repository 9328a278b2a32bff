"""The small HTTP client of a sidecar's read API (`/v1/status`, `/metrics`): where a sidecar
listens (`Endpoint`: a Unix socket or a URL) and GET with one-line errors. Behind a TLS proxy that
wants a bearer token (components/kube-rbac-proxy), an https URL's endpoint carries the token's file
(read at every request: a projected token rotates) and the CA that signed the proxy's certificate.

`sidecar status` reads its node's sidecar with it, `sidecar preflight` its own and its peers'.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

from sidecar.config import DEFAULT_SOCKET

DEFAULT_TIMEOUT_SECONDS = 3.0


class StatusError(Exception):
    """The daemon could not be asked, or its answer is unusable. One line, names the endpoint."""


class Unreachable(StatusError):
    """Nothing answered at the endpoint."""


@dataclass(frozen=True)
class Endpoint:
    """Where a sidecar listens: a Unix socket path or an http(s):// URL; for a URL, optionally a
    file holding a bearer token to send and a CA bundle to verify its TLS certificate with."""

    socket: str | None = None
    url: str | None = None
    token_file: str | None = None
    cacert: str | None = None

    def __str__(self) -> str:
        return self.socket or self.url or "?"

    @property
    def alternative(self) -> str:
        return "--url" if self.socket else "--socket"

    @classmethod
    def of_url(cls, url: str) -> Endpoint:
        """A URL as operators type it: `node-3:9402` means `http://node-3:9402`."""
        return cls(url=url if "://" in url else f"http://{url}")


def resolve_endpoint(
    socket_path: str | None = None, url: str | None = None, environ: Mapping[str, str] | None = None
) -> Endpoint:
    """Flags first, then SIDECAR_SOCKET, then SIDECAR_URL, then the default socket. The socket
    wins over the URL among the environment variables because it is the default transport."""
    environ = os.environ if environ is None else environ
    if url:
        return Endpoint.of_url(url)
    if socket_path:
        return Endpoint(socket=socket_path)
    if environ.get("SIDECAR_SOCKET"):
        return Endpoint(socket=environ["SIDECAR_SOCKET"])
    if environ.get("SIDECAR_URL"):
        return Endpoint.of_url(environ["SIDECAR_URL"])
    return Endpoint(socket=DEFAULT_SOCKET)


def with_credentials(endpoint: Endpoint, token_file: str | None, cacert: str | None) -> Endpoint:
    """The endpoint with a bearer token's file and a CA bundle (`--token-file`, `--cacert`), which
    only an http(s) URL takes (the CA only an https one); StatusError names the misuse."""
    if not (token_file or cacert):
        return endpoint
    if not endpoint.url:
        raise StatusError(f"--token-file and --cacert go with --url, not the socket {endpoint}")
    if cacert and not endpoint.url.startswith("https://"):
        raise StatusError(f"--cacert needs an https:// URL, not {endpoint.url}")
    return replace(endpoint, token_file=token_file or None, cacert=cacert or None)


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a Unix stream socket."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _connection(endpoint: Endpoint, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """A connection to the endpoint and the path prefix of its URL."""
    if endpoint.socket:
        return UnixHTTPConnection(endpoint.socket, timeout), ""
    parts = urlsplit(endpoint.url or "")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise StatusError(f"bad URL {endpoint.url!r}: expected http://HOST:PORT")
    try:
        port = parts.port
    except ValueError:
        raise StatusError(f"bad URL {endpoint.url!r}: the port is not a number") from None
    prefix = parts.path.rstrip("/")
    if parts.scheme == "http":
        return http.client.HTTPConnection(parts.hostname, port, timeout=timeout), prefix
    try:
        context = ssl.create_default_context(cafile=endpoint.cacert)
    except (OSError, ssl.SSLError) as e:
        raise StatusError(f"cannot use --cacert {endpoint.cacert}: {e.strerror or e}") from None
    return http.client.HTTPSConnection(parts.hostname, port, timeout=timeout, context=context), prefix


def _headers(endpoint: Endpoint) -> dict[str, str]:
    headers = {"Accept": "application/json"}
    if endpoint.token_file:
        try:
            token = Path(endpoint.token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise StatusError(
                f"cannot read --token-file {endpoint.token_file}: {getattr(e, 'strerror', None) or e}"
            ) from None
        if not token:
            raise StatusError(f"--token-file {endpoint.token_file} is empty")
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _reason(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate not trusted: {exc.verify_message}; give the CA that signed it with --cacert"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    if isinstance(exc, FileNotFoundError):
        return "no such socket"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, PermissionError):
        return "permission denied; run as root or as a member of the socket's group"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"no answer within {timeout:g}s"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host name ({exc.strerror})"
    if isinstance(exc, http.client.HTTPException):
        return f"not an HTTP answer ({type(exc).__name__})"
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def fetch(endpoint: Endpoint, path: str, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> bytes:
    """GET `path` from the sidecar; the body of a 200 answer, else `StatusError`."""
    headers = _headers(endpoint)
    conn, prefix = _connection(endpoint, timeout)
    try:
        conn.request("GET", prefix + path, headers=headers)
        resp = conn.getresponse()
        body = resp.read()
    except ssl.SSLError as e:  # something answered: the TLS handshake failed
        raise StatusError(f"GET {path} at {endpoint} failed ({_reason(e, timeout)})") from None
    except (OSError, http.client.HTTPException) as e:
        raise Unreachable(f"no sidecar at {endpoint} ({_reason(e, timeout)})") from None
    finally:
        conn.close()
    if resp.status != 200:
        detail = body[:200].decode("utf-8", "replace").strip()
        with contextlib.suppress(ValueError, TypeError, KeyError):
            detail = str(json.loads(body)["error"])
        if resp.status in (401, 403) and not endpoint.token_file:
            detail += " (a proxy that wants a bearer token? give it with --token-file)"
        raise StatusError(f"GET {path} at {endpoint} answered HTTP {resp.status}: {detail}")
    return body


def fetch_json(endpoint: Endpoint, path: str = "/v1/status", timeout: float = DEFAULT_TIMEOUT_SECONDS) -> dict:
    body = fetch(endpoint, path, timeout)
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise StatusError(f"GET {path} at {endpoint} did not answer JSON ({e})") from None
    if not isinstance(doc, dict):
        raise StatusError(f"GET {path} at {endpoint} answered a JSON {type(doc).__name__}, not an object")
    return doc
