"""`sidecar run`: the daemon. `build_app` assembles the application (registry, collectors,
watchdog, handlers, background tasks); `serve` puts it on TCP and the Unix socket at once
and runs until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import grp
import logging
import os
import resource
import signal
import socket
import stat
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from sidecar import __version__, fitness
from sidecar.collectors import gpu_events
from sidecar.collectors.base import CollectorRunner
from sidecar.collectors.factory import build_collectors
from sidecar.config import ConfigError, Settings, add_settings_arguments, settings_from_args
from sidecar.daemon import api
from sidecar.daemon.exposition import MetricsEndpoint
from sidecar.exits.tracker import ExitTracker
from sidecar.host import procs, stackfiles
from sidecar.ranks import podlabels
from sidecar.ranks.registry import Registry
from sidecar.ranks.training_metrics import TrainingCollector
from sidecar.watchdog.machine import Watchdog

log = logging.getLogger("sidecar")

RESTART_BACKOFF_SECONDS = (1.0, 30.0)  # a crashed background task restarts after 1 s, doubling to 30 s
SWEEP_INTERVAL_SECONDS = 30.0


class StartupError(Exception):
    """The daemon cannot start (address in use, another sidecar on the socket)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser)
    parser.add_argument(
        "--observe-only",
        action="store_true",
        help="detect and report stalls but never signal a process (watchdog.observe_only)",
    )


# ---------------------------------------------------------------- building


def build_app(settings: Settings) -> web.Application:
    """The application, ready for a runner. Reads the push token (ConfigError if unreadable)."""
    registry = Registry(settings, alive=procs.is_same_process)
    # The per-rank collectors look only at the ranks /metrics has room for (exposition.py).
    endpoint: MetricsEndpoint
    watched = lambda: endpoint.watched_pids(registry.live_pids)()  # noqa: E731 - endpoint comes below
    collectors = build_collectors(
        settings, ranks=watched, job_versions=registry.versions_by_job, live_ranks=registry.live_pids
    )
    runner = CollectorRunner(collectors, settings.collectors.interval_seconds)
    runner.relabel = lambda families: podlabels.attach(families, registry.pod_labels)
    daemon = api.Daemon(
        settings=settings,
        registry=registry,
        runner=runner,
        watchdog=Watchdog(settings, registry),
        token=settings.push_token(),
        protected_pids=procs.protected_pids(),
    )
    events = gpu_events.build(settings, registry.live_pids)  # dcgm mode: XIDs without the gpu collector
    daemon.exits = exit_tracker(settings, daemon.watchdog, collectors, events)
    daemon.watchdog.on_remediating = daemon.exits.remediating
    wire_fitness(daemon, collectors, events)
    app = web.Application(client_max_size=settings.limits.max_body_bytes, middlewares=api.MIDDLEWARES)
    app[api.DAEMON] = daemon
    endpoint = MetricsEndpoint(
        runner,
        registry,
        TrainingCollector(registry),
        daemon.watchdog,
        [daemon.exits.families, lambda: api.daemon_families(daemon), lambda: fitness.families(daemon.fitness())],
        settings.limits.max_series,
        relabel=lambda families: podlabels.attach(families, registry.pod_labels),
        reuse_seconds=settings.metrics_reuse_seconds,
    )
    app[api.METRICS_ENDPOINT] = endpoint

    api.add_routes(app)
    app.cleanup_ctx.append(background_tasks)
    if events is not None:
        app.cleanup_ctx.append(refreshing(events, settings.collectors.interval_seconds))
    return app


def exit_tracker(
    settings: Settings, watchdog: Watchdog, collectors: list, events: gpu_events.GpuEvents | None = None
) -> ExitTracker:
    """The exit tracker, with the XIDs and GPU use of the gpu collector when it runs, else of the
    XID source that stands in for it where dcgm-exporter is the GPU source."""
    gpu = next((c for c in collectors if getattr(c, "name", None) == "gpu"), None) or events
    return ExitTracker(
        settings,
        watchdog.store,
        xids=getattr(gpu, "last_xids", None),
        gpu_use=(lambda: gpu.rank_gpus) if gpu is not None else None,
    )


def wire_fitness(daemon: api.Daemon, collectors: list, events: gpu_events.GpuEvents | None) -> None:
    """The node verdict's sources: the watchdog's processes that outlived SIGKILL, and the GPU
    checks of the gpu collector (or of the XID source that stands in for it with dcgm-exporter),
    whose process lists also tell the watchdog the GPU memory of an unkillable process."""
    unkillable = daemon.watchdog.remediator.unkillable
    daemon.fitness_sources.append(unkillable.findings)
    gpu = next((c for c in collectors if getattr(c, "name", None) == "gpu"), None) or events
    if gpu is not None:
        daemon.fitness_sources.append(gpu.fitness.findings)
        unkillable.gpu_memory = gpu.gpu_memory


