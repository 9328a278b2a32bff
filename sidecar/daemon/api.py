"""HTTP handlers: `/metrics`, `/healthz`, `/readyz`, `/v1/status` and the hooks' push API
(`/v1/register`, `/v1/push`, `/v1/deregister`), with the middlewares that turn every
refusal into a 4xx JSON body and keep the daemon up whatever a client sends."""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psutil
from aiohttp import web
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder

from sidecar import __version__
from sidecar.collectors.base import CollectorRunner
from sidecar.config import NODE_NAME, Settings
from sidecar.daemon import dumpfiles, operations, status_document
from sidecar.daemon.exposition import MetricsEndpoint
from sidecar.daemon.looplag import LoopLag
from sidecar.exits.reasons import exception_kind
from sidecar.exits.tracker import ExitTracker
from sidecar.fitness import Finding, Fitness, judge
from sidecar.host import diagfiles, identity, podnet, procs, stackfiles
from sidecar.jobview import auth, crashloop
from sidecar.jobview.coordinator import Coordinator
from sidecar.jobview.crashloop import CrashLoops
from sidecar.jobview.reporter import Reporter
from sidecar.metric import MetricSpec, spec
from sidecar.ranks import golive, lateness, protocol, slurmjob
from sidecar.ranks.collectives import parse_collectives, parse_fr_dump
from sidecar.ranks.errors import RegistryError
from sidecar.ranks.model import Rank
from sidecar.ranks.protocol import ProtocolError
from sidecar.ranks.registry import Registry
from sidecar.watchdog.drill import Drills
from sidecar.watchdog.machine import Watchdog
from trainer_hooks.wire import END, JOB_COORDINATOR_EVENT

log = logging.getLogger(__name__)

PUSH_PATHS = frozenset({"/v1/register", "/v1/push", "/v1/deregister"})
COMPRESS_ABOVE_BYTES = 4096


@dataclass
class IngestStats:
    """The push API's own counters (exported as `sidecar_ingest_*`)."""

    records: collections.Counter = field(default_factory=collections.Counter)  # accepted, by item type
    rejected: collections.Counter = field(default_factory=collections.Counter)  # requests, by error code


@dataclass
class Daemon:
    """Everything the handlers share; one per application."""

    settings: Settings
    registry: Registry
    runner: CollectorRunner
    watchdog: Watchdog
    token: str | None  # the push API's bearer token over TCP; None: no token
    protected_pids: frozenset[int]
    stats: IngestStats = field(default_factory=IngestStats)
    started: float = field(default_factory=time.monotonic)
    process: psutil.Process = field(default_factory=psutil.Process)  # the sidecar itself
    exits: ExitTracker | None = None  # why each rank process exited (sidecar/exits/tracker.py)
    reporter: Reporter | None = None  # this node's side of the job view (sidecar/jobview/)
    coordinator: Coordinator | None = None  # the job view of the jobs whose rank 0 runs here
    loop_lag: LoopLag = field(default_factory=LoopLag)
    dump_files: stackfiles.DumpFiles | None = None  # the stack-dump files it created (host/stackfiles.py)
    # What may make the node unfit: the watchdog's unkillable processes, the GPU checks (app.py wires them).
    fitness_sources: list[Callable[[], Iterable[Finding]]] = field(default_factory=list)
    golive: golive.GoLive = field(default_factory=golive.GoLive)  # go-live checks (operations.py)
    tracker: lateness.Tracker = field(default_factory=lateness.Tracker)  # its ranks' lateness, judged once
    drills: Drills | None = None  # kill-and-resume drills, made at the first (operations.py)
    crash_loops: CrashLoops = field(default_factory=CrashLoops)  # jobs ended on purpose (jobview/crashloop.py)

    def fitness(self) -> Fitness:
        """The node verdict now (sidecar/fitness.py); a failing source is logged, never fatal."""
        findings: list[Finding] = []
        for source in self.fitness_sources:
            try:
                findings += source()
            except Exception:
                log.exception("node fitness source %s failed", getattr(source, "__qualname__", source))
        return judge(findings)


DAEMON = web.AppKey("daemon", Daemon)
METRICS_ENDPOINT = web.AppKey("metrics_endpoint", MetricsEndpoint)

