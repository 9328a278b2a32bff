"""The job view's HTTP side: what other nodes' sidecars (and `sidecar incidents --job`) ask of
this one. `POST /v1/jobs/{job_id}/report` (a node's picture of the job; answers the verdict and, once judged,
the job's lateness: its stragglers and the node's ranks'),
`GET /v1/jobs/{job_id}/verdict?known=V&wait=S` (long-polled: answers once the verdict's version is
not V, or after S seconds), `GET /v1/jobs/{job_id}/story[?incident=ID]` (the job incident's story).

Who may ask (docs/security.md, "The job view"): over TCP, loopback included, every request must
be signed with the job's own key for this node (sidecar/jobview/auth.py), and every answer is
signed back; over the Unix socket, root only (`sidecar incidents --job`): an unprivileged local
user's report used to be taken unsigned, for any job (round 3, rows 1, 7 and 10).
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from sidecar.daemon.api import DAEMON, ApiError, Daemon, _is_tcp, _socket, read_json
from sidecar.host import identity, procs
from sidecar.jobview import auth
from sidecar.jobview.coordinator import CoordinatorError
from sidecar.jobview.report import parse_report
from sidecar.ranks.protocol import ProtocolError

MAX_WAIT_SECONDS = 30.0


def _root_on_socket(request: web.Request) -> None:
    """Over the Unix socket, root only (ApiError otherwise); over TCP the signature decides."""
    if not _is_tcp(request):
        caller = identity.unix_peer(_socket(request), want_pidfd=False)
        if caller is None or caller.uid != 0:
            raise ApiError(403, "forbidden", "the job view answers other sidecars (signed, over TCP) and root only")


async def _authorize(request: web.Request, body: bytes) -> tuple[str, str] | None:
    """(the job's key, the request's nonce) when it came signed over TCP, None for root on the Unix
    socket; ApiError when the caller may not ask."""
    if not _is_tcp(request):
        _root_on_socket(request)  # again after a handler's early check: the connection's peer is fixed
        return None
    job_id = request.match_info["job_id"]
    coordinator = _coordinator(request.app[DAEMON])
    verifier = coordinator.verifier(job_id)
    if verifier is None:
        raise ApiError(404, "not_coordinator", f"job_id: no verified rank of job {job_id!r} registered on this node")
    nonce = verifier.check(request.method, request.path_qs, body, request.headers.get(auth.REQUEST_HEADER))
    if nonce is None:
        raise ApiError(401, "unauthorized", f"peer requests must be signed with the job's key ({auth.REQUEST_HEADER})")
    if not await _a_peer_here(request, coordinator.owner(job_id)):  # round 4, row 2 (docs/security.md)
        raise ApiError(403, "forbidden", "a peer request from this node comes from its sidecar or the job's own user")
    return verifier.key, nonce


async def _a_peer_here(request: web.Request, owner: int | None) -> bool:
    """Whether a signed request may be the job's peer: from another host, yes (the signature
    decides); from this node (a loopback or local source address), only from a process of root
    (the node's sidecar) or of the job's owner that still holds its connection. Whoever on this
    node can read a job's c10d store can read its key: that alone makes no local user its peer."""
    transport = request.transport
    client = transport.get_extra_info("peername") if transport is not None else None
    server = transport.get_extra_info("sockname") if transport is not None else None
    if not (isinstance(client, tuple) and isinstance(server, tuple)):
        return False  # the connection is gone: nothing to tell who sent it
    loop = asyncio.get_running_loop()
    if not await loop.run_in_executor(None, procs.is_local_address, str(client[0])):
        return True
    uid = await loop.run_in_executor(None, procs.tcp_client_uid, client, server)
    return uid is not None and uid in (0, owner)


def _answer(payload: dict, signed: tuple[str, str] | None) -> web.Response:
    body = json.dumps(payload, separators=(",", ":")).encode()
    headers = {"Content-Type": "application/json"}
    if signed is not None:
        key, nonce = signed
        headers[auth.REPLY_HEADER] = auth.sign_reply(key, nonce, body)
    return web.Response(body=body, headers=headers)


def _coordinator(d: Daemon):
    if d.coordinator is None:
        raise ApiError(404, "not_found", "the job view is off on this node (job_view.enabled)")
    return d.coordinator


async def report(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    _root_on_socket(request)  # before the body is read: a local user's report is refused unread
    data = await read_json(request)  # bounded and timed like every push
    signed = await _authorize(request, await request.read())  # the same bytes, read once
    coordinator = _coordinator(d)
    parsed = parse_report(data, d.settings.limits.max_ranks_per_job)
    if parsed.job_id != request.match_info["job_id"]:
        raise ProtocolError("job_id: differs from the job in the path")
    try:
        verdict = coordinator.accept(parsed)
    except CoordinatorError as e:
        raise ApiError(e.status, e.code, str(e)) from None
    answer = {"ok": True, "verdict": verdict.to_wire() if verdict else None}
    judged = coordinator.lateness(parsed.job_id, parsed.node)  # the job's stragglers (jobview/stragglers.py)
    if judged is not None:  # absent otherwise: a peer that predates it reads only `verdict`
        answer["lateness"] = judged.to_wire()
    checks = coordinator.golive(parsed.job_id)  # the job's go-live checks over every node (jobview/golive.py)
    if checks is not None:  # absent likewise
        answer["golive"] = checks.to_wire()
    return _answer(answer, signed)


async def verdict(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    signed = await _authorize(request, b"")
    coordinator = _coordinator(d)
    job_id = request.match_info["job_id"]
    try:
        known = int(request.query.get("known", "-1"))
        wait = min(MAX_WAIT_SECONDS, max(0.0, float(request.query.get("wait", "0"))))
    except ValueError:
        raise ProtocolError("known, wait: expected numbers") from None
    if not coordinator.hosts(job_id):
        raise ApiError(404, "not_coordinator", f"job_id: no rank of job {job_id!r} is registered on this node")
    v = await coordinator.wait_change(job_id, known, wait) if wait else coordinator.verdict(job_id)
    return _answer({"ok": True, "verdict": v.to_wire() if v else None}, signed)


async def story(request: web.Request) -> web.Response:
    """The story from this node's coordinator, or (asked over the Unix socket of a node that is not
    the job's coordinator) fetched from the job's coordinator."""
    d = request.app[DAEMON]
    signed = await _authorize(request, b"")  # the story quotes stack frames: root or the job's peers
    job_id, wanted = request.match_info["job_id"], request.query.get("incident") or None
    found = d.coordinator.story(job_id, wanted) if d.coordinator is not None else None
    if found is None and not _is_tcp(request) and d.reporter is not None:
        found = await asyncio.wait_for(d.reporter.fetch_story(job_id, wanted), 10.0)
    if found is None:
        raise ApiError(404, "not_found", f"no job incident of job {job_id!r} is known here")
    return _answer({"ok": True, "story": found}, signed)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/jobs/{job_id}/report", report)
    app.router.add_get("/v1/jobs/{job_id}/verdict", verdict)
    app.router.add_get("/v1/jobs/{job_id}/story", story)
