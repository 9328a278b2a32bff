"""Who is calling, and which process a registration names: tied to processes, not pid numbers.

A pid number can be reused the moment its process is reaped, so the sidecar names processes by
pidfds where the kernel has them (Linux 5.3+ `pidfd_open`, 6.5+ `SO_PEERPIDFD`):

- the caller is the process at the other end of the Unix connection. `SO_PEERCRED` gives its
  pid and uid as recorded at `connect()`; `SO_PEERPIDFD` gives a pidfd of that very process,
  which polls readable once it has exited. A connection whose process has exited is refused:
  its pid may already belong to someone else.
- the process a registration names is found from the caller: the caller itself or one of its
  descendants whose pid *in the caller's pid namespace* is the claimed pid (the last field of
  `NSpid` for a caller in a pod without `hostPID`). From then on only the host pid is used, and
  a pidfd of it is kept for the rank's whole registration: every signal goes through it.
- the caller's uid must be the uid of the process it registers (every one of its real,
  effective and saved uids); root may register anyone's.

Facts read from /proc about a process are trusted only if its pidfd still shows it alive
after the reads: a live process keeps its pid, so the reads were about it.

Without pidfds (older kernels) the same checks run on pid numbers plus boot-relative start
times, and a connection's process cannot be told from a later process with the same pid:
docs/security.md describes that fallback.
"""

from __future__ import annotations

import errno
import itertools
import os
import select
import signal
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from sidecar.host import procs

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5+, asm-generic value
PIDFD_SIGNAL_PROCESS_GROUP = 4  # Linux 6.9+: signal the process group the pidfd's process leads
_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


class IdentityError(Exception):
    """A caller or claimed process the sidecar refuses (403 with this message)."""

    status = 403

    def __init__(self, message: str, code: str = "pid_mismatch"):
        super().__init__(message)
        self.code = code


class PidFd:
    """A pidfd, closed when the last reference to it goes (a rank's registration and any
    remediation still holding its target share one), so its number is never reused while
    someone may signal through it."""

    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd

    def alive(self) -> bool:
        """The process has not exited (a pidfd polls readable from its exit on)."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return not poller.poll(0)

    def send(self, sig: int, group: bool = False) -> None:
        """`pidfd_send_signal`: to the process, or (`group`) to the process group it leads,
        which the kernel finds by the process, not by a number, even after the leader exited."""
        signal.pidfd_send_signal(self.fd, sig, None, PIDFD_SIGNAL_PROCESS_GROUP if group else 0)

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def open_pidfd(pid: int) -> PidFd | None:
    """A pidfd of `pid`, or None where the kernel has no pidfd_open (the fallback)."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return PidFd(os.pidfd_open(pid))
    except ProcessLookupError:
        raise IdentityError(f"pid: {pid} exited while it was being registered") from None
    except OSError as e:
        if e.errno in (errno.ENOSYS, errno.EPERM):
            return None
        raise IdentityError(f"pid: {pid} cannot be opened ({e.strerror})") from None


@dataclass
class Peer:
    """The process at the other end of a connection: its pid in the sidecar's pid namespace,
    its uid, and a pidfd of it (None without kernel support or over TCP)."""

    pid: int
    uid: int
    pidfd: PidFd | None = None

    def check_alive(self) -> None:
        if self.pidfd is not None and not self.pidfd.alive():
            raise IdentityError(
                f"the connecting process (pid {self.pid}) has exited; its pid may name another "
                "process now, so nothing it sends over this connection is trusted"
            )


def unix_peer(sock: socket.socket | None, want_pidfd: bool = True) -> Peer | None:
    """The peer of a Unix stream connection (None for other sockets, and when the peer lives
    in a pid namespace the sidecar cannot see: the kernel reports pid 0 then)."""
    if sock is None or getattr(sock, "family", None) != socket.AF_UNIX:
        return None
    try:
        pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return None
    if not pid:
        return None
    peer = Peer(pid, uid)
    if want_pidfd:
        try:
            peer.pidfd = PidFd(sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD))
        except OSError as e:
            if e.errno in (errno.ESRCH, errno.EINVAL):  # the peer has exited (and was reaped)
                raise IdentityError(
                    f"the connecting process (pid {pid}) has exited; its pid may name another "
                    "process now, so nothing it sends over this connection is trusted"
                ) from None
            # ENOPROTOOPT: a kernel before 6.5; pid numbers and start times it is.
    return peer


def process_peer(pid: int, socket_inode: int | None = None) -> Peer | None:
    """A peer found another way (the client of a local TCP connection, `socket_inode` its end
    of it): no pidfd from the kernel, so one is opened now, and only then are the facts read:
    its uid, and that it still holds the connection. The process found by the lookup may have
    exited since and its pid been reused (by root's process, say): that one does not hold the
    socket, and is refused (IdentityError) rather than taken for the caller. The pidfd still
    alive after the reads means they were about it. None when the process is not there any more
    to be opened."""
    try:
        pidfd = open_pidfd(pid)
    except IdentityError:
        return None
    ids = uids(pid)
    if ids is None:
        return None
    if socket_inode is not None and not procs.holds_socket(pid, socket_inode):
        raise IdentityError(
            f"the connecting process (pid {pid}) does not hold the connection any more: it has exited and its "
            "pid may name another process now, so nothing it sends over this connection is trusted"
        )
    peer = Peer(pid, ids[0], pidfd)
    peer.check_alive()
    return peer