BUILD_INFO = spec("daemon", "build_info", "gauge", "1, labelled with the sidecar's version.", ["version"])
NODE_INFO = spec(
    "daemon",
    "node_info",
    "gauge",
    "1, labelled with this node's name (the node_name setting): what incidents and the job view call the node, "
    "joined onto per-rank series by the SidecarJobHungOnRank rule.",
    ["node"],
)
INGEST_RECORDS = spec(
    "daemon", "ingest_records", "counter", "Items accepted by the push API, by type (step, phase, event).", ["type"]
)
INGEST_REJECTED = spec(
    "daemon",
    "ingest_rejected_requests",
    "counter",
    "Push API requests refused, by error code (bad_json, bad_field, too_large, unknown_rank, "
    "step_not_increasing, limit_exceeded, pid_mismatch, uid_mismatch, job_owned, timeout, "
    "unauthorized).",
    ["code"],
)
INGEST_REGISTRATIONS = spec(
    "daemon", "ingest_registrations", "counter", "Rank registrations accepted (re-registrations included)."
)
DAEMON_CPU = spec("daemon", "daemon_cpu_seconds", "counter", "CPU time the sidecar process has used.")
DAEMON_RSS = spec("daemon", "daemon_resident_memory_bytes", "gauge", "The sidecar process's resident memory.")
DAEMON_FDS = spec("daemon", "daemon_open_fds", "gauge", "Descriptors the sidecar process holds open.")
EVENT_LOOP_LAG = spec(
    "daemon",
    "event_loop_lag_seconds",
    "gauge",
    "The longest the event loop was late over the last minute: health checks, registrations, pushes and "
    "the watchdog all waited that long. Above a second, healthy ranks near their timeout may look stalled.",
)
METRICS: tuple[MetricSpec, ...] = (
    BUILD_INFO,
    NODE_INFO,
    INGEST_RECORDS,
    INGEST_REJECTED,
    INGEST_REGISTRATIONS,
    DAEMON_CPU,
    DAEMON_RSS,
    DAEMON_FDS,
    EVENT_LOOP_LAG,
    golive.GOLIVE_CHECK,
    crashloop.CRASH_LOOP,
)


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


def error_response(status: int, code: str, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": message, "code": code}, status=status, headers=headers)


# ---------------------------------------------------------------- middlewares


@web.middleware
async def errors_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Every refusal becomes `{"error", "code"}`; an unexpected exception is logged and
    answered 500, and the daemon carries on."""
    try:
        return await handler(request)
    except (ProtocolError, RegistryError, ApiError, identity.IdentityError) as e:
        status, code = e.status, e.code
        message = str(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        status, code = (
            e.status,
            {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(e.status, "bad_request"),
        )
        message = f"{e.reason}: {request.method} {request.path}"
    except Exception:
        log.exception("unexpected error handling %s %s", request.method, request.path)
        status, code, message = 500, "internal", "internal error (logged by the sidecar)"
    if request.path in PUSH_PATHS:
        request.app[DAEMON].stats.rejected[code] += 1
    headers = {"WWW-Authenticate": "Bearer"} if code == "unauthorized" else None
    return error_response(status, code, message, headers)


@web.middleware
async def auth_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """The push API needs the bearer token over TCP when one is configured (always when TCP
    listens beyond loopback). The Unix socket is guarded by its file mode and peer
    credentials instead; `/metrics`, health and status stay open."""
    token = request.app[DAEMON].token
    if token and request.path in PUSH_PATHS and _is_tcp(request):
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise ApiError(401, "unauthorized", "the push API needs 'Authorization: Bearer <token>' over TCP")
    return await handler(request)


def _socket(request: web.Request) -> socket.socket | None:
    transport = request.transport
    return transport.get_extra_info("socket") if transport is not None else None


def _is_tcp(request: web.Request) -> bool:
    sock = _socket(request)
    return sock is None or sock.family != socket.AF_UNIX


# ---------------------------------------------------------------- push API


async def read_json(request: web.Request) -> dict:
    return protocol.decode(await read_body(request))


async def read_body(request: web.Request) -> bytes:
    """The request's body, bounded by limits.max_body_bytes and timed by idle_timeout_seconds."""
    limit = request.app[DAEMON].settings.limits.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(
            413, "too_large", f"body of {request.content_length} bytes exceeds limits.max_body_bytes ({limit})"
        )
    timeout = request.app[DAEMON].settings.idle_timeout_seconds
    try:
        body = await asyncio.wait_for(request.read(), timeout)
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, "too_large", f"body exceeds limits.max_body_bytes ({limit})") from None
    except asyncio.TimeoutError:
        raise ApiError(408, "timeout", f"body not received within idle_timeout_seconds ({timeout:g})") from None
    return body


