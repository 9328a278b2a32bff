"""`sidecar run`: the daemon. `build_app` assembles the application (registry, collectors,
watchdog, handlers, background tasks); `serve` puts it on TCP and the Unix socket at once
and runs until SIGTERM or SIGINT.

Starting: a TCP port another process holds (one that bound it while the sidecar was down) is
retried once a second for `listen_retry_seconds`, each attempt logged with who holds it, then
the start fails with status 1 and that line. Stopping: SIGTERM and SIGINT are handled by
Python's own handler, which runs between two bytecodes of whatever the main thread does, so
a stop request never waits for a busy event loop to come back to its signal pipe; in-flight
requests get STOP_SECONDS, and if the orderly stop has not finished after HARD_STOP_SECONDS,
or on a second signal, the process exits at once (the next start removes the stale socket)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from sidecar import fitness
from sidecar.collectors import gpu_events
from sidecar.collectors.base import CollectorRunner
from sidecar.collectors.factory import build_collectors
from sidecar.config import ConfigError, Settings, add_settings_arguments, settings_from_args
from sidecar.daemon import api, peer_api
from sidecar.daemon.exposition import MetricsEndpoint
from sidecar.daemon.process import (
    StartupError,
    StopSignals,
    announce,
    claim_socket_path,
    raise_open_files_limit,
    remove_own_socket,
    sd_notify,
    setup_logging,
    socket_group_id,
)
from sidecar.exits.tracker import ExitTracker
from sidecar.host import procs, stackfiles
from sidecar.jobview import collectives, straggler_incidents
from sidecar.jobview.coordinator import Coordinator
from sidecar.jobview.reporter import Reporter
from sidecar.ranks import ownership, podlabels, slurmjob, straggler_cause
from sidecar.ranks.golive import memory_of
from sidecar.ranks.registry import Registry
from sidecar.ranks.training_metrics import TrainingCollector
from sidecar.watchdog import drill
from sidecar.watchdog.machine import Watchdog

log = logging.getLogger("sidecar")

RESTART_BACKOFF_SECONDS = (1.0, 30.0)  # a crashed background task restarts after 1 s, doubling to 30 s
SWEEP_INTERVAL_SECONDS = 30.0
LISTEN_BACKLOG = 4096  # pending TCP connections (the kernel caps it at net.core.somaxconn)
OWNERS_SAVE_SECONDS = 1.0  # how often the job owners are written while they change (ranks/ownership.py)
LISTEN_RETRY_INTERVAL_SECONDS = 1.0
STOP_SECONDS = 2.0  # after SIGTERM, how long in-flight requests may take (a half-sent body never holds the stop)


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
    # GPU ownership (the node verdict's gpu_held, per-rank GPU memory) only from verified ranks.
    collectors = build_collectors(
        settings, ranks=watched, job_versions=registry.versions_by_job, live_ranks=registry.verified_live_pids
    )
    runner = CollectorRunner(collectors, settings.collectors.interval_seconds)
    runner.relabel = lambda families: podlabels.attach(families, registry.series_labels)
    daemon = api.Daemon(
        settings=settings,
        registry=registry,
        runner=runner,
        watchdog=Watchdog(settings, registry),
        token=settings.push_token(),
        protected_pids=procs.protected_pids(),
    )
    limits = settings.limits
    daemon.watchdog.store.slurm_of = lambda job_id: slurmjob.job_facts(
        r for r in registry.ranks() if r.job_id == job_id
    )
    daemon.dump_files = stackfiles.DumpFiles(
        settings.diagnostics_dir, limits.max_ranks_per_user + stackfiles.KEPT_PER_UID, 2 * limits.max_ranks
    )
    events = gpu_events.build(settings, registry.verified_live_pids)  # dcgm mode: XIDs without the gpu collector
    daemon.exits = exit_tracker(settings, daemon.watchdog, collectors, events)
    daemon.watchdog.on_remediating = daemon.exits.remediating
    wire_fitness(daemon, collectors, events)
    if settings.job_view.enabled:
        attach_job_view(daemon)
    app = web.Application(client_max_size=settings.limits.max_body_bytes, middlewares=api.MIDDLEWARES)
    app[api.DAEMON] = daemon
    endpoint = MetricsEndpoint(
        runner,
        registry,
        # a rank's lateness: as the job's coordinator judged it over the whole job, when fresh
        TrainingCollector(
            registry, job_lateness=daemon.reporter.lateness_of if daemon.reporter else None, tracker=daemon.tracker
        ),
        daemon.watchdog,
        [daemon.exits.families, lambda: api.daemon_families(daemon), lambda: fitness.families(daemon.fitness())],
        settings.limits.max_series,
        relabel=lambda families: podlabels.attach(families, registry.series_labels),
        reuse_seconds=settings.metrics_reuse_seconds,
    )
    app[api.METRICS_ENDPOINT] = endpoint

    api.add_routes(app)
    peer_api.add_routes(app)
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


def attach_job_view(daemon: api.Daemon) -> None:
    """The job view (sidecar/jobview/): this node coordinates the jobs whose ranks it hosts and
    asks, and reports its picture of every job whose coordinator a local rank names."""
    settings, registry = daemon.settings, daemon.registry
    jv = settings.job_view
    daemon.coordinator = Coordinator(
        hosts=lambda job_id: _hosted_world_size(registry, job_id, jv.forget_after_seconds),
        lost_after=jv.lost_after_seconds,
        verdict_wait=jv.verdict_wait_seconds,
        max_nodes=jv.max_nodes,
        probe=probe_peer,
        # a rank's hooks send their collective record with every push (at least every flush interval)
        stale_after=collectives.stale_after(settings.hooks_flush_interval_seconds),
        max_ranks=jv.max_ranks,
        node=settings.node_name,
        cluster_key=jv.cluster_key(),
        crash_loop_repeats=jv.crash_loop_repeats,
    )
    golive_settings = (settings.watchdog.golive_steps, settings.watchdog.golive_imbalance_ratio)
    daemon.reporter = Reporter(
        settings.node_name,
        settings.peer_url,
        jv.report_interval_seconds,
        source=daemon.watchdog.node_report,
        local=daemon.coordinator,
        # the figures of the job's go-live checks, judged over every node by its coordinator
        golive=lambda job_id: daemon.golive.figures(
            job_id, registry.ranks(), memory_of(daemon.runner.families()), *golive_settings
        ),
        cluster_key=jv.cluster_key(),
    )
    daemon.reporter.on_verdict = daemon.crash_loops.see
    daemon.watchdog.job_view = daemon.reporter
    if daemon.exits is not None:
        daemon.exits.job_incident_of = exit_context(daemon.reporter, settings.node_name)
        daemon.exits.job_view_wait = jv.verdict_wait_seconds + 2.0
        daemon.watchdog.on_left_to_launcher = daemon.exits.left_to_launcher
        daemon.exits.crash_loop_of = lambda job_id: daemon.crash_loops.status().get(job_id)


def _hosted_world_size(registry: Registry, job_id: str, forget_after: float) -> int:
    """The job's world size as its verified ranks here registered it, while one lives or went
    less than `forget_after` seconds ago (its exit is still judged, its restart may come); 0: the
    job is not (or no longer) hosted here."""
    now = time.monotonic()
    return max(
        (
            r.world_size
            for r in registry.ranks()
            if r.job_id == job_id and r.peer_verified and (not r.gone or now - (r.gone_at or now) < forget_after)
        ),
        default=0,
    )


def exit_context(reporter: Reporter, node: str) -> Callable[[str, int], tuple[str | None, str | None, bool]]:
    """For the exit tracker: whether a rank's exit is a consequence of its job's incident (the
    verdict names another rank, or a lost node), and whether the job view may still tell."""

    def of(job_id: str, rank: int) -> tuple[str | None, str | None, bool]:
        if reporter.coordinator(job_id) is None:
            return None, None, False
        verdict = reporter.verdict(job_id)
        if verdict is None or verdict.closed or verdict.culprit is None:
            return None, None, reporter.reachable(job_id)
        c = verdict.culprit
        if c.rank == rank and c.node == node:
            return None, None, False  # this rank is the cause
        what = f"rank {c.rank} on {c.node}" if c.rank is not None else f"node {c.node} lost"
        return verdict.job_incident, what, False

    return of


async def probe_peer(url: str) -> bool:
    """Whether a sidecar answers `/healthz` at `url` within a second."""
    timeout = aiohttp.ClientTimeout(total=1.0)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url + "/healthz") as resp:
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


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
        "retention": lambda: sweep_forever(d.registry, d.dump_files),
    }
    if d.exits is not None:
        jobs["exits"] = d.exits.run
    if d.settings.watchdog.enabled:
        jobs["watchdog"] = d.watchdog.run
    if d.reporter is not None:
        jobs["job_view"] = d.reporter.run
    # a rank of this node its job's straggler: one incident per episode, never a kill
    gpu = next((c for c in d.runner.collectors if getattr(c, "name", None) == "gpu"), None)
    view = d.settings.job_view
    found = straggler_incidents.StragglerIncidents(
        d.watchdog.store,
        exclude_after=view.straggler_exclude_after_seconds,
        exclude_hold=view.straggler_exclude_hold_seconds,
    )
    d.fitness_sources.append(found.findings)  # opt-in: a straggler with a hardware cause marks the node
    jobs["straggler_incidents"] = straggler_incidents.watching(
        found,
        d.settings.node_name,
        d.registry.ranks,
        d.reporter,
        d.tracker,
        straggler_cause.gpus_of(d.runner.families, gpu),
    )
    jobs["owners"] = lambda: save_owners_forever(d.registry)
    jobs["loop_lag"] = d.loop_lag.run
    restore_owners(d.registry)
    drill.continue_left_stopped(d.settings.diagnostics_dir)  # a drill's rank the previous run left stopped
    tasks = [asyncio.create_task(supervised(name, job), name=name) for name, job in jobs.items()]
    yield
    if d.drills is not None:
        d.drills.close()  # never leave a drilled rank stopped
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    ownership.write_owners(d.settings.diagnostics_dir, d.registry.owners.snapshot())  # what the next start reserves
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


async def sweep_forever(registry: Registry, dump_files: stackfiles.DumpFiles | None = None) -> None:
    interval = min(SWEEP_INTERVAL_SECONDS, registry.settings.limits.gone_retention_seconds / 4)
    while True:
        await asyncio.sleep(interval)
        dropped = registry.sweep()
        if dropped:
            log.info("dropped %d rank(s) gone longer than limits.gone_retention_seconds", dropped)
        held = [r.stack_file.path for r in registry.ranks() if r.stack_file is not None and not r.gone]
        await asyncio.get_running_loop().run_in_executor(
            None, stackfiles.prune, registry.settings.diagnostics_dir, held
        )
        if dump_files is not None:
            await asyncio.get_running_loop().run_in_executor(None, dump_files.forget_missing)


def restore_owners(registry: Registry) -> None:
    """Reserve the jobs the previous sidecar had for their owners (ranks/ownership.py)."""
    document = ownership.read_owners(registry.settings.diagnostics_dir)
    if document:
        restored = registry.owners.restore(document)
        if restored:
            log.info(
                "reserved %d job_id(s) of the previous run for their owners for %.0f s "
                "(limits.job_reservation_seconds)",
                restored,
                registry.settings.limits.job_reservation_seconds,
            )


async def save_owners_forever(registry: Registry) -> None:
    """Write the job owners while they change, off the event loop."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(OWNERS_SAVE_SECONDS)
        registry.owners.expire()
        if registry.owners.changed:
            document = registry.owners.snapshot()
            await loop.run_in_executor(None, ownership.write_owners, registry.settings.diagnostics_dir, document)


