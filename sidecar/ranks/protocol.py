"""The hooks' wire protocol (docs/architecture.md): strict JSON bodies validated into typed
records, against the contract both sides import (trainer_hooks/wire.py: names, patterns,
limits, the protocol version). Every refusal is a `ProtocolError` whose message names the
field and what is wrong with it; the API turns it into a 4xx JSON answer.

Validation is hand-written rather than schema-driven because it sits on the ingest hot
path (tens of thousands of step records per second on one core).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from sidecar.ranks import podlabels, slurmjob
from trainer_hooks.wire import (
    EXIT_MAX_FRAMES,
    EXIT_MAX_TEXT,
    EXIT_MAX_TYPES,
    LAUNCHERS,
    MAX_COUNT,
    MAX_EVENT_FIELDS,
    MAX_NAME,
    MAX_PID,
    MAX_RANK,
    MAX_SESSION_CHARS,
    MAX_TIME,
    MAX_TIMEOUT_SECONDS,
    MAX_VERSIONS,
    NAME_RE,
    NONFINITE_VALUES,
    OBSERVE_ONLY,
    PHASE_ACTIONS,
    RESERVED_JOB_IDS,
    RESTART_SAFE,
    STACK_SIGNAL_RANGE,
)

NONFINITE = {text: float(text) for text in NONFINITE_VALUES}
CONTROL_RE = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")  # controls, and lone surrogates (unprintable)


class ProtocolError(ValueError):
    """A request body the protocol refuses. `code` is the machine code of the error body."""

    def __init__(self, message: str, code: str = "bad_field", status: int = 400):
        super().__init__(message)
        self.code = code
        self.status = status


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
class StepItem:
    step: int
    time: float
    metrics: dict[str, float]


@dataclass(slots=True)
class PhaseItem:
    name: str
    action: str  # "start" | "end"
    time: float
    timeout_seconds: float | None = None


@dataclass(slots=True)
class EventItem:
    name: str
    time: float
    fields: dict[str, Any]


Item = StepItem | PhaseItem | EventItem


@dataclass(slots=True)
class Push:
    job_id: str
    rank: int
    pid: int
    dropped: int
    items: list[Item]
    session: str | None = None


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


def _refuse_constant(token: str) -> Any:
    raise ProtocolError(
        f"body is not strict JSON: bare {token} is not allowed "
        f'(send a non-finite metric value as the string "nan", "inf" or "-inf")',
        code="bad_json",
    )


def decode(body: bytes) -> dict:
    """Parse a strict-JSON object body."""
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except ProtocolError:
        raise
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise ProtocolError(f"body is not valid JSON: {e}", code="bad_json") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"body must be a JSON object, got {_kind(data)}", code="bad_json")
    return data


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    kinds: dict[type, str] = {dict: "an object", list: "an array"}
    return kinds.get(type(value), type(value).__name__)


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


def _time(obj: dict, where: str, default: float) -> float:
    value = obj.get("time")
    if value is None:
        return default
    if type(value) not in (int, float) or not 0 <= value < MAX_TIME:
        raise ProtocolError(f"{where}: expected Unix seconds (a finite number >= 0), got {_kind(value)}")
    return float(value)


def _text(obj: dict, key: str, where: str, default: Any = ..., nullable: bool = False, max_len: int = MAX_NAME) -> Any:
    given, value = _given(obj, key, where, default, nullable)
    if not given:
        return value
    if not isinstance(value, str):
        raise ProtocolError(f"{where}: expected a string, got {_kind(value)}")
    if not value or len(value) > max_len or CONTROL_RE.search(value):
        raise ProtocolError(f"{where}: expected 1 to {max_len} printable characters, got {value[:40]!r}")
    return value


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


def _metric_value(value: Any, where: str) -> float:
    t = type(value)
    if t is float:
        return value
    if t is int and -1e308 < value < 1e308:  # beyond, float() overflows
        return float(value)
    if t is str:
        v = NONFINITE.get(value.lower())
        if v is not None:
            return v
    raise ProtocolError(f'{where}: expected a number or "nan"/"inf"/"-inf", got {_kind(value)}')


_CHECKED_NAMES: set[str] = set()  # metric names already matched against NAME_RE (hot path)
_CHECKED_NAMES_MAX = 4096


def _metrics(obj: dict, where: str) -> dict[str, float]:
    raw = obj.get("metrics")
    if raw is None:
        return {}
    if type(raw) is not dict:
        raise ProtocolError(f"{where}.metrics: expected an object, got {_kind(raw)}")
    out = {}
    for k, v in raw.items():
        if k not in _CHECKED_NAMES:
            if not NAME_RE.match(k):
                raise ProtocolError(
                    f"{where}.metrics: metric name {k[:40]!r} is not a name of letters, "
                    f"digits and _.:/- (at most {MAX_NAME}, starting with a letter or _)"
                )
            if len(_CHECKED_NAMES) < _CHECKED_NAMES_MAX:
                _CHECKED_NAMES.add(k)
        out[k] = v if type(v) is float else _metric_value(v, f"{where}.metrics.{k}")
    return out


def _job_id(data: dict) -> str:
    """A job_id names the job's directory under the diag dir (sidecar/host/diagfiles.py): it may not
    be one of the sidecar's own directories, nor a dot name."""
    job_id = _text(data, "job_id", "job_id")
    if job_id.startswith(".") or job_id.lower() in RESERVED_JOB_IDS:
        raise ProtocolError(
            f"job_id: {job_id[:40]!r} is reserved (it may not start with '.' nor be "
            f"{', '.join(sorted(RESERVED_JOB_IDS))})"
        )
    return job_id


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