def check_session(request: web.Request, rank, session: str | None) -> None:
    """Over TCP nothing tells who is calling, so a push or deregistration must carry the
    session its registration returned. A wrong one answers unknown_rank: honest hooks
    register again (and are checked then), a forger learns nothing."""
    if _is_tcp(request) and not (
        session and hmac.compare_digest(session.encode(errors="replace"), rank.session.encode())
    ):
        raise ApiError(
            409,
            "unknown_rank",
            f"session: {'stale' if session else 'missing'} for rank {rank.label} over TCP; register again",
        )


async def tcp_peer(request: web.Request) -> tuple[int, int] | None:
    """For a TCP connection from a process on this node: its pid and the inode of its end of
    the connection (None when not visible: another host or network namespace)."""
    transport = request.transport
    if transport is None or not _is_tcp(request):
        return None
    client, server = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
    if not (isinstance(client, tuple) and isinstance(server, tuple)):
        return None
    return await asyncio.get_running_loop().run_in_executor(None, podnet.caller, client, server)


async def registering_peer(request: web.Request) -> identity.Peer | None:
    """Who is registering: the Unix socket's peer (with its pidfd), or the process behind a
    TCP connection from this node (checked, once opened, to hold the connection still); None
    when nothing tells (TCP from elsewhere). IdentityError when the process found has gone."""
    if not _is_tcp(request):
        return identity.unix_peer(_socket(request))
    found = await tcp_peer(request)
    if found is None:
        return None
    pid, inode = found
    return await asyncio.get_running_loop().run_in_executor(None, identity.process_peer, pid, inode)


