"""The daemon's side of the go-live checks (sidecar/ranks/golive.py) and of the kill-and-resume drill
(sidecar/watchdog/drill.py): the first steps' loss taken from each accepted push, the checks judged
for `/v1/status` and `/metrics`, and the root-only drill endpoints on the Unix socket:

    POST /v1/drills {"job_id": ID, "rank": R (optional), "timeout_seconds": S (optional)}
        stop one rank of the job (chosen and checked here, never a pid the client names)
    GET  /v1/drills/{drill_id}
        what the drill measured so far (detection, kill, restart, training again, resumed step)

Who may call them (docs/security.md): root, over the Unix socket, by the connection's peer
credentials; nobody over TCP (loopback included: no credentials travel there). api.py routes them
(its `drill_start`, `drill_state`); this module never imports api.py.
"""

from __future__ import annotations

import math
import socket
from typing import Any

from prometheus_client.core import Metric

from sidecar.host import identity
from sidecar.ranks import golive, protocol
from sidecar.ranks.protocol import ProtocolError, StepItem
from sidecar.ranks.registry import Registry
from sidecar.watchdog.drill import DEFAULT_TIMEOUT_SECONDS, MAX_TIMEOUT_SECONDS, MIN_TIMEOUT_SECONDS, Drills
from trainer_hooks.wire import MAX_RANK, NAME_RE

DRILL_FIELDS = frozenset({"job_id", "rank", "timeout_seconds"})
DRILL_ID_CHARS = 64


class Forbidden(ProtocolError):
    def __init__(self, message: str):
        super().__init__(message, code="forbidden", status=403)


# ---------------------------------------------------------------- go-live checks


def observe_push(d: Any, job_id: str, items: list) -> None:
    """The accepted step reports of one push, for the loss over the job's first steps."""
    steps = [(i.step, i.metrics.get("loss")) for i in items if type(i) is StepItem]
    if steps:
        d.golive.observe(job_id, steps, d.settings.watchdog.golive_steps)


def golive_status(d: Any, registry: Registry, families=None, forget: bool = True) -> dict[str, dict]:
    """Per job with live ranks here: its go-live checks (`families`: the collectors' latest, for the
    per-rank GPU memory; read from the runner when not given). `forget`: drop the first steps' loss of
    jobs no longer registered (on the event loop only: /metrics renders in its own thread)."""
    families = d.runner.families() if families is None else families
    memory = golive.memory_by_rank(
        (s.labels, s.value) for f in families for s in f.samples if s.name == "sidecar_gpu_process_memory_bytes"
    )
    ranks = registry.ranks()
    if forget:
        d.golive.forget({r.job_id for r in ranks})
    w = d.settings.watchdog
    return d.golive.evaluate(ranks, memory, w.golive_steps, w.golive_imbalance_ratio)


def golive_families(d: Any) -> list[Metric]:
    return d.golive.families(golive_status(d, d.registry, forget=False))


# ---------------------------------------------------------------- the drill


def root_caller(sock: socket.socket | None) -> int:
    """The caller's uid when it is root on the Unix socket (`sock`: None over TCP); else Forbidden."""
    caller = identity.unix_peer(sock, want_pidfd=False) if sock is not None else None
    if caller is None or caller.uid != 0:
        raise Forbidden("drills are root's: run `sidecar drill` as root on this node (Unix socket only)")
    return caller.uid


def parse_drill(data: Any) -> tuple[str, int | None, float]:
    """(job_id, rank or None, timeout) of a drill request, or ProtocolError naming the field."""
    if not isinstance(data, dict):
        raise ProtocolError("body: expected a JSON object")
    unknown = sorted(set(data) - DRILL_FIELDS)
    if unknown:
        raise ProtocolError(f"{unknown[0][:40]!r}: unknown field")
    job_id = protocol._job_id(data)  # as a registration checks it: printable, at most MAX_NAME
    rank = data.get("rank")
    if rank is not None and (type(rank) is not int or not 0 <= rank < MAX_RANK):
        raise ProtocolError(f"rank: expected an integer in [0, {MAX_RANK})")
    timeout = data.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or not MIN_TIMEOUT_SECONDS <= timeout <= MAX_TIMEOUT_SECONDS
    ):
        raise ProtocolError(f"timeout_seconds: expected seconds in [{MIN_TIMEOUT_SECONDS:g}, {MAX_TIMEOUT_SECONDS:g}]")
    return job_id, rank, float(timeout)


def drills_of(d: Any) -> Drills:
    if d.drills is None:
        d.drills = Drills(
            d.settings,
            d.registry,
            d.watchdog.store,
            lambda: {e["job_id"] for e in d.watchdog.status()["active"]},
            wake=lambda job_id: d.watchdog.job_view.wake(job_id) if d.watchdog.job_view is not None else None,
            linked=lambda job_id: d.watchdog.job_view is not None and bool(d.watchdog.job_view.coordinator(job_id)),
        )
    return d.drills


def start_drill(d: Any, data: Any, uid: int) -> dict[str, Any]:
    job_id, rank, timeout = parse_drill(data)
    drills = drills_of(d)
    drill = drills.start(job_id, rank, timeout, uid)
    return {"ok": True, "drill": drills.answer(drill.id)}


def drill_state(d: Any, drill_id: str) -> dict[str, Any]:
    if len(drill_id) > DRILL_ID_CHARS or not NAME_RE.match(drill_id):
        raise ProtocolError("drill_id: expected a drill id as POST /v1/drills answered it")
    return {"ok": True, "drill": drills_of(d).answer(drill_id)}
