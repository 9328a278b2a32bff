"""Busy, not hung: evidence of life before a rank is declared stalled (`watchdog.busy_is_alive`).

A rank that stops stepping is not always hung: it may compute in Python for longer than its
timeout (an evaluation it did not declare, a slow first batch, a long host-side preparation).
Before the watchdog declares a rank past its deadline STALLED, it asks for two signs of life, and
needs both:

- CPU: its process's CPU time (utime + stime of /proc/<pid>/stat, `procs.cpu_seconds`) grew by at
  least BUSY_CPU_SHARE of one core since it turned suspect (or since the previous check);
- a moving stack: a look at its main thread's Python stack (the watchdog's stack probe: the hooks'
  faulthandler dump, py-spy's in observe-only mode) taken at the deadline, or one of the
  INTERIM_LOOKS taken between suspect and deadline while its CPU time grew, differs from the one
  taken when it turned suspect (or at the previous check). A stack that is identical, or differs
  only in the line of the same innermost function, has not moved. Two looks alone miss real work
  that spends most of its time in one function's C calls (a tokenizer loop that builds tensors):
  the looks in between sample its Python callees too, without delaying the verdict on a hang.

A hang shows at most one: a stopped process (SIGSTOP) and a rank blocked on a lock or waiting in a
collective use no CPU, and are declared at the deadline from one /proc read, as before; a busy
loop (`while True: x += 1`) uses CPU but its stack stays, and is declared once MIN_LOOKS looks
are in (on an unloaded node all before the deadline; on a loaded one the rest past it, tens of
milliseconds each). A busy rank stays SUSPECT, is logged once ("busy, not hung"),
is checked again every `watchdog.floor_seconds` against its previous check, and is declared anyway
once `watchdog.ceiling_seconds` have passed since its progress; its incident's timeline then lists
each check that found it busy. Only ranks a verified caller registered are read (their pid is
theirs, with its start time); a rank whose stack cannot be read (no dump signal, no py-spy) has no
evidence, and is declared at its deadline.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from sidecar.config import Settings
from sidecar.host import procs
from sidecar.incidents.store import Incident
from sidecar.ranks.model import Rank, RankKey
from sidecar.watchdog.coordination import Probe
from sidecar.watchdog.frames import Frames, label
from sidecar.watchdog.timeouts import Deadline

log = logging.getLogger(__name__)

BUSY_CPU_SHARE = 0.2  # of one core: the least CPU a busy rank uses between two checks
INTERIM_LOOKS = 6  # stack looks between two checks of a rank whose CPU time grows (before its deadline too)
# A still stack is trusted after as many looks as an unloaded node takes by the deadline (the interim
# ones and the check's own); on a loaded node fewer come in time and more are taken past it: with 4, one
# C-heavy preparation in 4 test runs beside the suite was all still and killed (tests/watchdog/test_busy_peer_waits.py)
MIN_LOOKS = INTERIM_LOOKS + 1
DATALOADER_FILE = re.compile(r"torch/utils/data/(dataloader|_utils/)")  # a rank waiting on its DataLoader's workers
# `activity` judges a troubled rank's work by its CPU over this window: working from this share of a core
# on. A rank that only waits uses well under 1% (its hooks' thread); a working one on a loaded node may get
# far less than its core, and under 20% in a 1-s window: a low share over a longer window tells them apart.
ACTIVITY_WINDOW_SECONDS = 2.0
ACTIVITY_SHARE = 0.05
# A tracing stop (state t) this long is a stop: py-spy holds a rank in it for the moment it reads the
# stack (make test: a spinning rank read `stopped` and judged rank_stopped); a debugger or a stopped
# tracer holds it for good.
TRACE_STOP_SECONDS = 2.0
PROBE_POLL_SECONDS = 0.05  # how soon the watchdog looks again while a second probe is on its way


def moved(before: Frames, after: Frames) -> bool:
    """Whether a main thread's stack moved between two looks: it did unless the two are the same
    frames, but for the line inside the same innermost function. No frames on either side: no
    evidence, not moved."""
    if not before or not after:
        return False
    return before[0][:2] != after[0][:2] or before[1:] != after[1:]


def describe(frames: Frames) -> str:
    """The innermost frame for a log line and an incident: `func (file:line)`, the file cut to its
    last two parts; escaped before it is cut (the rank wrote its own dump). "?" without frames."""
    return label(*frames[0]) if frames else "?"


@dataclass
class _Watch:
    """One suspect rank's evidence, from the moment it turned suspect until it progresses."""

    rank: Rank
    cpu: float  # its CPU seconds at `at`
    at: float  # watchdog clock
    before: Probe | None = None  # the stack the next look is compared with
    asked: float | None = None  # a fresh probe asked for at this clock time, not read yet
    gain: float = 0.0  # CPU seconds gained over the interval being checked
    cpu_now: float = 0.0  # its CPU seconds when the check began
    until: float | None = None  # busy: not checked again before this clock time
    declared: bool = False  # judged hung (or out of time): no more checks until it progresses
    busy: list[dict] = field(default_factory=list)  # each check that found it busy (its incident's timeline)
    seen: list[Probe] = field(default_factory=list)  # looks taken since `before` (INTERIM_LOOKS)
    next_look: float = 0.0  # watchdog clock: the next look in between, if its CPU time still grows
    checked_at: float | None = None  # the check's start (w.asked moves on with looks past the deadline)
    sample: tuple[float, float] | None = None  # (watchdog clock, CPU seconds): `activity`'s window start
    working: bool | None = None  # its CPU time grew over `activity`'s last window
    traced_since: float | None = None  # watchdog clock: in a tracing stop since (state t)


