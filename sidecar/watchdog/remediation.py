"""Remediation of a hung worker group: stack dumps, then SIGTERM, a grace period, SIGKILL.

Every signal goes through the one safety check in `sidecar/host/signals.py`; asking for and reading
stack dumps is `sidecar/watchdog/stackdumps.py`; the storm cap is `sidecar/watchdog/stormcap.py`. The waits are
asyncio sleeps and the blocking calls run in the default executor, so the watchdog keeps
ticking while a group is being dumped and killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from dataclasses import dataclass

import psutil

from sidecar.config import RemediationSettings
from sidecar.host import procs
from sidecar.host.signals import Refused, Target, descendants_of, send, send_member
from sidecar.incidents.store import Incident
from sidecar.ranks.model import Rank
from sidecar.watchdog.stackdumps import (
    ask_for_stacks,
    file_sizes,
    in_collective,
    py_spy_dump,
    py_spy_path,
    stack_head,
    stop_again_after_dump,
    wait_until_written,
)
from sidecar.watchdog.unkillable import Unkillable

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05
# A dump file that held still this long is complete: faulthandler writes it from one handler call.
# Sooner, at one poll of DUMP_POLL_SECONDS, when no thread of the ranks asked runs (`procs.at_rest`):
# a rank blocked in a collective or stopped goes back to sleep as soon as its handler returns.
DUMP_STILL_SECONDS = 0.15
DUMP_POLL_SECONDS = 0.02
# py-spy runs at most this many at a time (each is a process, and on Python 3.11 a child-watcher
# thread, started from the event loop): a stall of a thousand ranks must not start a thousand.
PY_SPY_CONCURRENCY = 4


# ---------------------------------------------------------------- remediation


@dataclass
class Termination:
    """Ranks SIGTERM reached, and the members of their process trees seen at that moment."""

    signalled: list[Target]
    members: list[tuple[Target, psutil.Process]]


class Remediator:
    def __init__(self, settings: RemediationSettings):
        self.settings = settings
        self._py_spy_slots = asyncio.Semaphore(PY_SPY_CONCURRENCY)
        self.unkillable = Unkillable()  # what outlived SIGKILL, watched until it goes

    async def collect_stacks(
        self,
        incident: Incident,
        targets: list[Target],
        signal_ranks: bool = True,
        use_py_spy: bool = True,
        continue_stopped: bool = True,
    ) -> None:
        """Ask each rank for its Python stacks, run py-spy alongside, and keep what each dump
        file gained. A stopped rank that py-spy may read (verified, py-spy on) is read by py-spy
        alone, still stopped. Any other stopped rank gets the dump signal and SIGCONT, and SIGSTOP again as
        soon as its dump file has grown and held still (at most STOPPED_RUN_MAX_SECONDS): a stopped
        process runs no signal handler, and sending SIGSTOP at once would stop it again before
        the handler's first instruction, while continuing it for the whole dump wait would let
        it train on, or even finish, before the SIGTERM. Without `signal_ranks` only py-spy's
        non-blocking mode runs: it never stops the process. py-spy runs only for ranks a
        verified caller registered (it reads, and in blocking mode pauses, the process with
        root's authority), PY_SPY_CONCURRENCY at a time, within one shared deadline. Without
        `use_py_spy` (a probe while a rank is only suspect) py-spy is not run. Without
        `continue_stopped` (a probe) a stopped rank is left stopped and undumped: it runs nothing,
        so it waits for no peer; continued, it could finish its step and look healthy again."""
        s = self.settings
        loop = asyncio.get_running_loop()
        by_pid = {r.pid: r for r in incident.ranks}
        sizes = dict(zip([t.pid for t in targets], await loop.run_in_executor(None, file_sizes, targets), strict=True))
        asked = []
        stopped = set(await loop.run_in_executor(None, stopped_pids, targets))
        if not continue_stopped:
            for t in [t for t in targets if t.pid in stopped]:
                snap = by_pid.get(t.pid)
                if snap is not None:
                    snap.in_collective = False
            targets = [t for t in targets if t.pid not in stopped]
        spying = bool(s.py_spy and use_py_spy and py_spy_path())
        # A stopped rank py-spy may read is read where it stands, never continued: continued for
        # faulthandler, all its threads run again while the handler walks their frames, and a rank
        # stopped inside Python code crashed so (SIGSEGV, bench_recovery's goodput job, 1 hang in 5).
        spied_in_place = {t.pid for t in targets if t.pid in stopped and spying and t.verified}
        for t in targets:
            if t.pid in spied_in_place:
                incident.notes.append(
                    f"rank {t.rank} (pid {t.pid}) was stopped (SIGSTOP or a tracer); its stacks read by py-spy "
                    "where it stands, without continuing it"
                )
            elif t.pid in stopped:
                incident.notes.append(
                    f"rank {t.rank} (pid {t.pid}) was stopped (SIGSTOP or a tracer); "
                    "continued only to dump its stacks, then stopped again"
                )
        if signal_ranks and s.dump_stacks:
            for t in targets:
                if not (t.stack_signal and t.stack_file) or t.pid in spied_in_place:
                    continue
                try:
                    await loop.run_in_executor(None, ask_for_stacks, t, t.stack_signal, t.pid in stopped)
                    asked.append(t)
                except (Refused, OSError, psutil.Error) as e:
                    incident.notes.append(f"no stack dump from rank {t.rank}: {e}")
            continued = [t for t in asked if t.pid in stopped]
            if continued:
                results = await asyncio.gather(
                    *(stop_again_after_dump(t, sizes[t.pid]) for t in continued), return_exceptions=True
                )
                for t, result in zip(continued, results, strict=True):
                    if isinstance(result, BaseException):
                        incident.notes.append(f"rank {t.rank} (pid {t.pid}) not stopped again after its dump: {result}")
            incident.event("dumps_requested", ranks=[t.rank for t in asked])
        spy = None
        spied = [t for t in targets if t.verified]
        if spying and spied:
            timeout = max(5.0, s.dump_wait_seconds + 3.0)
            deadline = loop.time() + timeout
            spy = asyncio.gather(
                *(self._py_spy(t.pid, deadline, nonblocking=not signal_ranks or t.pid in stopped) for t in spied)
            )
        if asked:  # until every dump is written, or dump_wait_seconds
            await wait_until_written(
                [t.stack_file for t in asked],
                [sizes[t.pid] for t in asked],
                still_for=DUMP_STILL_SECONDS,
                at_most=s.dump_wait_seconds,
                poll=DUMP_POLL_SECONDS,
                writers_at_rest=functools.partial(procs.at_rest, [t.pid for t in asked]),
            )
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
            for t, text in zip(spied, await spy, strict=True):
                snap = by_pid.get(t.pid)
                if snap is not None and text:
                    snap.py_spy = text
                    if snap.in_collective is None and not text.startswith("py-spy "):
                        snap.in_collective = in_collective(text)
                        if not snap.stack_head:  # no faulthandler dump (a stopped rank read in place)
                            snap.stack_head = stack_head(text)
            incident.event("py_spy_done")

    async def _py_spy(self, pid: int, deadline: float, nonblocking: bool) -> str:
        """py-spy of one rank once a slot is free, if the shared deadline leaves time for it."""
        loop = asyncio.get_running_loop()
        async with self._py_spy_slots:
            left = deadline - loop.time()
            if left < 1.0:
                return f"py-spy not run: {PY_SPY_CONCURRENCY} at a time, no time left before the deadline"
            return await py_spy_dump(pid, left, nonblocking)

    async def sigterm(self, incident: Incident, targets: list[Target]) -> Termination | None:
        """The first half of a termination: SIGTERM each rank's group (None when no rank could
        be signalled). The caller saves the incident, then awaits `kill_survivors_after_grace`."""
        loop = asyncio.get_running_loop()
        # The tree as it is now: what a rank started is killed even if the rank dies first.
        trees = await loop.run_in_executor(None, descendants_of, [t.pid for t in targets])  # one scan for all
        members = [(t, p) for t in targets for p in trees[t.pid]]
        signalled = await self._signal_all(incident, targets, signal.SIGTERM, "sigterm")
        if not signalled:
            incident.notes.append("no rank could be signalled")
            return None
        return Termination(signalled, [(t, p) for t, p in members if t in signalled])  # never a refused rank's tree

    async def kill_survivors_after_grace(self, incident: Incident, term: Termination) -> str:
        """After SIGTERM: wait grace_seconds, then SIGKILL every rank and every member of their
        groups still alive (not only ranks: a data-loader worker that ignores SIGTERM would hold
        the GPU). "killed" when every rank and member is seen gone, whether SIGTERM did it (the
        timeline then shows no `sigkill`) or SIGKILL; else, `kill_wait_seconds` after the
        SIGKILL, "unkillable" (sidecar/watchdog/unkillable.py says why and watches them)."""
        loop = asyncio.get_running_loop()
        signalled, members = term.signalled, term.members
        left, members_left = await self._wait_exit(signalled, members, self.settings.grace_seconds)
        if left or members_left:
            await loop.run_in_executor(None, self._kill_left, incident, signalled, left, members_left)
            left, members_left = await self._wait_exit(left, members_left, self.settings.kill_wait_seconds)
        if left or members_left:
            incident.event("still_running", ranks=[t.rank for t in left], pids=[p.pid for _, p in members_left])
            outcome = await self.unkillable.record(
                incident,
                [(t.pid, f"rank {t.rank}", t.is_running) for t in left]
                + [
                    (p.pid, f"pid {p.pid} of rank {t.rank}'s group", functools.partial(_alive, p))
                    for t, p in members_left
                ],
            )
        else:
            incident.event("exit_observed", ranks=[t.rank for t in signalled])
            outcome = "killed"
        return outcome

    def _kill_left(
        self,
        incident: Incident,
        signalled: list[Target],
        left: list[Target],
        members_left: list[tuple[Target, psutil.Process]],
    ) -> None:
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

    async def _wait_exit(
        self, targets: list[Target], members: list[tuple[Target, psutil.Process]], seconds: float
    ) -> tuple[list[Target], list[tuple[Target, psutil.Process]]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while True:
            left, members = await loop.run_in_executor(None, _still_running, targets, members)
            if (not left and not members) or loop.time() >= deadline:
                return left, members
            await asyncio.sleep(POLL_SECONDS)


def target_of(rank: Rank) -> Target:
    """The signal target of a registered rank, with the identity it registered with."""
    return Target(
        rank.job_id,
        rank.rank,
        rank.pid,
        rank.pid_start_time,
        rank.stack_signal,
        rank.stack_file,
        rank.peer_verified,
        rank.pidfd,
    )


def _still_running(
    targets: list[Target], members: list[tuple[Target, psutil.Process]]
) -> tuple[list[Target], list[tuple[Target, psutil.Process]]]:
    """The ranks and members still running, in one executor call however many there are."""
    return [t for t in targets if t.is_running()], [(t, p) for t, p in members if _alive(p)]


def stopped_pids(targets: list[Target]) -> list[int]:
    return [t.pid for t in targets if procs.is_stopped(t.pid)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