def parse_push(data: dict, max_items: int) -> Push:
    job_id, rank, pid = _identity(data)
    dropped = _int(data, "dropped", "dropped", 0, MAX_COUNT, default=0, nullable=True) or 0
    raw = data.get("items")
    if type(raw) is not list:
        raise ProtocolError(f"items: expected an array, got {_kind(raw) if 'items' in data else 'nothing'}")
    if len(raw) > max_items:
        raise ProtocolError(
            f"items: at most {max_items} per push (limits.max_items_per_push), got {len(raw)}",
            code="too_large",
            status=413,
        )
    now = time.time()
    items: list[Item] = []
    append = items.append
    for i, obj in enumerate(raw):
        where = f"items[{i}]"
        if type(obj) is not dict:
            raise ProtocolError(f"{where}: expected an object, got {_kind(obj)}")
        kind = obj.get("type")
        if kind == "step":
            # Inline fast path for the common, well-formed step record.
            step = obj.get("step")
            if type(step) is not int or not 0 <= step <= MAX_COUNT:
                step = _int(obj, "step", f"{where}.step", 0, MAX_COUNT)
            t = obj.get("time")
            if type(t) is not float or not 0 <= t < MAX_TIME:
                t = _time(obj, f"{where}.time", now)
            append(StepItem(step, t, _metrics(obj, where)))
        elif kind == "phase":
            action = obj.get("action")
            if action not in PHASE_ACTIONS:
                raise ProtocolError(f'{where}.action: expected "start" or "end", got {_kind(action)}')
            append(
                PhaseItem(
                    _name(obj, "name", f"{where}.name"),
                    action,
                    _time(obj, f"{where}.time", now),
                    _timeout(obj, "timeout_seconds", f"{where}.timeout_seconds"),
                )
            )
        elif kind == "event":
            fields = _object(obj, "fields", f"{where}.fields")
            if len(fields) > MAX_EVENT_FIELDS:
                raise ProtocolError(f"{where}.fields: at most {MAX_EVENT_FIELDS} fields, got {len(fields)}")
            append(EventItem(_name(obj, "name", f"{where}.name"), _time(obj, f"{where}.time", now), fields))
        else:
            raise ProtocolError(f'{where}.type: expected "step", "phase" or "event", got {_kind(kind)}')
    return Push(job_id, rank, pid, dropped, items, _session(data))


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
