"""The rank model: what the sidecar knows about one registered rank process (`Rank`, keyed by
`RankKey`), and what each pushed item does to it. The registry (registry.py) holds the table
of ranks; the watchdog, the exit tracker and the exporters read these records."""

from __future__ import annotations

import collections
import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from sidecar.host.identity import PidFd
from sidecar.host.stackfiles import StackFile
from sidecar.ranks.collectives import Collectives
from sidecar.ranks.protocol import EventItem, Launcher, PhaseItem, StepItem
from sidecar.ranks.stepcounters import StepCounters
from trainer_hooks.wire import MAX_FIELD_CHARS, MAX_NAME, WELL_KNOWN_METRICS

RankKey = tuple[str, int]

# Events are kept as text, not as the parsed objects they arrived as (a 1 MiB body of `{},{},...`
# parses into ~25 MiB of Python objects): each field clipped to MAX_FIELD_CHARS of JSON, at most
# EVENTS_MAX (the newest) and EVENT_BYTES_PER_RANK of them per rank.
EVENTS_MAX = 32
OWN_EXIT_SLACK_SECONDS = 30.0  # how much earlier than its sidecar heard of it a rank may say it died
EVENT_BYTES_PER_RANK = 32 * 1024

# The well-known metric and phase names are the wire contract's (trainer_hooks/wire.py): any
# other key in a step's metrics is a custom metric, any other phase name counts against limits.