async def register(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    reg = protocol.parse_registration(await read_json(request))
    peer = await registering_peer(request)
    loop = asyncio.get_running_loop()
    if peer is None:  # nobody to check against: recorded, watched, never signalled
        if reg.pid in d.protected_pids:
            raise ApiError(
                403,
                "pid_mismatch",
                f"pid: {reg.pid} is init, the sidecar or one of its ancestors; it may never register",
            )
        claimed = identity.Claimed(reg.pid, reg.pid, procs.start_time(reg.pid), None, None)
    else:
        claimed = await loop.run_in_executor(None, identity.resolve, peer, reg.pid, d.protected_pids)
    previous = d.registry.get(reg.job_id, reg.rank)
    rank = d.registry.register(
        reg,
        pid_start_time=claimed.start_time,
        peer_verified=peer is not None,
        host_pid=claimed.pid,
        owner_uid=claimed.uid,
        pidfd=claimed.pidfd,
    )
    rank.stack_file = dumpfiles.stack_file_for(d.settings, d.dump_files, d.registry, rank, previous, peer is not None)
    if peer is not None:  # the Slurm job and user of a process it verified, never of a pid or name a caller sends
        rank.slurm_job_id, rank.slurm_user = await loop.run_in_executor(None, slurmjob.verified, rank)
    if d.exits is not None:
        d.exits.watch(rank)
    d.crash_loops.registered(rank, procs.parent(rank.pid, rank.pid_start_time) if peer is not None else None)
    log.info(
        "registered rank %s pid %d%s uid %s (restart %d%s)",
        rank.label,
        rank.pid,
        f" (pid {reg.pid} in its namespace)" if rank.claimed_pid is not None else "",
        rank.owner_uid,
        rank.restart_count,
        "" if peer is not None else ", unverified peer",
    )
    if reg.observe_only:
        log.info(
            "rank %s asks for observe-only (its job's stalls reported, never killed): %s",
            rank.label,
            "honoured" if rank.observe_only else "ignored (watchdog.allow_job_observe_only is off)",
        )
    return web.json_response(
        {
            "ok": True,
            "key": rank.label,
            "session": rank.session,
            "diag_dir": str(d.settings.diagnostics_dir / diagfiles.job_dir_name(reg.job_id)),
            "stack_dump": (
                {"path": rank.stack_file.path, "signal": rank.stack_signal} if rank.stack_file is not None else None
            ),
            "flush_interval_s": d.settings.hooks_flush_interval_seconds,
            # Whether this job's stalls are only observed, never killed (the node's mode, or the job's
            # own `observe_only`, honoured while watchdog.allow_job_observe_only).
            "observe_only": rank.observe_only or d.settings.watchdog.observe_only,
            # Rank 0 names this sidecar as its job's coordinator (sidecar/jobview/); the others learn
            # where it is through the job's own store.
            "job_view": job_view_offer(d, rank, verified=peer is not None),
            **_end(d, rank),
        }
    )


def _end(d: Daemon, rank: Rank) -> dict:
    """wire.END when the rank's job was ended on purpose (a crash loop: jobview/crashloop.py)."""
    end = d.crash_loops.end_for(rank, d.settings.watchdog.observe_only)
    return {END: end} if end is not None else {}


def job_view_offer(d: Daemon, rank: Rank, verified: bool) -> dict | None:
    """Rank 0 names this sidecar as its job's coordinator (sidecar/jobview/), with the job's key
    (auth.py); the others learn both through the job's own store. A caller not verified as the
    process gets no key: it could sign reports for a job whose ranks it does not run."""
    if d.reporter is None or d.coordinator is None or rank.world_size <= 1:
        return None
    offer = {"url": d.settings.peer_url, "node": d.settings.node_name}
    if verified:
        offer["key"] = d.coordinator.key_for(rank.job_id, rank.owner_uid)
    return offer


def check_sender(request: web.Request, rank) -> None:
    """Over the Unix socket, a push or deregistration comes from the rank's process (or its
    launcher) running as the rank's uid (or root). The pidfd is not asked for on this hot
    path: a pid reused after the caller connected can only be another process of that uid."""
    peer = identity.unix_peer(_socket(request), want_pidfd=False)
    if peer is not None:
        identity.check_sender(peer, rank.pid, rank.owner_uid)


async def push(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    batch = protocol.decode_push(await read_body(request), d.settings.limits.max_items_per_push)
    record, fr_dump = parse_collectives(batch.collectives), parse_fr_dump(batch.fr_dump)
    rank = d.registry.lookup(batch.job_id, batch.rank, batch.pid)  # unknown_rank first: the hooks re-register
    check_session(request, rank, batch.session)
    check_sender(request, rank)
    coordinators = _coordinators(batch)  # before the events are kept: the job's key is not one to keep
    accepted = d.registry.apply_push(batch, rank)
    operations.observe_push(d, rank.job_id, batch.items)
    rank.take_collectives(record, fr_dump, time.monotonic())
    for url, node, key in coordinators:
        if d.reporter is not None and rank.peer_verified:
            d.reporter.set_coordinator(rank.job_id, url, node, key)
    records = d.stats.records
    for item in batch.items:
        records[_ITEM_TYPES[type(item)]] += 1
    answer: dict = {"ok": True, "accepted": accepted, **(d.reporter.clock_offset(rank.job_id) if d.reporter else {})}
    if rank.wants:
        answer["want"], rank.wants = sorted(rank.wants), set()
    return web.json_response({**answer, **_end(d, rank)})


def _coordinators(batch: protocol.Push) -> list[tuple[str, str, str | None]]:
    """(url, node, key) of each `job_coordinator` event, its key taken out of the event."""
    found = []
    for item in batch.items:
        if type(item) is protocol.EventItem and item.name == JOB_COORDINATOR_EVENT:
            url, node, key = item.fields.get("url"), item.fields.get("node"), item.fields.pop("key", None)
            if isinstance(url, str) and isinstance(node, str) and NODE_NAME.fullmatch(node):
                found.append((url, node, key if auth.valid_key(key) else None))
    return found


_ITEM_TYPES = {protocol.StepItem: "step", protocol.PhaseItem: "phase", protocol.EventItem: "event"}


async def deregister(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    dereg = protocol.parse_deregistration(await read_json(request))
    rank = d.registry.lookup(dereg.job_id, dereg.rank, dereg.pid)
    check_session(request, rank, dereg.session)
    check_sender(request, rank)
    rank = d.registry.deregister(dereg, rank)
    rank.exit_kind = exception_kind(dereg.exit) if dereg.exit is not None else rank.exit_kind
    if d.exits is not None:
        d.exits.deregistered(rank, dereg.reason, dereg.exit)
    log.info("rank %s deregistered: %s", rank.label, dereg.reason)
    return web.json_response({"ok": True})


# ---------------------------------------------------------------- reading endpoints


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def readyz(request: web.Request) -> web.Response:
    if request.app[DAEMON].runner.first_round.is_set():
        return web.json_response({"ready": True})
    return web.json_response({"ready": False, "error": "collectors have not finished their first round"}, status=503)


async def status(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    body = status_document.build_status(
        d.settings,
        d.registry,
        d.runner,
        d.watchdog,
        started=d.started,
        exits=d.exits,
        reporter=d.reporter,
        fitness=d.fitness(),
        golive=operations.golive_status(d, d.registry),
        lateness_tracker=d.tracker,
        crash_loops=d.crash_loops.status(),
    )
    return web.json_response(body)


async def drill_start(request: web.Request) -> web.Response:
    uid = operations.root_caller(None if _is_tcp(request) else _socket(request))  # before reading the body
    return web.json_response(operations.start_drill(request.app[DAEMON], await read_json(request), uid))


async def drill_state(request: web.Request) -> web.Response:
    operations.root_caller(None if _is_tcp(request) else _socket(request))
    return web.json_response(operations.drill_state(request.app[DAEMON], request.match_info["drill_id"]))


async def metrics(request: web.Request) -> web.Response:
    """Rendered in the endpoint's own thread (exposition.py): a scrape never holds the event
    loop, whatever the number of series."""
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    endpoint = request.app[METRICS_ENDPOINT]
    body = await asyncio.get_running_loop().run_in_executor(endpoint.executor, endpoint.render, encoder)
    response = web.Response(body=body, headers={"Content-Type": content_type})
    if len(body) > COMPRESS_ABOVE_BYTES:
        response.enable_compression()  # only when the scraper accepts gzip
    return response


async def job_ended(request: web.Request) -> web.Response:
    """Whether the job was ended for a crash loop (jobview/crashloop.py), for its torchrun agent
    (trainer_hooks/crashloop.py): what `/v1/status` shows every local user of it, no more."""
    job_id = request.match_info["job_id"]
    return web.json_response({"job_id": job_id, "ended": request.app[DAEMON].crash_loops.status().get(job_id)})


def daemon_families(d: Daemon) -> Iterable[Metric]:
    build = BUILD_INFO.family()
    build.add_metric([__version__], 1)
    node = NODE_INFO.family()
    node.add_metric([d.settings.node_name], 1)
    records = INGEST_RECORDS.family()
    for kind in ("step", "phase", "event"):
        records.add_metric([kind], d.stats.records[kind])
    rejected = INGEST_REJECTED.family()
    for code, count in sorted(d.stats.rejected.items()):
        rejected.add_metric([code], count)
    registrations = INGEST_REGISTRATIONS.family()
    registrations.add_metric([], d.registry.registrations_total)
    lag = EVENT_LOOP_LAG.family()
    lag.add_metric([], d.loop_lag.worst())
    yield from (build, node, records, rejected, registrations, lag, *operations.golive_families(d))
    yield from d.crash_loops.families()
    try:
        cpu = d.process.cpu_times()
        cpu_family, rss, fds = DAEMON_CPU.family(), DAEMON_RSS.family(), DAEMON_FDS.family()
        cpu_family.add_metric([], cpu.user + cpu.system)
        rss.add_metric([], d.process.memory_info().rss)
        fds.add_metric([], d.process.num_fds())
        yield from (cpu_family, rss, fds)
    except psutil.Error:
        pass


def add_routes(app: web.Application) -> None:
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/jobs/{job_id}/ended", job_ended)
    app.router.add_post("/v1/register", register)
    app.router.add_post("/v1/push", push)
    app.router.add_post("/v1/deregister", deregister)
    app.router.add_post("/v1/drills", drill_start)
    app.router.add_get("/v1/drills/{drill_id}", drill_state)


MIDDLEWARES = (errors_middleware, auth_middleware)