# ---------------------------------------------------------------- serving


async def serve(settings: Settings) -> None:
    raise_open_files_limit()
    gid = socket_group_id(settings)
    if settings.socket:
        claim_socket_path(settings.socket)
    app = build_app(settings)
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=None,
        keepalive_timeout=settings.idle_timeout_seconds,
        shutdown_timeout=STOP_SECONDS,
    )
    await runner.setup()
    socket_inode = None
    try:
        await listen_tcp(runner, settings)
        advertise_bound_port(app[api.DAEMON], runner)
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
        stop = StopSignals(asyncio.get_running_loop())
        await stop.requested.wait()
        log.info("stopping")
        sd_notify("STOPPING=1")
    finally:
        await runner.cleanup()
        if socket_inode is not None:
            remove_own_socket(settings.socket, socket_inode)


async def listen_tcp(runner: web.AppRunner, settings: Settings) -> None:
    """Listen on `listen`; while its port is in use, retry once a second for
    listen_retry_seconds (the holder named in each attempt's log line), then StartupError."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.listen_retry_seconds
    attempt = 0
    while True:
        attempt += 1
        # A job's coordinator hears from every node of the job at once when it hangs: a listen
        # backlog of aiohttp's default 128 would drop connects (1 s SYN retries).
        site = web.TCPSite(runner, settings.listen_host, settings.listen_port, backlog=LISTEN_BACKLOG)
        try:
            await site.start()
            if attempt > 1:
                log.warning("listening on %s after %d attempts", settings.listen, attempt)
            return
        except OSError as e:
            await site.stop()  # unregister the site that never started
            holder = await loop.run_in_executor(None, procs.tcp_listener, settings.listen_port)
            message = f"cannot listen on {settings.listen}: {e.strerror or e}"
            if holder:
                message += f" (held by {holder})"
            if e.errno != errno.EADDRINUSE or loop.time() >= deadline:
                raise StartupError(message) from None
            log.warning(
                "%s; retrying for %.0f s more (listen_retry_seconds)", message, max(0.0, deadline - loop.time())
            )
        await asyncio.sleep(LISTEN_RETRY_INTERVAL_SECONDS)


def advertise_bound_port(daemon: api.Daemon, runner: web.AppRunner) -> None:
    """With port 0 in `listen`, the setting takes the port the kernel picked, so that the address
    the job view advertises (Settings.peer_url) is one that answers."""
    settings = daemon.settings
    if settings.listen_port != 0:
        return
    port = next(address[1] for address in runner.addresses if isinstance(address, tuple))
    host = settings.listen_host
    settings.listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if daemon.reporter is not None:
        daemon.reporter.own_url = settings.peer_url


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        socket_group_id(settings)
        settings.incident_group_id()
        settings.collectors.check_host_paths()
        token = settings.push_token()  # also proves token_file readable
        settings.job_view.cluster_key()  # and job_view.cluster_key_file usable
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
