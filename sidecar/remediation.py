"""Remediation of a hung worker group: stack dumps, then SIGTERM, a grace period, SIGKILL.

Every signal goes through `send()`, and `send()` asks `refusal()` right before signalling:
only processes that registered themselves (a `Target` is made from a registration whose
caller was verified as that process or its launcher), still the same process, never pid 1,
the sidecar or its ancestors. Where the kernel has pidfds the rank is named by the pidfd kept
since its registration and signalled through it (`pidfd_send_signal`): a reused pid cannot
be hit, there is no window between check and signal. Elsewhere pid plus start time name it.
A rank that leads its own process group (torchrun starts each worker in its own session) is
signalled as a group, so its data-loader workers go with it (through the pidfd too: the
kernel finds the group by the leader's pid structure, so members that outlive the leader
still get the SIGKILL); otherwise only the rank and its descendants are.

The waits are asyncio sleeps and the blocking calls run in the default executor, so the
watchdog keeps ticking while a group is being dumped and killed.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from sidecar import procs
from sidecar.config import RemediationSettings
from sidecar.incidents import Incident, main_thread, stack_head
from sidecar.stackfiles import MAX_STACK_BYTES, StackFile

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.identity import PidFd
    from sidecar.registry import Rank

log = logging.getLogger(__name__)

EXIT_WAIT_SECONDS = 10.0  # after SIGKILL, how long to wait to see the processes gone
POLL_SECONDS = 0.1
# Frames of a rank that waits for its peers: anything inside torch.distributed (faulthandler:
# `File ".../torch/distributed/x.py"`, py-spy: `all_reduce (torch/distributed/x.py:12)`), and
# autograd's backward, where DDP waits for its gradient all-reduce.
COLLECTIVE_FRAME = re.compile(r"torch[/\\]distributed[/\\]|_engine_run_backward")


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

    @classmethod
    def of(cls, rank: Rank) -> Target:
        return cls(rank.job_id, rank.rank, rank.pid, rank.pid_start_time, rank.stack_signal, rank.stack_file,
                   rank.peer_verified, rank.pidfd)

    def is_running(self) -> bool:
        """Still the registered process, and not exited (an unreaped zombie has exited)."""
        if self.pidfd is not None:
            return self.pidfd.alive()
        return procs.is_running(self.pid, self.start_time)


# ---------------------------------------------------------------- safety

def _ask_for_stacks(target: Target, stack_signal: int, stopped: bool) -> None:
    send(target, stack_signal, "process")
    if stopped:  # a stopped process runs no handler: continue it; _restop stops it again
        send(target, signal.SIGCONT, "process")


# A stopped rank is continued only until its dump is written: faulthandler writes the whole
# dump from inside its signal handler, so the file growing and then holding still for a few
# milliseconds means the handler has returned (or is about to), and the rank is stopped again
# after at most RESTOP_MAX_SECONDS of running.
RESTOP_STILL_SECONDS = 0.02
RESTOP_MAX_SECONDS = 1.0


async def _restop(target: Target, size_before: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RESTOP_MAX_SECONDS
    last, still_since = -1, None
    while loop.time() < deadline:
        size = await loop.run_in_executor(None, _file_size, target.stack_file)
        if size > size_before and size == last:
            still_since = still_since or loop.time()
            if loop.time() - still_since >= RESTOP_STILL_SECONDS:
                break
        else:
            still_since = None
        last = size
        await asyncio.sleep(0.005)
    await loop.run_in_executor(None, send, target, signal.SIGSTOP, "process")


def refusal(target: Target, protected: frozenset[int] | None = None, exited_ok: bool = False) -> str | None:
    """Why `target` must not be signalled, or None when it may be. The one safety check, asked
    right before every signal. `exited_ok`: the rank itself may have exited (its leftover
    group is signalled through its pidfd, which only ever names that rank)."""
    protected = procs.protected_pids() if protected is None else protected
    pid, start_time = target.pid, target.start_time
    if not target.verified:
        return (f"pid {pid} was registered by a client that could not be verified as that process "
                f"or its launcher")
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
        tree = [psutil.Process(target.pid)] + _descendants(target.pid)
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
        log.warning("no permission to signal pid %d (descendant of rank %s/%d)", member.pid, target.job_id,
                    target.rank)
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


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


# ---------------------------------------------------------------- storm cap

class StormCap:
    """At most `limit` remediations per sliding `window` seconds."""

    def __init__(self, limit: int, window: float, clock: Callable[[], float] = time.monotonic):
        self.limit, self.window, self.clock = limit, window, clock
        self._times: list[float] = []

    def _prune(self) -> None:
        cutoff = self.clock() - self.window
        self._times = [t for t in self._times if t > cutoff]

    def allow(self) -> bool:
        """Take one slot if there is one."""
        self._prune()
        if len(self._times) >= self.limit:
            return False
        self._times.append(self.clock())
        return True

    def in_window(self) -> int:
        self._prune()
        return len(self._times)


class OwnerStormCaps:
    """The storm cap per owner (the uid a job's ranks run as), under a node-wide ceiling: one
    user's restart storm spends its own budget, never the one another user's job needs."""

    def __init__(self, per_owner: int, node: int, window: float, clock: Callable[[], float] = time.monotonic):
        self.per_owner, self.window, self.clock = per_owner, window, clock
        self.node = StormCap(node, window, clock)
        self._owners: dict[object, StormCap] = {}

    def allow(self, owner: object) -> str | None:
        """Take a slot of `owner` and of the node; None when taken, else which cap is full."""
        cap = self._owners.get(owner)
        if cap is None:
            cap = self._owners[owner] = StormCap(self.per_owner, self.window, self.clock)
        if cap.in_window() >= cap.limit:
            return f"{self.per_owner} remediations of uid {owner} per {self.window:.0f}s (remediation.max_per_window)"
        if not self.node.allow():
            return f"{self.node.limit} remediations on this node per {self.window:.0f}s " \
                   "(remediation.max_per_window_node)"
        cap.allow()
        for key in [k for k, c in self._owners.items() if k != owner and c.in_window() == 0]:
            del self._owners[key]  # bounded by the owners with a remediation in the window
        return None

    def in_window(self) -> int:
        return self.node.in_window()


# ---------------------------------------------------------------- stacks

def in_collective(text: str) -> bool | None:
    """Whether a stack dump shows the rank's main thread waiting for its peers (inside
    torch.distributed or DDP's backward); None without a dump."""
    if not text.strip():
        return None
    return bool(COLLECTIVE_FRAME.search(main_thread(text)))


def _file_size(stack_file: StackFile | None) -> int:
    return stack_file.size() if stack_file is not None else 0


def py_spy_path() -> str | None:
    """py-spy on PATH or next to this Python (a virtual environment's bin/)."""
    found = shutil.which("py-spy")
    if found:
        return found
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else None


async def py_spy_dump(pid: int, timeout: float, nonblocking: bool) -> str:
    """`py-spy dump --pid`: its output, or one line saying why there is none."""
    exe = py_spy_path()
    if exe is None:
        return ""
    cmd = [exe, "dump", "--pid", str(pid)] + (["--nonblocking"] if nonblocking else [])
    try:
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
    except OSError as e:
        return f"py-spy could not start: {e}"
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return f"py-spy gave no answer within {timeout:.0f}s"
    text = out.decode(errors="replace")[:MAX_STACK_BYTES]
    return text if proc.returncode == 0 else f"py-spy failed (exit {proc.returncode}): {text.strip()[:300]}"


# ---------------------------------------------------------------- remediation

@dataclass
class Termination:
    """Ranks SIGTERM reached, and the members of their process trees seen at that moment."""

    signalled: list[Target]
    members: list[tuple[Target, psutil.Process]]


class Remediator:
    def __init__(self, settings: RemediationSettings):
        self.settings = settings

    async def collect_stacks(self, incident: Incident, targets: list[Target], signal_ranks: bool = True) -> None:
        """Ask each rank for its Python stacks, run py-spy alongside, and keep what each dump
        file gained. A stopped rank gets the dump signal and SIGCONT, and SIGSTOP again as
        soon as its dump file has grown and held still (at most RESTOP_MAX_SECONDS): a stopped
        process runs no signal handler, and sending SIGSTOP at once would stop it again before
        the handler's first instruction, while continuing it for the whole dump wait would let
        it train on, or even finish, before the SIGTERM. Without `signal_ranks` only py-spy's
        non-blocking mode runs: it never stops the process."""
        s = self.settings
        loop = asyncio.get_running_loop()
        by_pid = {r.pid: r for r in incident.ranks}
        sizes = {t.pid: await loop.run_in_executor(None, _file_size, t.stack_file) for t in targets}
        asked = []
        stopped = {t.pid for t in targets if await loop.run_in_executor(None, procs.is_stopped, t.pid)}
        for t in targets:
            if t.pid in stopped:
                incident.notes.append(f"rank {t.rank} (pid {t.pid}) was stopped (SIGSTOP or a tracer); "
                                      "continued only to dump its stacks, then stopped again")
        if signal_ranks and s.dump_stacks:
            for t in targets:
                if not (t.stack_signal and t.stack_file):
                    continue
                try:
                    await loop.run_in_executor(None, _ask_for_stacks, t, t.stack_signal, t.pid in stopped)
                    asked.append(t)
                except (Refused, OSError, psutil.Error) as e:
                    incident.notes.append(f"no stack dump from rank {t.rank}: {e}")
            restops = [t for t in asked if t.pid in stopped]
            if restops:
                results = await asyncio.gather(*(_restop(t, sizes[t.pid]) for t in restops),
                                               return_exceptions=True)
                for t, result in zip(restops, results, strict=True):
                    if isinstance(result, BaseException):
                        incident.notes.append(f"rank {t.rank} (pid {t.pid}) not stopped again "
                                              f"after its dump: {result}")
            incident.event("dumps_requested", ranks=[t.rank for t in asked])
        spy = None
        if s.py_spy and py_spy_path():
            timeout = max(5.0, s.dump_wait_seconds + 3.0)
            spy = asyncio.gather(*(py_spy_dump(t.pid, timeout, nonblocking=not signal_ranks or t.pid in stopped)
                                   for t in targets))
        if asked:
            await self._wait_for_dumps(asked, sizes)
        got = []
        for t in asked:
            assert t.stack_file is not None  # only ranks with a dump file are asked
            text = await loop.run_in_executor(None, t.stack_file.read_from, sizes[t.pid])
            snap = by_pid.get(t.pid)
            if snap is not None and text.strip():
                snap.stack_file, snap.stack_head, snap.stack_bytes = t.stack_file.path, stack_head(text), len(text)
                snap.in_collective = in_collective(text)
                got.append(t.rank)
        if asked:
            incident.event("dumps_received", ranks=got)
        if spy is not None:
            for t, text in zip(targets, await spy, strict=True):
                snap = by_pid.get(t.pid)
                if snap is not None and text:
                    snap.py_spy = text
                    if snap.in_collective is None and not text.startswith("py-spy "):
                        snap.in_collective = in_collective(text)
            incident.event("py_spy_done")

    async def _wait_for_dumps(self, targets: list[Target], sizes: dict[int, int]) -> None:
        """Until every file has grown and then held still briefly, or dump_wait_seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.dump_wait_seconds
        last: dict[int, int] = {}
        still_since: float | None = None
        while loop.time() < deadline:
            now = {t.pid: await loop.run_in_executor(None, _file_size, t.stack_file) for t in targets}
            grown = all(now[p] > sizes[p] for p in now)
            if grown and now == last:
                still_since = still_since or loop.time()
                if loop.time() - still_since >= 0.3:
                    return
            else:
                still_since = None
            last = now
            await asyncio.sleep(POLL_SECONDS)

    async def sigterm(self, incident: Incident, targets: list[Target]) -> Termination | None:
        """The first half of a termination: SIGTERM each rank's group (None when no rank could
        be signalled). The caller saves the incident, then awaits `finish`."""
        loop = asyncio.get_running_loop()
        # The tree as it is now: what a rank started is killed even if the rank dies first.
        members = [(t, p) for t in targets for p in await loop.run_in_executor(None, _descendants, t.pid)]
        signalled = await self._signal_all(incident, targets, signal.SIGTERM, "sigterm")
        if not signalled:
            incident.notes.append("no rank could be signalled")
            return None
        return Termination(signalled, [(t, p) for t, p in members if t in signalled])  # never a refused rank's tree

    async def finish(self, incident: Incident, term: Termination) -> str:
        """After SIGTERM: wait grace_seconds, then SIGKILL every rank and every member of their
        groups still alive (not only ranks: a data-loader worker that ignores SIGTERM would hold
        the GPU). "killed" when every rank and member is seen gone, whether SIGTERM did it (the
        timeline then shows no `sigkill`) or SIGKILL; else "failed"."""
        loop = asyncio.get_running_loop()
        signalled, members = term.signalled, term.members
        left, members_left = await self._wait_exit(signalled, members, self.settings.grace_seconds)
        if left or members_left:
            await loop.run_in_executor(None, self._kill_left, incident, signalled, left, members_left)
            left, members_left = await self._wait_exit(left, members_left, EXIT_WAIT_SECONDS)
        if left or members_left:
            incident.event("still_running", ranks=[t.rank for t in left], pids=[p.pid for _, p in members_left])
            outcome = "failed"
        else:
            incident.event("exit_observed", ranks=[t.rank for t in signalled])
            outcome = "killed"
        return outcome

    def _kill_left(self, incident: Incident, signalled: list[Target], left: list[Target],
                   members_left: list[tuple[Target, psutil.Process]]) -> None:
        """SIGKILL: ranks still running with their groups; the leftover group of a rank that
        already exited (through its pidfd); any member of the trees seen at SIGTERM time."""
        done, sent = [], []
        for t in signalled:
            try:
                sent += send(t, signal.SIGKILL, "group" if t in left else "group_left")
                done.append(t.rank)
            except (Refused, OSError, psutil.Error) as e:
                if t in left:
                    incident.notes.append(f"SIGKILL not sent to rank {t.rank} (pid {t.pid}): {e}")
                    log.warning("not signalling rank %s/%d: %s", t.job_id, t.rank, e)
        protected = procs.protected_pids()
        sent += [p.pid for t, p in members_left if _alive(p) and send_member(t, p, signal.SIGKILL, protected)]
        incident.event("sigkill", ranks=done, pids=sorted(set(sent)))

    async def _signal_all(self, incident: Incident, targets: list[Target], sig: int, event: str) -> list[Target]:
        loop = asyncio.get_running_loop()
        done, sent = [], []
        for t in targets:
            try:
                sent += await loop.run_in_executor(None, send, t, sig, "group")
            except (Refused, OSError, psutil.Error) as e:
                incident.notes.append(f"{signal.Signals(sig).name} not sent to rank {t.rank} (pid {t.pid}): {e}")
                log.warning("not signalling rank %s/%d: %s", t.job_id, t.rank, e)
                continue
            done.append(t)
            if sig == signal.SIGTERM:  # a stopped process handles SIGTERM only once continued,
                # and continued after the SIGTERM is pending, it runs no training code first.
                # A rank that already exited on the SIGTERM needs no SIGCONT.
                with contextlib.suppress(Refused, OSError, psutil.Error):
                    await loop.run_in_executor(None, send, t, signal.SIGCONT, "group")
        incident.event(event, ranks=[t.rank for t in done], pids=sent)
        return done

    async def _wait_exit(self, targets: list[Target], members: list[tuple[Target, psutil.Process]],
                         seconds: float) -> tuple[list[Target], list[tuple[Target, psutil.Process]]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while True:
            left = [t for t in targets if await loop.run_in_executor(None, Target.is_running, t)]
            members = [(t, p) for t, p in members if await loop.run_in_executor(None, _alive, p)]
            if (not left and not members) or loop.time() >= deadline:
                return left, members
            await asyncio.sleep(POLL_SECONDS)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