# ---------------------------------------------------------------- /proc facts


def _status_fields(pid: int, *names: str) -> dict[str, list[str]] | None:
    try:
        with open(f"{psutil.PROCFS_PATH}/{int(pid)}/status", "rb") as f:
            text = f.read().decode(errors="replace")
    except (OSError, ValueError):
        return None
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in names:
            out[key] = value.split()
    return out


def nspids(pid: int) -> list[int] | None:
    """The process's pid in each pid namespace from the sidecar's down to its own (`NSpid` of
    /proc/<pid>/status); None when it is not running."""
    fields = _status_fields(pid, "NSpid", "Pid")
    if not fields:
        return None
    values = fields.get("NSpid") or fields.get("Pid")  # kernels before 4.1 have no NSpid
    try:
        return [int(v) for v in values] if values else None
    except ValueError:
        return None


def uids(pid: int) -> tuple[int, ...] | None:
    """(real, effective, saved, filesystem) uids of a process; None when it is not running."""
    fields = _status_fields(pid, "Uid")
    try:
        return tuple(int(v) for v in fields["Uid"]) if fields and "Uid" in fields else None
    except ValueError:
        return None


# ---------------------------------------------------------------- resolving a claim


@dataclass
class Claimed:
    """The process a registration names, as verified: its host pid (used for everything from
    now on), the pid it calls itself, its start time, uid and pidfd."""

    pid: int
    claimed_pid: int
    start_time: float | None
    uid: int | None
    pidfd: PidFd | None


def resolve(peer: Peer, claimed: int, protected: frozenset[int]) -> Claimed:
    """The process `claimed` names, seen from `peer`: the peer itself or a descendant whose pid
    in the peer's pid namespace is `claimed`. Raises IdentityError (403) naming the pid and the
    reason when there is none, when it is protected (pid 1 of the host, the sidecar, its
    ancestors), or when it runs as another uid than a non-root caller."""
    peer.check_alive()
    peer_ns = nspids(peer.pid)
    if peer_ns is None:
        raise IdentityError(f"pid: {claimed}: the connecting process (pid {peer.pid}) has exited")
    level = len(peer_ns) - 1
    found = None
    # The caller itself first (a rank registering itself, the common case). A caller in the
    # sidecar's own pid namespace names a host pid: its ancestry is walked up (a launcher of a
    # thousand workers must not make each registration read every worker). A caller in a pod's
    # namespace names a pid only its descendants' NSpid can map: those are scanned.
    if level == 0:
        candidates: Iterable[int] = [claimed] if procs.is_self_or_descendant(claimed, peer.pid) else []
    else:
        candidates = itertools.chain([peer.pid], (p.pid for p in _descendants(peer.pid)))
    for pid in candidates:
        ns = nspids(pid)
        if ns is not None and len(ns) > level and ns[level] == claimed:
            found = pid
            break
    where = "" if level == 0 else f" in its pid namespace (host pid {peer.pid})"
    if found is None:
        raise IdentityError(
            f"pid: {claimed} is neither the connecting process (pid {peer_ns[-1]}{where}) nor one of its descendants"
        )
    if found <= 1 or found in protected:
        raise IdentityError(
            f"pid: {claimed} (host pid {found}) is init, the sidecar or one of its ancestors; it may never register"
        )
    started = procs.start_time(found)
    ids = uids(found)
    pidfd = open_pidfd(found)
    if peer.uid != 0 and (ids is None or any(u != peer.uid for u in ids[:3])):
        raise IdentityError(
            f"pid: {claimed} runs as uid {ids[0] if ids else '?'}, the caller as uid {peer.uid}; "
            "only root may register another user's process",
            code="uid_mismatch",
        )
    # The reads above were about these processes only if both still live now.
    peer.check_alive()
    if (pidfd is not None and not pidfd.alive()) or procs.start_time(found) != started:
        raise IdentityError(f"pid: {claimed} (host pid {found}) exited while it was being registered")
    return Claimed(pid=found, claimed_pid=claimed, start_time=started, uid=ids[0] if ids else None, pidfd=pidfd)


def check_sender(peer: Peer, rank_pid: int, owner_uid: int | None) -> None:
    """A push or deregistration over the Unix socket: from the rank's process (host pid) or one
    of its ancestors, and from the rank's uid or root."""
    if peer.uid != 0 and peer.uid != owner_uid:
        raise IdentityError(
            f"the caller runs as uid {peer.uid}; this rank belongs to uid {owner_uid}", code="uid_mismatch"
        )
    if peer.pid != rank_pid and not procs.is_self_or_descendant(rank_pid, peer.pid):
        raise IdentityError(
            f"pid: the registered process (host pid {rank_pid}) is neither the connecting "
            f"process ({peer.pid}) nor one of its descendants"
        )


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
