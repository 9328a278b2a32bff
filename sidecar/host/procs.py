"""Process facts the sidecar trusts before it records or signals a process: start times (a
pid plus its start time names one process, pid reuse cannot fool it), whether a process still
runs, is a zombie or is stopped, ancestry, and the client of a loopback TCP connection.
Callers and pidfds: sidecar/host/identity.py."""

from __future__ import annotations

import os

import psutil

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def start_time(pid: int) -> float | None:
    """Seconds from boot to the process's start (field 22 of /proc/<pid>/stat), or None when
    it is not running or not visible from here (another pid namespace). With the pid, it names
    one process. Boot-relative on purpose: psutil's create_time() adds the boot time derived
    from the wall clock, so a stepped clock (chrony, a migrated VM) would make every rank look
    like a new process."""
    try:
        with open(f"{psutil.PROCFS_PATH}/{int(pid)}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2 :].split()[19]) / _CLOCK_TICKS
    except (OSError, ValueError, IndexError):
        return None


def is_same_process(pid: int, started: float | None) -> bool:
    """True when `pid` still runs and is the process that had that start time."""
    if started is None:
        return False
    return start_time(pid) == started


def is_running(pid: int, start_time: float | None) -> bool:
    """The process with that identity still runs (an unreaped zombie has exited)."""
    return is_same_process(pid, start_time) and not is_zombie(pid)


def is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP) or a tracer."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def ancestors(pid: int) -> list[int]:
    """The pids of a process's parents, nearest first; empty when it is not running."""
    try:
        return [p.pid for p in psutil.Process(pid).parents()]
    except (psutil.Error, ValueError):
        return []


def is_self_or_descendant(pid: int, ancestor: int) -> bool:
    """True when `pid` is `ancestor` or was started (transitively) by it."""
    return pid == ancestor or ancestor in ancestors(pid)


def protected_pids() -> frozenset[int]:
    """Processes that may never register (and so never be signalled): init, the sidecar
    itself, and everything it runs under (its supervisor, a container's init)."""
    me = os.getpid()
    return frozenset({0, 1, me, *ancestors(me)})


def tcp_peer_pid(client: tuple, server: tuple) -> int | None:
    """The pid owning the client end of a loopback TCP connection (client and server are
    (host, port) as the server sees them), or None when it cannot be seen: another user's
    process while the sidecar is not root, or a process in another pid namespace. Scans
    every process's descriptors, so callers run it off the event loop and only for rare
    requests (registration)."""
    want_client, want_server = (client[0], client[1]), (server[0], server[1])
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for c in connections:
        if c.pid and tuple(c.laddr) == want_client and tuple(c.raddr) == want_server:  # raddr: () unconnected
            return c.pid
    return None
