"""The one safety check and every signal the sidecar sends.

Every signal goes through `send()` (or `send_member()` for a member of a rank's process tree),
and each asks `refusal()` right before signalling: only processes that registered themselves
(a `Target` is made from a registration whose caller was verified as that process or its
launcher), still the same process, never pid 1, the sidecar or its ancestors. Where the kernel
has pidfds the rank is named by the pidfd kept since its registration and signalled through it
(`pidfd_send_signal`): a reused pid cannot be hit, there is no window between check and
signal. Elsewhere pid plus start time name it. A rank that leads its own process group
(torchrun starts each worker in its own session) is signalled as a group, so its data-loader
workers go with it (through the pidfd too: the kernel finds the group by the leader's pid
structure, so members that outlive the leader still get the SIGKILL); otherwise only the rank
and its descendants are.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from dataclasses import dataclass

import psutil

from sidecar.host import procs
from sidecar.host.identity import PidFd
from sidecar.host.stackfiles import StackFile

log = logging.getLogger(__name__)


class Refused(Exception):
    """A signal the safety rules do not allow; the message says why."""


@dataclass(frozen=True)
class Target:
    """A registered rank process, with the identity it registered with."""

    job_id: str
    rank: int
    pid: int
    start_time: float | None
    stack_signal: int | None = None
    stack_file: StackFile | None = None  # created by the sidecar (stackfiles.py), never a path the rank named
    verified: bool = True  # registered by the process itself (or its launcher), per peer credentials
    pidfd: PidFd | None = None  # kept since the registration, where the kernel has pidfds

    def is_running(self) -> bool:
        """Still the registered process, and not exited (an unreaped zombie has exited)."""
        if self.pidfd is not None:
            return self.pidfd.alive()
        return procs.is_running(self.pid, self.start_time)


def refusal(target: Target, protected: frozenset[int] | None = None, exited_ok: bool = False) -> str | None:
    """Why `target` must not be signalled, or None when it may be. The one safety check, asked
    right before every signal. `exited_ok`: the rank itself may have exited (its leftover
    group is signalled through its pidfd, which only ever names that rank)."""
    protected = procs.protected_pids() if protected is None else protected
    pid, start_time = target.pid, target.start_time
    if not target.verified:
        return f"pid {pid} was registered by a client that could not be verified as that process or its launcher"
    if pid <= 1:
        return f"pid {pid} is never signalled"
    if pid in protected:
        return f"pid {pid} is the sidecar or one of its ancestors"
    if start_time is None:
        return f"pid {pid} has no recorded start time (not visible when it registered)"
    if exited_ok:
        return None if target.pidfd is not None else f"pid {pid} has no pidfd to find its group by"
    if target.pidfd is not None:
        if not target.pidfd.alive():
            return f"pid {pid} is no longer the process that registered (exited)"
    elif not procs.is_same_process(pid, start_time):
        return f"pid {pid} is no longer the process that registered (exited or pid reused)"
    return None


def _forbidden_groups(protected: frozenset[int]) -> set[int]:
    groups = {0, 1}
    for pid in protected:
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(pid))
    return groups


def send(target: Target, sig: int, scope: str = "group") -> list[int]:
    """Signal a registered rank: `scope="process"` the rank alone; `"group"` its process group
    when it leads one of its own, else the rank and its descendants; `"group_left"` what is
    left of the group the rank led, after the rank itself exited (pidfd only: the kernel finds
    the group by the rank's pid structure, which no later process can have). Returns the pids
    (a negative number is a process group) signalled; raises Refused."""
    protected = procs.protected_pids()
    reason = refusal(target, protected, exited_ok=scope == "group_left")
    if reason:
        raise Refused(reason)
    if scope == "group_left":
        if target.pid in _forbidden_groups(protected):
            raise Refused(f"process group {target.pid} holds the sidecar or one of its ancestors")
        assert target.pidfd is not None  # refusal() refuses group_left without one
        try:
            target.pidfd.send(sig, group=True)
        except ProcessLookupError:
            return []  # nobody left in the group
        return [-target.pid]
    if scope == "process":
        if target.pidfd is not None:
            target.pidfd.send(sig)
        else:
            os.kill(target.pid, sig)
        return [target.pid]
    try:
        pgid = os.getpgid(target.pid)
    except ProcessLookupError:
        raise Refused(f"pid {target.pid} exited") from None
    if pgid == target.pid and pgid not in _forbidden_groups(protected):
        _signal_group(target, sig)
        return [-pgid]
    # Not a group leader (or its group is ours): the rank and what it started, each checked.
    try:
        tree = [psutil.Process(target.pid)] + descendants(target.pid)
    except psutil.NoSuchProcess:
        raise Refused(f"pid {target.pid} exited") from None
    return [p.pid for p in tree if send_member(target, p, sig, protected)]


def send_member(target: Target, member: psutil.Process, sig: int, protected: frozenset[int] | None = None) -> bool:
    """Signal one process of a rank's tree (`member`, read from /proc as the rank's descendant
    while the rank ran): never pid 1, the sidecar or its ancestors, and only while it is the
    process that was read (psutil compares its start time). Returns whether it was sent."""
    protected = procs.protected_pids() if protected is None else protected
    if member.pid <= 1 or member.pid in protected or not target.verified:
        return False
    try:
        member.send_signal(sig)  # psutil refuses a pid reused since `member` was made
        return True
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # a child of another user: the others still get the signal
        log.warning("no permission to signal pid %d (descendant of rank %s/%d)", member.pid, target.job_id, target.rank)
        return False


def _signal_group(target: Target, sig: int) -> None:
    if target.pidfd is not None:
        try:
            target.pidfd.send(sig, group=True)
            return
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: a kernel before 6.9 knows no group flag
                raise
    os.killpg(target.pid, sig)


def descendants_of(pids: list[int]) -> dict[int, list[psutil.Process]]:
    """The descendants of each of `pids`, from one reading of every process's parent: a job of a
    thousand ranks costs one scan of /proc, not a thousand."""
    children: dict[int, list[psutil.Process]] = {}
    for p in psutil.process_iter(["ppid"]):
        children.setdefault(p.info["ppid"], []).append(p)
    out = {}
    for pid in pids:
        found, stack = [], [pid]
        while stack:
            for child in children.get(stack.pop(), []):
                found.append(child)
                stack.append(child.pid)
        out[pid] = found
    return out


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
