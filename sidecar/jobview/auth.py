"""How the sidecars of one job prove themselves to each other: an HMAC with the job's own key.

The key belongs to the job, not to the cluster. The sidecar on rank 0's node (the job's
coordinator) makes it when a verified rank of the job first registers there and answers it with
the registration's job view offer; rank 0's hooks publish the offer in the job's own c10d store
(trainer_hooks/jobview.py), and every rank hands it to its own sidecar in its `job_coordinator`
event. So a node can sign reports only for a job one of whose verified ranks runs there, and a
report signed with one job's key is worth nothing for another job. The push token handed to
hooks, and any other secret of the node, never signs a peer request (round 3, row 6).

Who learns a job's key: its ranks (the job's owner), their sidecars, and whoever can read the
job's c10d store, which holds the job's rendezvous already (anyone who can read or write it can
break or join the job itself). On the coordinator's node such a reader is no peer unless root or
the job's user (sidecar/daemon/peer_api.py); from elsewhere, only a cluster secret the nodes share
(`bind`, job_view.cluster_key_file) keeps the key alone from signing. The key itself never
travels to the coordinator, so a report sent to a host a user chose leaks nothing that host could
use against another job.

A request carries `X-Sidecar-Peer: <unix time>:<nonce>:<hex>`, a MAC over the method, the path,
the destination node's name (a request signed for one node is refused by every other), the
time, the nonce and the body's digest; the answer carries `X-Sidecar-Peer-Reply: <hex>` over the
nonce and its body's digest. Requests older or newer than MAX_SKEW_SECONDS are refused, and a
nonce is remembered for that whole window (row 11: nonces were kept by count, and one replayed
after 4,096 others was accepted), at most MAX_NONCES per job: past that the job's peers are
refused until the window moves on (only holders of the job's key can spend them).
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainer_hooks.wire import JOB_KEY_CHARS

REQUEST_HEADER = "X-Sidecar-Peer"
REPLY_HEADER = "X-Sidecar-Peer-Reply"
MAX_SKEW_SECONDS = 300.0
MAX_NONCES = 65536  # per job within the window: ~220 requests a second, for 5 minutes
KEY_RE = re.compile(rf"[0-9a-f]{{{JOB_KEY_CHARS}}}")


def new_key() -> str:
    return secrets.token_hex(JOB_KEY_CHARS // 2)


def valid_key(value: object) -> bool:
    return isinstance(value, str) and KEY_RE.fullmatch(value) is not None


def bind(key: str, cluster: bytes | None) -> str:
    """The key that signs a job's peer requests: the job's own, or where the nodes share a cluster
    secret (job_view.cluster_key_file), the job's key bound to it: someone who read the job's key
    from its c10d store, without root on a node of the cluster, can sign nothing."""
    return key if not cluster else hmac.new(cluster, b"job-key\n" + key.encode(), hashlib.sha256).hexdigest()


def _mac(key: str, *parts: bytes) -> str:
    return hmac.new(key.encode(), b"\n".join(parts), hashlib.sha256).hexdigest()


def _request_mac(key: str, method: str, path: str, dest: str, stamp: str, nonce: str, body: bytes) -> str:
    digest = hashlib.sha256(body).hexdigest().encode()
    return _mac(key, method.upper().encode(), path.encode(), dest.encode(), stamp.encode(), nonce.encode(), digest)


def sign_request(key: str, method: str, path: str, body: bytes, dest: str, now: float | None = None) -> tuple[str, str]:
    """(header value, nonce) for one request to the node named `dest`."""
    stamp = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(12)
    return f"{stamp}:{nonce}:{_request_mac(key, method, path, dest, stamp, nonce, body)}", nonce


def sign_reply(key: str, nonce: str, body: bytes) -> str:
    return _mac(key, b"reply", nonce.encode(), hashlib.sha256(body).hexdigest().encode())


def reply_is_signed(key: str, nonce: str, body: bytes, header: str | None) -> bool:
    return header is not None and hmac.compare_digest(header.encode(), sign_reply(key, nonce, body).encode())


class Verifier:
    """The receiving side, for one job on the node named `node`: checks a request's signature,
    its age, and that its nonce was not seen within the window."""

    def __init__(self, key: str, node: str, clock: Callable[[], float] = time.time):
        self.key, self.node, self.clock = key, node, clock
        self._seen: dict[str, float] = {}  # nonce -> when it leaves the window
        self._order: list[tuple[float, str]] = []  # a heap of (until, nonce)
        self.refused_full = 0

    def check(self, method: str, path: str, body: bytes, header: str | None) -> str | None:
        """The request's nonce when it is signed for this node and fresh, else None."""
        if not header or header.count(":") != 2:
            return None
        stamp, nonce, mac = header.split(":")
        try:
            when = float(stamp)
        except ValueError:
            return None
        now = self.clock()
        if not abs(now - when) <= MAX_SKEW_SECONDS or not 0 < len(nonce) <= 64:
            return None
        want = _request_mac(self.key, method, path, self.node, stamp, nonce, body)
        if not hmac.compare_digest(mac.encode(), want.encode()):
            return None
        self._expire(now)
        if nonce in self._seen:
            return None
        if len(self._seen) >= MAX_NONCES:
            self.refused_full += 1
            return None
        until = when + MAX_SKEW_SECONDS  # refused as too old from then on
        self._seen[nonce] = until
        heapq.heappush(self._order, (until, nonce))
        return nonce

    def _expire(self, now: float) -> None:
        while self._order and self._order[0][0] < now:
            _, nonce = heapq.heappop(self._order)
            self._seen.pop(nonce, None)

    def __len__(self) -> int:
        return len(self._seen)


@dataclass
class JobKey:
    """A job's key on its coordinator: made for the uid whose verified rank first registered the job there."""

    owner: int | None
    verifier: Verifier  # with the bound key (`bind`)
    offered: str  # the job's own key, handed to its ranks