def refreshing(events: gpu_events.GpuEvents, interval: float) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context that refreshes the XID source off the event loop every `interval` (a
    supervised job, like the collectors) and stops its thread at shutdown."""

    async def refresh_forever() -> None:
        loop = asyncio.get_running_loop()
        while True:
            await loop.run_in_executor(None, events.refresh)
            await asyncio.sleep(interval)

    async def context(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(supervised("gpu_events", refresh_forever), name="gpu_events")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        with contextlib.suppress(Exception):
            events.close()

    return context


async def background_tasks(app: web.Application) -> AsyncIterator[None]:
    d = app[api.DAEMON]
    jobs: dict[str, Callable[[], Awaitable[Any]]] = {
        "collectors": d.runner.run_forever,
        "retention": lambda: sweep_forever(d.registry),
    }
    if d.exits is not None:
        jobs["exits"] = d.exits.run
    if d.settings.watchdog.enabled:
        jobs["watchdog"] = d.watchdog.run
    tasks = [asyncio.create_task(supervised(name, job), name=name) for name, job in jobs.items()]
    yield
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    app[api.METRICS_ENDPOINT].close()
    if d.exits is not None:
        d.exits.close()
    for collector in d.runner.collectors:  # stop their threads (the GPU collector's XID waiter)
        close = getattr(collector, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()


async def supervised(name: str, job: Callable[[], Awaitable[Any]]) -> None:
    """Run a background job forever: a crash is logged and the job restarts after a backoff,
    so one bug never silently stops the watchdog or the collectors."""
    delay, ceiling = RESTART_BACKOFF_SECONDS
    while True:
        try:
            await job()
            log.error("background task %s returned; restarting it", name)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("background task %s crashed; restarting it in %.0f s", name, delay)
        await asyncio.sleep(delay)
        delay = min(ceiling, delay * 2)


async def sweep_forever(registry: Registry) -> None:
    interval = min(SWEEP_INTERVAL_SECONDS, registry.settings.limits.gone_retention_seconds / 4)
    while True:
        await asyncio.sleep(interval)
        dropped = registry.sweep()
        if dropped:
            log.info("dropped %d rank(s) gone longer than limits.gone_retention_seconds", dropped)
        held = [r.stack_file.path for r in registry.ranks() if r.stack_file is not None]
        await asyncio.get_running_loop().run_in_executor(
            None, stackfiles.prune, registry.settings.diagnostics_dir, held
        )


# ---------------------------------------------------------------- serving


def socket_group_id(settings: Settings) -> int | None:
    if not settings.socket_group:
        return None
    try:
        return grp.getgrnam(settings.socket_group).gr_gid
    except KeyError:
        raise ConfigError(f"setting socket_group: no group named {settings.socket_group!r}") from None


def claim_socket_path(path: str) -> None:
    """Make `path` free for a new socket: create its directory, remove a stale socket left by
    a crashed sidecar, and refuse when a live process still answers on it."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = p.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"socket path {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(path)
        except OSError:
            p.unlink(missing_ok=True)  # stale: nobody listens
            return
    raise StartupError(f"another process answers on {path} (is a sidecar already running?)")


def sd_notify(state: str) -> None:
    """Tell systemd (Type=notify) about our state; a no-op outside systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(state.encode(), address)


def raise_open_files_limit() -> None:
    """The sidecar keeps a pidfd per live rank (limits.max_ranks) besides its connections:
    lift the soft limit on open files to the hard one, as daemons do (best effort)."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def serve(settings: Settings) -> None:
    raise_open_files_limit()
    gid = socket_group_id(settings)
    if settings.socket:
        claim_socket_path(settings.socket)
    app = build_app(settings)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, keepalive_timeout=settings.idle_timeout_seconds)
    await runner.setup()
    socket_inode = None
    try:
        try:
            await web.TCPSite(runner, settings.listen_host, settings.listen_port).start()
        except OSError as e:
            raise StartupError(f"cannot listen on {settings.listen}: {e.strerror or e}") from None
        if settings.socket:
            try:
                await web.UnixSite(runner, settings.socket).start()
                os.chmod(settings.socket, settings.socket_mode_int)
                if gid is not None:
                    os.chown(settings.socket, -1, gid)
                socket_inode = os.stat(settings.socket).st_ino
            except OSError as e:
                raise StartupError(f"cannot serve on socket {settings.socket}: {e.strerror or e}") from None
        announce(runner, settings)
        sd_notify("READY=1")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping")
        sd_notify("STOPPING=1")
    finally:
        await runner.cleanup()
        if socket_inode is not None:
            remove_own_socket(settings.socket, socket_inode)


def remove_own_socket(path: str, inode: int) -> None:
    """Remove the socket file unless another sidecar has replaced it meanwhile."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            os.unlink(path)


def announce(runner: web.AppRunner, settings: Settings) -> None:
    urls = []
    for address in runner.addresses:
        if isinstance(address, tuple):  # (host, port[, flowinfo, scope])
            host = address[0]
            urls.append(f"http://[{host}]:{address[1]}" if ":" in host else f"http://{host}:{address[1]}")
        elif address:
            urls.append(f"unix:{address}")
    line = f"sidecar {__version__} listening on {' and '.join(urls)}"
    if settings.watchdog.observe_only:
        line += " (watchdog observe-only)"
    print(line, flush=True)
    log.info("%s", line)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        socket_group_id(settings)
        settings.incident_group_id()
        settings.collectors.check_host_paths()
        token = settings.push_token()  # also proves token_file readable
        if settings.requires_token() and token is None:
            raise ConfigError(
                f"setting token_file: listen {settings.listen} is beyond loopback, so the push API "
                "needs a bearer token: set SIDECAR_TOKEN or token_file"
            )
    except ConfigError as e:
        print(f"sidecar: {e}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level)
    try:
        asyncio.run(serve(settings))
    except StartupError as e:
        print(f"sidecar: {e}", file=sys.stderr)
        return 1
    return 0
