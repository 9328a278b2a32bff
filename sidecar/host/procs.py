"""Process facts the sidecar trusts before it records or signals a process: start times (a
pid plus its start time names one process, pid reuse cannot fool it), whether a process still
runs, is a zombie or is stopped, whether its threads rest, ancestry, and the process behind a local TCP connection.
Callers and pidfds: sidecar/host/identity.py."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from collections.abc import Iterable, Iterator

import psutil

from sidecar.host import cgroups

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def start_time(pid: int) -> float | None:
    """Seconds from boot to the process's start (field 22 of /proc/<pid>/stat), or None when
    it is not running or not visible from here (another pid namespace). With the pid, it names
    one process. Boot-relative on purpose: psutil's create_time() adds the boot time derived
    from the wall clock, so a stepped clock (chrony, a migrated VM) would make every rank look
    like a new process."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) / _CLOCK_TICKS if fields is not None else None
    except (ValueError, IndexError):
        return None


def parent(pid: int, started: float | None) -> tuple[int, float] | None:
    """The process's parent as (pid, start time): the process that launched it (torchrun's agent,
    or the forkserver the agent started), or None when it is gone or not the process `started` names."""
    fields = _own_stat(pid, started)
    try:
        ppid = int(fields[1]) if fields is not None else 0
    except (ValueError, IndexError):
        return None
    born = start_time(ppid) if ppid > 0 else None
    return None if born is None else (ppid, born)


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3 first), or None."""
    try:
        with open(f"{psutil.PROCFS_PATH}/{int(pid)}/stat", "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 2 :].split()
    except (OSError, ValueError):
        return None


def _own_stat(pid: int, started: float | None) -> list[bytes] | None:
    """/proc/<pid>/stat's fields when it is still the process that started at `started` (checked in
    the same read: pid reuse cannot lend it another's facts)."""
    fields = _stat_fields(pid) if started is not None else None
    try:
        return fields if fields is not None and int(fields[19]) / _CLOCK_TICKS == started else None
    except (ValueError, IndexError):
        return None


def cpu_seconds(pid: int, started: float | None) -> float | None:
    """The CPU time the process has used, all its threads, user and system (utime + stime, fields
    14 and 15 of /proc/<pid>/stat), when it is still the process that started at `started`; None
    otherwise, or when it cannot be read. Its children's time is not in it."""
    fields = _own_stat(pid, started)
    try:
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS if fields is not None else None
    except (ValueError, IndexError):
        return None


def state(pid: int, started: float | None) -> str | None:
    """The process's state letter (field 3 of /proc/<pid>/stat: R, S, D, T, t, Z...) when it is still
    the process that started at `started`; "F" for a task of a frozen freezer cgroup (v1 shows those
    as D, v2 as S: it is stopped, not waiting on storage); None when it cannot be read."""
    fields = _own_stat(pid, started)
    try:
        letter = fields[0].decode() if fields is not None else None
    except (IndexError, UnicodeDecodeError):
        return None
    if letter is None:
        return None
    return "F" if letter in ("D", "S") and _frozen(pid) else letter


def _frozen(pid: int) -> bool:
    """Whether the process's freezer cgroup (v1 `freezer.state`, or v2 `cgroup.freeze`) is frozen,
    read through cgroups.cgroup_of (each directory opened below its mount, no path from the process)."""
    found = cgroups.cgroup_of(pid, "freezer", psutil.PROCFS_PATH)
    if found is None:
        return False
    try:
        if found.version == 1:
            return (found.read("freezer.state") or "").strip() == "FROZEN"
        return (found.read("cgroup.freeze") or "").strip() == "1"
    finally:
        found.close()


def child_states(pid: int) -> set[str]:
    """The states of the process's children (psutil's: "running", "stopped", "disk-sleep", ...):
    a DataLoader's workers at work, stopped, or stuck in D."""
    try:
        return {c.status() for c in psutil.Process(pid).children()}
    except psutil.Error:
        return set()


HALTED = frozenset({psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_DISK_SLEEP})


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


def at_rest(pids: Iterable[int]) -> bool:
    """No thread of these processes is running, runnable (R) or in a disk wait (D): each
    sleeps (S), is stopped (T) or is gone. A signal handler at work (faulthandler writing a
    dump) is one or the other. False when a process cannot be read (gone, or not visible from
    here): the caller cannot tell, so it must not conclude."""
    for pid in pids:
        task = f"{psutil.PROCFS_PATH}/{int(pid)}/task"
        try:
            tids = os.listdir(task)
        except OSError:
            return False
        for tid in tids:
            try:
                with open(f"{task}/{tid}/stat", "rb") as f:
                    data = f.read()
                state = data[data.rindex(b")") + 2 :].split()[0]
            except (OSError, ValueError, IndexError):
                continue  # the thread ended meanwhile
            if state in (b"R", b"D"):
                return False
    return True


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


# ---------------------------------------------------------------- TCP sockets and their processes

_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp


