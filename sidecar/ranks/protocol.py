"""The hooks' wire protocol (docs/architecture/wire-protocol.md): strict JSON bodies validated into typed
records, against the contract both sides import (trainer_hooks/wire.py: names, patterns,
limits, the protocol version). Every refusal is a `ProtocolError` whose message names the
field and what is wrong with it; the API turns it into a 4xx JSON answer.

A push (the batch of records, the ingest hot path) is decoded by a typed decoder in push.py;
its record types are re-exported here. Registrations and deregistrations (once per rank and
restart) and the peers' reports that reuse these helpers (sidecar/jobview/report.py) are
checked by hand below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sidecar.ranks import podlabels, slurmjob
from sidecar.ranks.push import EventItem, Item, PhaseItem, Push, StepItem, decode_push, parse_push
from sidecar.ranks.refusal import (
    CONTROL_RE,
    ProtocolError,
    printable_text,
    strict_json_object,
    unreserved_job_id,
)
from sidecar.ranks.refusal import kind_of as _kind
from trainer_hooks.wire import (
    EXIT_MAX_FRAMES,
    EXIT_MAX_TEXT,
    EXIT_MAX_TYPES,
    LAUNCHERS,
    MAX_COUNT,
    MAX_NAME,
    MAX_PID,
    MAX_RANK,
    MAX_SESSION_CHARS,
    MAX_TIME,
    MAX_TIMEOUT_SECONDS,
    MAX_VERSIONS,
    NAME_RE,
    OBSERVE_ONLY,
    RESTART_SAFE,
    STACK_SIGNAL_RANGE,
)

# Re-exported: the wire's users import every record and refusal from here, the push's records and
# decoder (push.py) and what every parser shares (refusal.py) too. (Not a list of this module's own.)
__all__ = [
    "CONTROL_RE",
    "EventItem",
    "Item",
    "PhaseItem",
    "ProtocolError",
    "Push",
    "StepItem",
    "decode_push",
    "parse_push",
]


@dataclass(frozen=True, slots=True)
class Launcher:
    """What restarts the rank's worker group once it is killed, as the rank says (wire.LAUNCHERS)."""

    name: str  # "torchrun" | "none"
    max_restarts: int | None = None  # torchrun's --max-restarts; None: not said


@dataclass(slots=True)
class Registration:
    job_id: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    pid: int
    restart_count: int = 0
    step: int | None = None
    phase: str | None = None
    phase_timeout_seconds: float | None = None  # the budget the rank declared for `phase`
    versions: dict[str, str] = field(default_factory=dict)
    stack_signal: int | None = None  # the signal the hooks' faulthandler dumps stacks on
    hooks_version: str | None = None
    kubernetes: dict[str, str] = field(default_factory=dict)  # namespace, pod, container (sidecar/ranks/podlabels.py)
    launcher: Launcher | None = None  # None: not said (hooks of protocol 1)
    restart_safe: bool | None = None  # None: not said (no torchrun, or hooks of protocol 1 and 2)
    observe_only: bool = False  # the job asks that its stalls be observed, never killed (wire.OBSERVE_ONLY)
    slurm: dict[str, str] | None = None  # account, partition of its Slurm job, as it says (protocol 9; slurmjob.py)


@dataclass(slots=True)
class ExitReport:
    """The exception a rank is dying of, as its hooks saw it (its own claim about itself)."""

    type: str  # "torch.OutOfMemoryError": module and qualified name
    types: list[str]  # the type and its bases, most derived first (without `object`)
    message: str  # the first line of str(exception)
    traceback: list[str]  # the innermost frames, "file:line in function", outermost first
    thread: str | None = None  # the thread it ended, when not the main thread
    time: float | None = None  # wall clock, the rank's own: when its hooks reported it (protocol 8)


@dataclass(slots=True)
class Deregistration:
    job_id: str
    rank: int
    pid: int
    reason: str
    session: str | None = None
    exit: ExitReport | None = None


