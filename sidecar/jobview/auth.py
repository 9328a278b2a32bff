"""How sidecars prove themselves to each other: an HMAC with the push token (the cluster's shared
bearer token, `SIDECAR_TOKEN` or `token_file`), which itself never travels. The coordinator's
address comes from a rank (through the job's c10d store), so a report may be sent to a host a
user chose: the token must not go with it, and an answer is trusted only when it is signed too.

A request carries `X-Sidecar-Peer: <unix time>:<nonce>:<hex>` over the method, path, time, nonce
and the body's digest; the answer carries `X-Sidecar-Peer-Reply: <hex>` over the nonce and its
body's digest. Requests older or newer than MAX_SKEW_SECONDS, or whose nonce was seen, are refused.
Without a token (a sidecar that listens on loopback only: one host), nothing is signed.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import time

REQUEST_HEADER = "X-Sidecar-Peer"
REPLY_HEADER = "X-Sidecar-Peer-Reply"
MAX_SKEW_SECONDS = 300.0
NONCES_KEPT = 4096


def _mac(token: str, *parts: bytes) -> str:
    return hmac.new(token.encode(), b"\n".join(parts), hashlib.sha256).hexdigest()


def sign_request(token: str, method: str, path: str, body: bytes, now: float | None = None) -> tuple[str, str]:
    """(header value, nonce) for one request."""
    stamp = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(12)
    digest = hashlib.sha256(body).hexdigest().encode()
    mac = _mac(token, method.upper().encode(), path.encode(), stamp.encode(), nonce.encode(), digest)
    return f"{stamp}:{nonce}:{mac}", nonce


def sign_reply(token: str, nonce: str, body: bytes) -> str:
    return _mac(token, b"reply", nonce.encode(), hashlib.sha256(body).hexdigest().encode())


def reply_is_signed(token: str, nonce: str, body: bytes, header: str | None) -> bool:
    return header is not None and hmac.compare_digest(header.encode(), sign_reply(token, nonce, body).encode())


class Verifier:
    """The receiving side: checks a request's signature, its age and that its nonce is new."""

    def __init__(self, token: str, clock=time.time):
        self.token, self.clock = token, clock
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()

    def check(self, method: str, path: str, body: bytes, header: str | None) -> str | None:
        """The request's nonce when it is signed and fresh, else None."""
        if not header or header.count(":") != 2:
            return None
        stamp, nonce, mac = header.split(":")
        try:
            when = float(stamp)
        except ValueError:
            return None
        if abs(self.clock() - when) > MAX_SKEW_SECONDS or len(nonce) > 64 or nonce in self._seen:
            return None
        digest = hashlib.sha256(body).hexdigest().encode()
        want = _mac(self.token, method.upper().encode(), path.encode(), stamp.encode(), nonce.encode(), digest)
        if not hmac.compare_digest(mac.encode(), want.encode()):
            return None
        self._seen[nonce] = when
        while len(self._seen) > NONCES_KEPT:
            self._seen.popitem(last=False)
        return nonce