@dataclass
class Rank:
    """What the sidecar knows about one registered rank process."""

    job_id: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    pid: int  # in the sidecar's pid namespace (the host's): what is signalled, watched and shown
    pid_start_time: float | None  # seconds from boot (procs.start_time): with the pid, the process's identity
    restart_count: int = 0
    registered_at: float = field(default_factory=time.monotonic)
    registered_wall: float = field(default_factory=time.time)
    peer_verified: bool = False  # registered over the Unix socket by pid or one of its ancestors
    stack_signal: int | None = None  # the signal the hooks' faulthandler dumps stacks on
    stack_file: StackFile | None = None  # the dump file the sidecar created for it (stackfiles.py)
    versions: dict[str, str] = field(default_factory=dict)
    hooks_version: str | None = None
    kubernetes: dict[str, str] = field(default_factory=dict)  # its pod's namespace, pod, container labels
    launcher: Launcher | None = None  # what restarts it once killed, as it said (None: hooks that do not say)
    # Whether its process group comes back after a torchrun restart, as it said (wire.RESTART_SAFE);
    # None: no torchrun, or hooks that do not say.
    restart_safe: bool | None = None
    # Its job asked that its stalls be observed, never killed (wire.OBSERVE_ONLY), and the sidecar
    # honours it (watchdog.allow_job_observe_only).
    observe_only: bool = False
    claimed_pid: int | None = None  # the pid the rank calls itself (its own pid namespace's); None: `pid`
    owner_uid: int | None = None  # the uid its process runs as (None: unknown, an unverified TCP caller)
    slurm_job_id: str | None = None  # the Slurm job whose cgroup holds its process (host/cgroups.slurm_job_of)
    slurm_user: str | None = None  # the name of owner_uid, for a Slurm job's rank (ranks/slurmjob.py)
    slurm: dict[str, str] | None = None  # its Slurm account and partition, as it says (None: it names no Slurm job)
    pidfd: PidFd | None = field(default=None, repr=False)  # of the process, where the kernel has pidfds
    # Returned at registration; pushes and deregistrations over TCP must carry it (the Unix
    # socket checks the caller's pid instead), so another local user cannot forge progress.
    session: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    step: int | None = None  # the last step reported
    step_wall: float | None = None  # the rank's wall clock at that step
    first_step_wall: float | None = None  # the rank's wall clock at its first step since registering
    last_progress: float = 0.0  # monotonic time the step last advanced (or registration)
    last_progress_wall: float = 0.0  # the same instant on the wall clock
    contact_at: float | None = None  # monotonic, the last push accepted from it (hooks that promise pushes)
    pushes_promised: bool = False  # its hooks (protocol 6+) push regularly and send a pause's end at once
    # Seconds between consecutive step reports, per step: the watchdog's adaptive timeout
    # follows these. An interval that overlapped a declared phase is not recorded.
    step_times: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))
    phase: str | None = None  # the innermost declared phase now running
    phase_started: float | None = None  # monotonic
    phase_timeout: float | None = None  # the budget the rank declared for it, if any
    metrics: dict[str, float] = field(default_factory=dict)  # latest well-known values (may be NaN)
    custom: dict[str, float] = field(default_factory=dict)  # latest custom values
    last_checkpoint_step: int | None = None
    last_checkpoint_time: float | None = None  # wall clock
    # For the rollback hint of an exit incident: recent checkpoint_saved events as (step, path,
    # time) (the path is the rank's text, shown, never opened) and the first step whose loss was
    # not finite, as (step, time); times are the rank's wall clock.
    checkpoints: collections.deque = field(default_factory=lambda: collections.deque(maxlen=16))
    first_nonfinite_loss: tuple[int, float] | None = None
    dropped: int = 0  # the hooks' running count of records they had to drop
    nonfinite: collections.Counter = field(default_factory=collections.Counter)  # by metric key
    counters: StepCounters = field(default_factory=StepCounters)  # steps/samples/tokens, step-time histogram
    records: int = 0  # items accepted since registration
    # Its collective record (the Flight Recorder's summary, sidecar/ranks/collectives.py), when the
    # sidecar received it (monotonic), and its whole dump as JSON when an incident asked for one.
    collectives: Collectives | None = None
    collectives_at: float | None = None
    fr_dump: bytes | None = field(default=None, repr=False)
    fr_dump_at: float | None = None  # monotonic
    fr_dump_asked: bool = False  # a dump was asked for (a suspect rank of its job) and not yet received
    # What the next push answer asks of its hooks (trainer_hooks.wire.WANTS), once.
    wants: set[str] = field(default_factory=set)
    # Recent events as (time, name, fields as compact JSON text), newest last (`compact_fields`).
    events: collections.deque = field(default_factory=lambda: collections.deque(maxlen=EVENTS_MAX))
    events_bytes: int = 0
    gone: bool = False
    gone_reason: str | None = None
    gone_at: float | None = None  # monotonic
    exit_time: float | None = None  # wall: when its hooks reported the exception it died of (its own clock)
    exit_kind: str | None = None  # that exception's kind (sidecar/exits/reasons.py exception_kind)
    exit_reason: str | None = None  # why its process exited, once decided (sidecar/exits/tracker.py)
    # Declared phases as a stack of (name, started, timeout): phases may nest (eval inside
    # a checkpoint-load retry, compile inside eval).
    _phases: list[tuple[str, float, float | None]] = field(default_factory=list, repr=False)
    _phase_since_step: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not self.last_progress:
            self.last_progress = self.registered_at
        if not self.last_progress_wall:
            self.last_progress_wall = self.registered_wall

    def exited_wall(self) -> float:
        """When it died, on its node's wall clock: the time its hooks stamped on the exception (the
        order of a job's exits on a loaded node: a crashing rank's deregistration can reach its
        sidecar after its peers' consequences reached theirs), else when this sidecar heard of it.
        A claim is taken within OWN_EXIT_SLACK_SECONDS before that (its own job's order only)."""
        heard = time.time() - (time.monotonic() - self.gone_at if self.gone_at is not None else 0.0)
        own = self.exit_time
        return own if own is not None and heard - OWN_EXIT_SLACK_SECONDS <= own <= heard + 1.0 else heard

    def take_collectives(self, record: Collectives | None, fr_dump: bytes | None, now: float) -> None:
        """A dump is kept only when the sidecar asked for it (an incident of its job), once."""
        if record is not None:
            self.collectives, self.collectives_at = record, now
        if fr_dump is not None and self.fr_dump_asked:
            self.fr_dump, self.fr_dump_at, self.fr_dump_asked = fr_dump, now, False

    def drop_fr_dump(self) -> None:
        self.fr_dump = self.fr_dump_at = None
        self.fr_dump_asked = False

    def collectives_age(self, now: float) -> float | None:
        """Seconds since its record arrived (None: it never sent one)."""
        return None if self.collectives_at is None else max(0.0, now - self.collectives_at)

    @property
    def stack_path(self) -> str | None:
        return self.stack_file.path if self.stack_file is not None else None

    @property
    def key(self) -> RankKey:
        return (self.job_id, self.rank)

    @property
    def label(self) -> str:
        return f"{self.job_id}/{self.rank}"

    @property
    def wire_pid(self) -> int:
        return self.pid if self.claimed_pid is None else self.claimed_pid

    # ------------------------------------------------------------ applying items

    def _monotonic_of(self, wall: float, now_mono: float, now_wall: float) -> float:
        """The monotonic instant of a rank's wall-clock time (items arrive batched, up to a
        flush interval late), clamped between registration and now."""
        return min(now_mono, max(self.registered_at, now_mono - (now_wall - wall)))

    def apply_step(self, item: StepItem, now_mono: float, now_wall: float) -> None:
        """One step report, whose step is above the last (Registry.apply_push checked the batch)."""
        interval = None
        if self.step is not None and self.step_wall is not None:
            elapsed = item.time - self.step_wall
            if elapsed >= 0:
                interval = elapsed / (item.step - self.step)
        advanced = 1 if self.step is None else item.step - self.step
        in_phase = self._phase_since_step or bool(self._phases)
        if interval is not None and not in_phase:
            self.step_times.append(interval)
        self._phase_since_step = False
        self.step = item.step
        if self.first_step_wall is None:
            self.first_step_wall = item.time
        self.step_wall = item.time
        self.last_progress = max(self.last_progress, self._monotonic_of(item.time, now_mono, now_wall))
        self.last_progress_wall = item.time
        step_time = None
        for name, value in item.metrics.items():
            if not math.isfinite(value):
                self.nonfinite[name] += 1
                if name == "loss" and self.first_nonfinite_loss is None:
                    self.first_nonfinite_loss = (item.step, item.time)
            if name in WELL_KNOWN_METRICS:
                self.metrics[name] = value
            else:
                self.custom[name] = value
        if "step_time_seconds" in item.metrics:
            step_time = item.metrics["step_time_seconds"]
        elif interval is not None:
            step_time = interval
            self.metrics["step_time_seconds"] = interval
        self._derive_rates(item.metrics, step_time)
        self.counters.observe(advanced, item.metrics, step_time)

    def _derive_rates(self, sent: dict[str, float], step_time: float | None) -> None:
        if step_time is None or not math.isfinite(step_time) or step_time <= 0:
            return
        for rate, per_step in (
            ("iterations_per_second", None),
            ("samples_per_second", "samples"),
            ("tokens_per_second", "tokens"),
        ):
            if rate in sent:
                continue
            if per_step is None:
                self.metrics[rate] = 1.0 / step_time
            elif per_step in sent:
                self.metrics[rate] = sent[per_step] / step_time

    def apply_phase(self, item: PhaseItem, now_mono: float, now_wall: float) -> None:
        at = self._monotonic_of(item.time, now_mono, now_wall)
        if item.action == "start":
            repeat = bool(self._phases) and self._phases[-1][0] == item.name and abs(self._phases[-1][1] - at) < 0.01
            if not repeat:  # the same start again: a batch sent again (trainer_hooks/sender.py)
                self._phases.append((item.name, at, item.timeout_seconds))
            self._phase_since_step = True
        else:
            # End the innermost phase of that name (and anything opened inside it and never
            # closed); an end without a start is ignored, it may follow a sidecar restart.
            for i in range(len(self._phases) - 1, -1, -1):
                if self._phases[i][0] == item.name:
                    del self._phases[i:]
                    break
            # The end of a phase is progress: the rank is back and the step timer restarts.
            self.last_progress = max(self.last_progress, at)
        if self._phases:
            self.phase, self.phase_started, self.phase_timeout = self._phases[-1]
        else:
            self.phase, self.phase_started, self.phase_timeout = None, None, None

    def apply_event(self, item: EventItem) -> None:
        text = compact_fields(item.fields)
        if len(self.events) == self.events.maxlen:
            self.events_bytes -= len(self.events[0][2])
        self.events.append((item.time, item.name, text))
        self.events_bytes += len(text)
        while self.events_bytes > EVENT_BYTES_PER_RANK and len(self.events) > 1:
            self.events_bytes -= len(self.events.popleft()[2])
        if item.name == "checkpoint_saved":
            step = item.fields.get("step")
            if type(step) is int and 0 <= step < 1 << 63:
                self.last_checkpoint_step = step
                path = item.fields.get("path")
                saved = (step, path[:4096] if isinstance(path, str) else None, item.time)
                if saved not in self.checkpoints:  # a batch sent again (trainer_hooks/sender.py) repeats it
                    self.checkpoints.append(saved)
            self.last_checkpoint_time = item.time

    def last_event(self, name: str) -> dict[str, Any] | None:
        """The fields of the newest kept event called `name` (each clipped as `compact_fields`
        says), or None."""
        for _, event_name, text in reversed(self.events):
            if event_name == name:
                fields = json.loads(text)
                return fields if isinstance(fields, dict) else None
        return None


def compact_fields(fields: dict[str, Any]) -> str:
    """An event's fields as compact JSON text: names clipped to MAX_NAME characters, text values
    to MAX_FIELD_CHARS, and any other value larger than that replaced by its JSON text, clipped."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, str):
            value = value[:MAX_FIELD_CHARS]
        elif not (value is None or isinstance(value, (bool, int, float))) or len(repr(value)) > MAX_FIELD_CHARS:
            value = json.dumps(value)[:MAX_FIELD_CHARS]
        out[str(key)[:MAX_NAME]] = value
    return json.dumps(out, allow_nan=True)