class Liveness:
    """`hold()` is asked, for each evaluation of a rank, whether a rank past its deadline is busy
    rather than hung; `want_probe(job_id)` asks the watchdog for a fresh stack probe of the job's
    ranks in `reprobe`; `cpu(pid, start_time)` reads a process's CPU seconds."""

    def __init__(
        self,
        settings: Settings,
        want_probe: Callable[[str], None],
        cpu: Callable[[int, float | None], float | None] = procs.cpu_seconds,
    ):
        self.wd = settings.watchdog
        self.want_probe, self.cpu = want_probe, cpu
        # a probe is bounded by the dump wait (the hooks' dump) or py-spy's own timeout (observe-only)
        dump_wait = settings.remediation.dump_wait_seconds
        self.probe_wait = max(5.0, dump_wait + 3.0) + 1.0
        self.reprobe: set[RankKey] = set()
        self._watch: dict[RankKey, _Watch] = {}
        self._look: tuple[float, dict[tuple[int, float | None], float | None]] = (-math.inf, {})

    def wants_probe(self, key: RankKey) -> bool:
        return key in self.reprobe

    def forget(self, key: RankKey) -> None:
        self._watch.pop(key, None)
        self.reprobe.discard(key)

    def hold(self, rank: Rank, probe: Probe | None, d: Deadline, suspect_at: float, now: float) -> float | None:
        """None: judge the rank by its deadline alone. A clock time: it is past its deadline but
        keeps SUSPECT until then at the latest, busy, or while its second stack look is on its
        way (the watchdog evaluates it again by then)."""
        if not self.wd.busy_is_alive:
            return None
        if d.age < suspect_at:  # progressing: nothing to keep
            if self._watch and rank.key in self._watch:
                self.forget(rank.key)
            return None
        key = rank.key
        w = self._watch.get(key)
        if w is None or w.rank is not rank:
            if not rank.peer_verified or rank.pid_start_time is None:
                return None  # an unverified caller's pid may not be its own: never read
            cpu = self._cpu_at(rank, now)
            if cpu is None:
                return None
            w = self._watch[key] = _Watch(rank, cpu, now)
        if w.before is None and probe is not None:
            w.before = probe  # the probe taken when it turned suspect
        elif probe is not None and w.asked is None and w.before is not None and probe.at > w.before.at:
            if all(probe is not p for p in w.seen):  # a look in between (a check's own are taken by _compare)
                w.seen = [*w.seen[-(INTERIM_LOOKS - 1) :], probe]
        if w.declared:
            return None
        if d.age < d.timeout:
            self._look_between(w, now, w.at + (d.timeout - suspect_at))
            return None
        if d.age >= self.wd.ceiling_seconds:
            ceiling = self.wd.ceiling_seconds
            return self._declare(w, f"watchdog.ceiling_seconds ({ceiling:g}s) passed since its progress", quiet=True)
        if w.until is not None and now < w.until:
            self._look_between(w, now, w.until)
            return w.until
        if w.asked is None:
            return self._check(w, now)
        if probe is not None and probe.at >= w.asked and probe is not w.before and all(probe is not p for p in w.seen):
            return self._compare(w, probe, d, now)
        if now - w.asked < self.probe_wait:
            self.want_probe(w.rank.job_id)  # again, if a probe came back without its dump (one runs at a time)
            return now + PROBE_POLL_SECONDS
        return self._declare(w, f"no second look at its stack within {self.probe_wait:g}s")

    def _look_between(self, w: _Watch, now: float, check_at: float) -> None:
        """While its CPU time grows, ask for INTERIM_LOOKS looks at its stack, evenly spread up to
        the next check (a stopped or waiting rank, without CPU, costs no look)."""
        if w.before is None or not w.before.frames or now < w.next_look or w.asked is not None:
            return
        if len(w.seen) >= INTERIM_LOOKS:
            return
        span = max(0.0, check_at - w.at)
        w.next_look = now + span / (INTERIM_LOOKS + 1)
        cpu = self._cpu_at(w.rank, now)
        elapsed = now - w.at
        if cpu is None or elapsed <= 0 or (cpu - w.cpu) < BUSY_CPU_SHARE * elapsed:
            return
        self.reprobe.add(w.rank.key)
        self.want_probe(w.rank.job_id)

    def _cpu_at(self, rank: Rank, now: float) -> float | None:
        """A process's CPU seconds at this look (`now`, the watchdog clock): /proc is read once per
        look, however many ask (the rank's evaluation, its job's episode, the job view's report)."""
        at, read = self._look
        if at != now:
            read = {}
            self._look = (now, read)
        process = (rank.pid, rank.pid_start_time)
        if process not in read:
            read[process] = self.cpu(rank.pid, rank.pid_start_time)
        return read[process]

    def found_busy(self, key: RankKey) -> bool:
        """Whether a check found the rank busy, not hung (its stack moved), rather than it being judged still."""
        w = self._watch.get(key)
        return w is not None and not w.declared and bool(w.busy)

    def alive(self, key: RankKey, now: float) -> bool:
        """Whether a suspect rank shows life the watchdog has not finished judging: found busy at
        its last check, being checked, or its CPU time growing since it turned suspect. A stall of
        its job is not acted on meanwhile (its peers may only be waiting for it)."""
        w = self._watch.get(key)
        if w is None or w.declared or not self.wd.busy_is_alive:
            return False
        if w.busy or w.asked is not None:
            return True
        cpu = self._cpu_at(w.rank, now)
        elapsed = now - w.at
        return cpu is not None and elapsed > 0 and (cpu - w.cpu) >= BUSY_CPU_SHARE * elapsed

    def activity(self, rank: Rank, now: float, frames: Frames = ()) -> str | None:
        """What the rank's process does while it is troubled, for the job's judgement (one of
        hang_kinds.CONDITIONS): "stopped" (state T, t for TRACE_STOP_SECONDS, or a frozen cgroup), "io" (state D),
        "dataloader" (asleep with a DataLoader frame in its stack: it waits on its workers), "cpu" (its
        CPU time grew by ACTIVITY_SHARE of a core over the last ACTIVITY_WINDOW_SECONDS, or it is running
        or runnable now), "idle" (no CPU: a
        lock, a sleep, a wait); None when it is not watched, not a verified caller's, or too soon to tell."""
        if not rank.peer_verified or rank.pid_start_time is None:
            return None
        letter = procs.state(rank.pid, rank.pid_start_time)
        if letter in ("T", "F"):
            return "stopped"
        if letter == "D":
            return "io"
        if letter == "S" and any(DATALOADER_FILE.search(f[0]) for f in frames):
            # asleep on its DataLoader's queue: it waits on its workers; a worker at work is a data wait, not a hang
            return "cpu" if psutil.STATUS_RUNNING in procs.child_states(rank.pid) else "dataloader"
        w = self._watch.get(rank.key)
        if w is None or w.rank is not rank or letter is None:
            return None
        if letter != "t":
            w.traced_since = None
        elif w.traced_since is None or now - w.traced_since < TRACE_STOP_SECONDS:
            w.traced_since = now if w.traced_since is None else w.traced_since
            return None  # a stack being read, or a tracer: too soon to tell
        else:
            return "stopped"
        if w.sample is None:
            w.sample = (w.at, w.cpu)
        at, before = w.sample
        if now - at >= ACTIVITY_WINDOW_SECONDS:  # its CPU over the last window: a pause may end, a hang may start
            cpu = self._cpu_at(rank, now)
            if cpu is None:
                return None
            w.working, w.sample = cpu - before >= ACTIVITY_SHARE * (now - at), (now, cpu)
        if letter == "R":  # running or runnable now: working, however little CPU a loaded node gives it
            return "cpu"
        if w.working is None:
            return None
        return "cpu" if w.working else "idle"

    def _check(self, w: _Watch, now: float) -> float | None:
        """A check begins: the CPU first (a hang without CPU is declared now, without waiting for
        a stack), then a fresh stack is asked for."""
        r = w.rank
        cpu = self._cpu_at(r, now)
        elapsed = now - w.at
        gain = (cpu - w.cpu) if cpu is not None else 0.0
        if cpu is None or elapsed <= 0 or gain < BUSY_CPU_SHARE * elapsed:
            return self._declare(w, f"cpu +{max(0.0, gain):.2f}s in {max(0.0, elapsed):.1f}s", quiet=True)
        if w.before is None or not w.before.frames:
            return self._declare(w, "its stack could not be read (no dump signal or py-spy)")
        w.gain, w.cpu_now, w.asked = gain, cpu, now
        self.reprobe.add(r.key)
        self.want_probe(r.job_id)
        return now + PROBE_POLL_SECONDS

    def _compare(self, w: _Watch, probe: Probe, d: Deadline, now: float) -> float | None:
        r, before = w.rank, w.before
        if w.checked_at is None:
            w.checked_at = w.asked
        interval = (w.checked_at or now) - w.at
        assert before is not None and w.asked is not None  # a probe is asked for only with a stack to compare
        self.reprobe.discard(r.key)
        shown = next((p for p in (*w.seen, probe) if moved(before.frames, p.frames)), None)
        if shown is None and len(w.seen) + 1 < MIN_LOOKS:  # too few looks to trust a still stack (a loaded node)
            w.seen.append(probe)
            w.asked = now
            self.reprobe.add(r.key)
            self.want_probe(r.job_id)
            return now + PROBE_POLL_SECONDS
        if shown is None:
            looks = f"{len(w.seen) + 1} looks" if w.seen else "one look"
            return self._declare(
                w, f"cpu +{w.gain:.2f}s in {interval:.1f}s but its stack did not move in {looks} "
                f"({describe(probe.frames)})",
            )  # fmt: skip
        ceiling_in = self.wd.ceiling_seconds - d.age
        w.until = now + min(self.wd.floor_seconds, ceiling_in)
        w.busy.append(
            {"at": time.time(), "cpu_seconds": round(w.gain, 3), "interval_seconds": round(interval, 3),
             "stack_was": describe(before.frames), "stack_is": describe(shown.frames)}
        )  # fmt: skip
        (log.warning if len(w.busy) == 1 else log.debug)(
            "rank %s (pid %d): busy, not hung: cpu +%.1fs in %.1fs, stack moved (%s -> %s); %.1fs without progress "
            "(timeout %.1fs, %s): checked again in %.1fs, stalled anyway at watchdog.ceiling_seconds (%gs)",
            r.label, r.pid, w.gain, interval, describe(before.frames), describe(shown.frames), d.age, d.timeout,
            d.basis, w.until - now, self.wd.ceiling_seconds,
        )  # fmt: skip
        checked = w.checked_at if w.checked_at is not None else now
        w.before, w.cpu, w.at, w.asked, w.seen, w.next_look, w.checked_at = (
            probe,
            w.cpu_now,
            checked,
            None,
            [],
            0.0,
            None,
        )
        return w.until

    def _declare(self, w: _Watch, why: str, quiet: bool = False) -> float | None:
        """No evidence of life (or no more time for it): the rank is judged by its deadline."""
        w.declared, w.asked = True, None
        self.reprobe.discard(w.rank.key)
        if w.busy or w.seen or not quiet:  # quiet: a plain hang, unless its CPU time had grown (looks taken)
            log.info("rank %s (pid %d): not busy enough to spare: %s", w.rank.label, w.rank.pid, why)
        if w.busy:
            w.busy[-1]["stalled_because"] = why
        return None

    def annotate(self, incident: Incident, ranks: list[Rank], note: bool = True) -> None:
        """A stall's incident: the checks that found its ranks busy, each once (a job's hold records
        them as they come, `note=False`: a rank found busy only after the stall opened is in it too),
        and with `note` a note per rank that has any."""
        for r in ranks:
            w = self._watch.get(r.key)
            if w is None or w.rank is not r or not w.busy:
                continue
            for check in w.busy:
                if not check.get("noted"):
                    check["noted"] = True
                    incident.event("busy_not_hung", at=check["at"], rank=r.rank,
                                   **{k: v for k, v in check.items() if k not in ("at", "noted")})  # fmt: skip
            if not note:
                continue
            total = sum(c["cpu_seconds"] for c in w.busy)
            incident.notes.append(
                f"rank {r.rank} was busy, not hung, at {len(w.busy)} check(s) (cpu +{total:.1f}s, its stack moving); "
                f"declared when {w.busy[-1].get('stalled_because', 'its evidence ran out')}"
            )
