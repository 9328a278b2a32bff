"""The daemon as an operating-system process: the socket's path and group, systemd's notify
protocol, the open-files limit, the stop signals (a second SIGTERM, or HARD_STOP_SECONDS, ends it
whatever the loop does), the start-up line, and logging whose every line is printable
(sidecar/daemon/app.py builds the application and serves it with these)."""

from __future__ import annotations

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
import threading
from pathlib import Path

from aiohttp import web

from sidecar import __version__
from sidecar.config import ConfigError, Settings
from sidecar.safetext import printable

log = logging.getLogger("sidecar")

HARD_STOP_SECONDS = 10.0  # after SIGTERM, the process exits by then whatever the loop is doing


class StartupError(Exception):
    """The daemon cannot start (address in use, another sidecar on the socket)."""


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


class StopSignals:
    """SIGTERM and SIGINT through Python's own signal handler, not the event loop's: it runs
    between two bytecodes of the main thread even while the loop is busy. The first signal
    asks the loop to stop (`requested`) and arms a timer that ends the process after
    HARD_STOP_SECONDS if the orderly stop has not; a second signal ends it at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.requested = asyncio.Event()
        self._signalled = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self._signalled:
            _exit_now(f"{name} again while stopping: exiting now")
        self._signalled = True
        why = f"not stopped {HARD_STOP_SECONDS:.0f} s after {name}: exiting now"
        timer = threading.Timer(HARD_STOP_SECONDS, _exit_now, [why])
        timer.daemon = True
        timer.start()
        self.loop.call_soon_threadsafe(self.requested.set)


def _exit_now(why: str) -> None:
    with contextlib.suppress(Exception):
        log.error("%s", why)
        logging.shutdown()
    os._exit(1)


def remove_own_socket(path: str, inode: int) -> None:
    """Remove the socket file unless another sidecar has replaced it meanwhile."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            os.unlink(path)


def announce(runner: web.AppRunner, settings: Settings) -> None:
    """The start-up line, once, on standard output whatever log_level is (logging, on standard
    error, would write it a second time where both go to one journal or file)."""
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


class PrintableFormatter(logging.Formatter):
    """Log lines quote what ranks sent (job ids are checked, but cgroup names, exception text
    and stack lines are theirs): every message goes through safetext.printable, so a log line
    is one line and carries no escape sequence to the terminal that tails it. Tracebacks, the
    sidecar's own, keep their line breaks."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        # a traceback's lines may quote what a rank sent (an exception's message): escaped too
        return printable(super().format(record), keep_newlines=True)


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])