def _tcp_sockets() -> Iterator[tuple[tuple[str, int], tuple[str, int], str, int]]:
    """(local address, remote address, state, inode) of every TCP socket of this network
    namespace, from /proc/net/tcp and tcp6 (an inode of 0: no process holds it any more)."""
    for local, remote, state, _, inode in tcp_rows():
        yield local, remote, state, inode


def tcp_rows(pid: int | None = None) -> Iterator[tuple[tuple[str, int], tuple[str, int], str, int, int]]:
    """(local address, remote address, state, uid, inode) of every row of /proc/net/tcp and tcp6:
    this network namespace's, or the one the process `pid` is in (/proc/<pid>/net/tcp)."""
    where = psutil.PROCFS_PATH if pid is None else f"{psutil.PROCFS_PATH}/{int(pid)}"
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"{where}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            try:
                local, remote = address(fields[1], family), address(fields[2], family)
                yield local, remote, fields[3], int(fields[7]), int(fields[9])
            except (IndexError, ValueError, OSError):
                continue


def address(text: str, family: int) -> tuple[str, int]:
    """ "0100007F:1F90" -> ("127.0.0.1", 8080): each 32-bit word in the host's byte order."""
    host, _, port = text.partition(":")
    raw = bytes.fromhex(host)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw), int(port, 16)


def same_host(a: str, b: str) -> bool:
    try:
        x, y = ipaddress.ip_address(a), ipaddress.ip_address(b)
    except ValueError:
        return False
    x = x.ipv4_mapped or x if isinstance(x, ipaddress.IPv6Address) else x
    y = y.ipv4_mapped or y if isinstance(y, ipaddress.IPv6Address) else y
    return x == y


def holds_socket(pid: int, inode: int) -> bool:
    """Whether the process `pid` has the socket `inode` open now."""
    want = f"socket:[{inode}]"
    try:
        names = os.listdir(f"{psutil.PROCFS_PATH}/{int(pid)}/fd")
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(f"{psutil.PROCFS_PATH}/{int(pid)}/fd/{name}") == want:
                return True
        except OSError:
            continue
    return False


def _holder(inode: int) -> int | None:
    """The lowest pid holding the socket `inode`: /proc/<pid>/fd of every process, until found."""
    try:
        pids = sorted(int(p) for p in os.listdir(psutil.PROCFS_PATH) if p.isdigit())
    except OSError:
        return None
    return next((pid for pid in pids if holds_socket(pid, inode)), None)


def tcp_peer(client: tuple, server: tuple) -> tuple[int, int] | None:
    """The process holding the client end of a TCP connection from this node (client and server
    are (host, port) as the server sees them) and that socket's inode, or None when it cannot
    be seen: a client on another host or in another network namespace, one that closed its
    end, another user's process while the sidecar is not root. Scans every process's
    descriptors, so callers run it off the event loop and only for rare requests
    (registration); identity.process_peer then checks the process still holds the socket."""
    for local, remote, _, inode in _tcp_sockets():
        if local[1] == client[1] and remote[1] == server[1] and same_host(local[0], client[0]):
            if same_host(remote[0], server[0]) and inode:
                pid = _holder(inode)
                return None if pid is None else (pid, inode)
    return None


_TCP_LIVE = ("01", "08")  # ESTABLISHED, CLOSE_WAIT: a process still holds its end (not a TIME_WAIT minisock)


def is_local_address(host: str) -> bool:
    """Whether `host` is loopback or an address of this network namespace's interfaces (the kernel
    drops packets from outside that claim such a source)."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    ip = ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip
    if ip.is_loopback:
        return True
    try:
        found = psutil.net_if_addrs()
    except (OSError, RuntimeError):
        return True  # cannot tell: treat it as local (the caller then needs a live socket of an allowed uid)
    return any(same_host(a.address.split("%")[0], str(ip)) for addrs in found.values() for a in addrs)


def tcp_client_uid(client: tuple, server: tuple) -> int | None:
    """The uid owning the client end of a live TCP connection from this node (the `uid` column of
    /proc/net/tcp*, its creator's: one read, no scan of processes): a row ESTABLISHED or in
    CLOSE_WAIT with an inode (a process holds it). None when there is none: the client closed or
    reset its end (a TIME_WAIT row says uid 0 and inode 0: never taken), or /proc cannot be read."""
    for local, remote, state, uid, inode in tcp_rows():
        if state not in _TCP_LIVE or inode == 0 or local[1] != client[1] or remote[1] != server[1]:
            continue
        if same_host(local[0], client[0]) and same_host(remote[0], server[0]):
            return uid
    return None


def tcp_listener(port: int) -> str | None:
    """Who listens on TCP `port` in this network namespace, for a start-up error: "pid 123
    (uid 1001, python3)", "an unknown process" when none is visible; None when nobody listens."""
    inodes = [inode for local, _, state, inode in _tcp_sockets() if local[1] == port and state == _TCP_LISTEN]
    if not inodes:
        return None
    for inode in inodes:
        pid = _holder(inode) if inode else None
        if pid is not None:
            try:
                p = psutil.Process(pid)
                return f"pid {pid} (uid {p.uids().real}, {p.name()})"
            except psutil.Error:
                return f"pid {pid}"
    return "an unknown process"