# ---------------------------------------------------------------- decoding


decode = strict_json_object  # every request's body but a push's (push.decode_push reads its own)


def _missing(where: str) -> ProtocolError:
    return ProtocolError(f"{where}: required field is missing")


def _given(obj: dict, key: str, where: str, default: Any, nullable: bool) -> tuple[bool, Any]:
    """(True, value) when the field holds a value to check; else (False, what to return): None
    for a null where null is allowed, the default for an absent field (an error without one)."""
    value = obj.get(key, ...)
    if value is None and nullable:
        return False, None
    if value is ...:
        if default is ...:
            raise _missing(where)
        return False, default
    return True, value


def _int(
    obj: dict, key: str, where: str, lo: int = 0, hi: int | None = None, default: Any = ..., nullable: bool = False
) -> Any:
    given, value = _given(obj, key, where, default, nullable)
    if not given:
        return value
    if type(value) is not int:
        # 3.0 is a float in JSON's eyes but an integer in everyone else's.
        if type(value) is float and value.is_integer():
            value = int(value)
        else:
            raise ProtocolError(f"{where}: expected an integer, got {_kind(value)}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ProtocolError(f"{where}: must be {bound}, got {value}")
    return value


def _text(obj: dict, key: str, where: str, default: Any = ..., nullable: bool = False, max_len: int = MAX_NAME) -> Any:
    given, value = _given(obj, key, where, default, nullable)
    if not given:
        return value
    if not isinstance(value, str):
        raise ProtocolError(f"{where}: expected a string, got {_kind(value)}")
    return printable_text(value, where, max_len)


def _name(obj: dict, key: str, where: str, nullable: bool = False) -> Any:
    given, value = _given(obj, key, where, None if nullable else ..., nullable)
    if not given:
        return value
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise ProtocolError(
            f"{where}: expected a name of letters, digits and _.:/- "
            f"(at most {MAX_NAME}, starting with a letter or _), got {_kind(value)}"
        )
    return value


def _timeout(obj: dict, key: str, where: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if type(value) not in (int, float) or not 0 < value < MAX_TIMEOUT_SECONDS:
        raise ProtocolError(f"{where}: expected a number of seconds > 0, got {_kind(value)}")
    return float(value)


def _object(obj: dict, key: str, where: str) -> dict:
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: expected an object, got {_kind(value)}")
    return value


def _job_id(data: dict) -> str:
    """A job_id: printable, at most MAX_NAME, not reserved (refusal.unreserved_job_id)."""
    return unreserved_job_id(_text(data, "job_id", "job_id"))


def _identity(data: dict) -> tuple[str, int, int]:
    return (_job_id(data), _int(data, "rank", "rank", 0, MAX_RANK), _int(data, "pid", "pid", 1, MAX_PID))


# ---------------------------------------------------------------- requests


def _launcher(data: dict) -> Launcher | None:
    if data.get("launcher") is None:
        return None
    obj = _object(data, "launcher", "launcher")
    name = obj.get("name")
    if name not in LAUNCHERS:
        raise ProtocolError(f"launcher.name: expected one of {', '.join(LAUNCHERS)}, got {_kind(name)}")
    max_restarts = _int(obj, "max_restarts", "launcher.max_restarts", 0, MAX_COUNT, default=None, nullable=True)
    return Launcher(name, max_restarts if name == "torchrun" else None)


def _flag(data: dict, key: str) -> bool | None:
    """A true/false the hooks may leave out or send as null (None then)."""
    value = data.get(key)
    if value is not None and type(value) is not bool:
        raise ProtocolError(f"{key}: expected true, false or null, got {_kind(value)}")
    return value


def parse_registration(data: dict) -> Registration:
    job_id, rank, pid = _identity(data)
    world_size = _int(data, "world_size", "world_size", 1, MAX_RANK)
    if rank >= world_size:
        raise ProtocolError(f"rank: must be < world_size ({world_size}), got {rank}")
    local_world_size = _int(data, "local_world_size", "local_world_size", 1, world_size, default=1)
    local_rank = _int(data, "local_rank", "local_rank", 0, local_world_size - 1, default=0)
    versions_raw = _object(data, "versions", "versions")
    if len(versions_raw) > MAX_VERSIONS:
        raise ProtocolError(f"versions: at most {MAX_VERSIONS} entries, got {len(versions_raw)}")
    versions = {}
    for k, v in versions_raw.items():
        if v is None:
            continue
        if not NAME_RE.match(k):
            raise ProtocolError(f"versions: key {k[:40]!r} is not a name")
        versions[k] = _text(versions_raw, k, f"versions.{k}")
    stack = _object(data, "stack_dump", "stack_dump")
    try:
        kubernetes = podlabels.parse(data.get("kubernetes"))
        slurm = slurmjob.parse(data.get("slurm"))
    except (podlabels.PodLabelError, slurmjob.SlurmLabelError) as e:
        raise ProtocolError(str(e)) from None
    return Registration(
        job_id=job_id,
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        pid=pid,
        restart_count=_int(data, "restart_count", "restart_count", 0, MAX_COUNT, default=0, nullable=True) or 0,
        step=_int(data, "step", "step", 0, MAX_COUNT, nullable=True, default=None),
        phase=_name(data, "phase", "phase", nullable=True),
        phase_timeout_seconds=_timeout(data, "phase_timeout_seconds", "phase_timeout_seconds"),
        versions=versions,
        # stack_dump.path (hooks before 0.2) is ignored: the sidecar creates the dump file itself.
        stack_signal=_int(stack, "signal", "stack_dump.signal", *STACK_SIGNAL_RANGE, nullable=True, default=None),
        hooks_version=_text(data, "hooks_version", "hooks_version", nullable=True, default=None),
        kubernetes=kubernetes,
        launcher=_launcher(data),
        restart_safe=_flag(data, RESTART_SAFE),
        observe_only=bool(_flag(data, OBSERVE_ONLY)),
        slurm=slurm,
    )


def parse_deregistration(data: dict) -> Deregistration:
    job_id, rank, pid = _identity(data)
    reason = _text(data, "reason", "reason", default="finished", nullable=True) or "finished"
    return Deregistration(job_id, rank, pid, reason, _session(data), _exit_report(data))


def _clip(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{where}: expected a string, got {_kind(value)}")
    return CONTROL_RE.sub(" ", value[:EXIT_MAX_TEXT])


def _exit_report(data: dict) -> ExitReport | None:
    raw = data.get("exit")
    if raw is None:
        return None
    if type(raw) is not dict:
        raise ProtocolError(f"exit: expected an object, got {_kind(raw)}")
    lists = {}
    for key in ("types", "traceback"):
        value = raw.get(key, [])
        if type(value) is not list:
            raise ProtocolError(f"exit.{key}: expected an array, got {_kind(value)}")
        limit = EXIT_MAX_TYPES if key == "types" else EXIT_MAX_FRAMES
        lists[key] = [
            _clip(v, f"exit.{key}[{i}]") for i, v in enumerate(value[-limit:] if key == "traceback" else value[:limit])
        ]
    thread = raw.get("thread")
    return ExitReport(
        type=_clip(raw.get("type", ""), "exit.type"),
        types=lists["types"],
        message=_clip(raw.get("message", ""), "exit.message"),
        traceback=lists["traceback"],
        thread=None if thread is None else _clip(thread, "exit.thread"),
        time=_exit_time(raw.get("time")),
    )


def _exit_time(value: Any) -> float | None:
    if value is None:
        return None
    if type(value) not in (int, float) or not 0 < value < MAX_TIME:
        raise ProtocolError("exit.time: expected Unix seconds")
    return float(value)


def _session(data: dict) -> str | None:
    value = data.get("session")
    if value is not None and (type(value) is not str or len(value) > MAX_SESSION_CHARS):
        raise ProtocolError("session: expected the string the registration returned")
    return value
