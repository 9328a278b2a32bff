"""A push: the batch of records a rank's hooks send (docs/architecture/wire-protocol.md),
decoded by one typed decoder (msgspec) on the ingest hot path.

The records are `msgspec.Struct`s tagged by their `type` ("step", "phase", "event"): the decoder
checks every field's type and bounds (`Meta`) while it parses, and names the field it refuses
(`items[3].step`). What a schema cannot say is checked after it, in one pass over the records:
a job_id's control characters and reserved names, metric names (remembered once checked),
integers sent as integral floats, the per-push item limit (a setting), and an absent time (when
the sidecar read it).

A body msgspec cannot parse, or refuses where JSON would not (a lone surrogate, 1e400, UTF-16,
a metric value that is no number: "nan" as strict JSON sends it, or a bad one to be named by its
key), is parsed again by the standard library, which either refuses it as strict JSON always
was, or reads it for the same types and checks through `msgspec.convert`. A body the schema
refuses is refused as bad JSON if it is that too, as before.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

from sidecar.ranks.refusal import (
    NONFINITE,
    ProtocolError,
    kind_of,
    printable_text,
    strict_json_object,
    unreserved_job_id,
)
from trainer_hooks.wire import (
    MAX_COUNT,
    MAX_EVENT_FIELDS,
    MAX_NAME,
    MAX_PID,
    MAX_RANK,
    MAX_SESSION_CHARS,
    MAX_TIME,
    MAX_TIMEOUT_SECONDS,
    NAME_PATTERN,
    NAME_RE,
)

NAME_RULE = f"a name of letters, digits and _.:/- (at most {MAX_NAME}, starting with a letter or _)"
Name = Annotated[str, Meta(pattern="^" + NAME_PATTERN)]
Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
UnixTime = Annotated[float, Meta(ge=0, lt=MAX_TIME)]
Timeout = Annotated[float, Meta(gt=0, lt=MAX_TIMEOUT_SECONDS)]


class StepItem(msgspec.Struct, tag="step", tag_field="type"):
    if TYPE_CHECKING:  # as every reader sees it once `decode_push` has checked it
        step: int
        time: float
        metrics: dict[str, float]
    else:  # as the wire may carry it; `_finish` makes it the above
        step: Count | float  # 3.0 is an integer to everyone but JSON
        time: UnixTime | None = None  # absent or null: when the sidecar read it
        # Non-finite values travel as "nan"/"inf"/"-inf" (strict JSON): a batch with one is read
        # again by the second decoder, into _StepWithText, then made floats (_finish).
        metrics: dict[str, float] | None = {}


class PhaseItem(msgspec.Struct, tag="phase", tag_field="type"):
    name: Name
    action: Literal["start", "end"]
    if TYPE_CHECKING:
        time: float
    else:
        time: UnixTime | None = None
    timeout_seconds: Timeout | None = None


class EventItem(msgspec.Struct, tag="event", tag_field="type"):
    name: Name
    if TYPE_CHECKING:
        time: float
        fields: dict[str, Any]
    else:
        time: UnixTime | None = None
        fields: Annotated[dict[str, Any], Meta(max_length=MAX_EVENT_FIELDS)] | None = {}


Item = StepItem | PhaseItem | EventItem


@dataclass(slots=True)
class Push:
    job_id: str
    rank: int
    pid: int
    dropped: int
    items: list[Item]
    session: str | None = None
    collectives: Any = None  # the rank's collective record, as parsed JSON (sidecar/ranks/collectives.py)
    fr_dump: Any = None  # its Flight Recorder dump, as parsed JSON


class _Body(msgspec.Struct):
    """A push's body as the wire carries it. Unknown fields are ignored (a newer hooks' addition)."""

    job_id: Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
    rank: Annotated[int, Meta(ge=0, le=MAX_RANK)] | float
    pid: Annotated[int, Meta(ge=1, le=MAX_PID)] | float
    items: list[Item]
    dropped: Count | float | None = 0
    session: Annotated[str, Meta(max_length=MAX_SESSION_CHARS)] | None = None
    collectives: Any = None
    fr_dump: Any = None


class _StepWithText(msgspec.Struct, tag="step", tag_field="type"):
    """A step record whose metrics may hold text ("nan"): read by the second decoder only, and
    made a StepItem by `_finish` (a reader never sees it)."""

    step: Count | float
    time: UnixTime | None = None
    metrics: dict[str, float | str] | None = {}

    def checked(self, i: int) -> StepItem:
        metrics = self.metrics or {}
        values = {k: v if type(v) is float else _metric_value(v, f"items[{i}].metrics.{k}") for k, v in metrics.items()}
        return StepItem(self.step, self.time, values)  # type: ignore[arg-type]  # _finish checks step, time next


class _BodyWithText(_Body):
    items: list[_StepWithText | PhaseItem | EventItem]  # type: ignore[assignment]


_DECODER = msgspec.json.Decoder(_Body)
_TEXT_DECODER = msgspec.json.Decoder(_BodyWithText)


# ---------------------------------------------------------------- decoding


def decode_push(body: bytes, max_items: int) -> Push:
    """Decode and check a push's body; ProtocolError names the field it refuses."""
    if body.isascii() or _utf8(body):
        try:
            return _finish(_decode(body), max_items)
        except msgspec.ValidationError as e:
            if not _READ_AGAIN.search(str(e)):
                strict_json_object(body)  # JSON that breaks further on is refused as such, as before
                raise _refusal(e) from None
        except (msgspec.DecodeError, RecursionError):
            pass
    return parse_push(strict_json_object(body), max_items)


def _decode(body: bytes) -> _Body:
    """Most pushes hold numbers only; one with a metric sent as text ("nan") is read again by the
    decoder that takes text there."""
    try:
        return _DECODER.decode(body)
    except msgspec.ValidationError as e:
        if not _METRIC_TEXT.search(str(e)):
            raise
    return _TEXT_DECODER.decode(body)


_METRIC_TEXT = re.compile(r"got `str` - at `\$\.items\[\d+\]\.metrics\[\.\.\.\]`$")
# What the standard library reads where msgspec refuses: 1e400 (JSON's inf, which a metric or an
# event's field takes), and a metric value that is neither number nor text (to be named by its key).
_READ_AGAIN = re.compile(r"^Number out of range|\.metrics\[\.\.\.\]`$")


def _utf8(body: bytes) -> bool:
    """Whether the body is UTF-8: msgspec skips an unknown field without reading its text."""
    try:
        body.decode()
    except UnicodeDecodeError:
        return False
    return True


def parse_push(data: dict, max_items: int) -> Push:
    """Check a push already parsed into Python values, as `decode_push` checks its bytes."""
    data = _matchable(data)
    try:
        try:
            body = msgspec.convert(data, _Body)
        except UnicodeEncodeError:  # msgspec describing a value with a lone surrogate that it refuses
            msgspec.convert(_replace_surrogates(data), _Body)  # the same refusal, its excerpt readable
            raise ProtocolError("body: a lone surrogate where no text is expected") from None
        return _finish(body, max_items)
    except msgspec.ValidationError as e:
        raise _refusal(e) from None


# ---------------------------------------------------------------- what msgspec.convert cannot match

_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def _matchable(data: dict) -> dict:
    """`data` as msgspec.convert can match it against the schema: it encodes field names and record
    types as UTF-8, which a lone surrogate cannot be. Such a name is no field of the schema: it
    is dropped like any unknown field; such a record type is refused."""
    data = {k: v for k, v in data.items() if not _SURROGATE_RE.search(k)}
    items = data.get("items")
    if type(items) is list:
        data["items"] = [_matchable_record(record, i) for i, record in enumerate(items)]
    return data


def _matchable_record(record: Any, i: int) -> Any:
    if type(record) is not dict:
        return record
    kind = record.get("type")
    if type(kind) is str and _SURROGATE_RE.search(kind):
        raise ProtocolError(f'items[{i}].type: expected "step", "phase" or "event", got {kind_of(kind)}')
    record = {k: v for k, v in record.items() if not _SURROGATE_RE.search(k)}
    metrics = record.get("metrics")
    if kind == "step" and type(metrics) is dict:
        record["metrics"] = {
            k: v if type(v) is float else _metric_value(v, f"items[{i}].metrics.{k}") for k, v in metrics.items()
        }
    return record


def _replace_surrogates(value: Any) -> Any:
    """`value` with U+FFFD for each lone surrogate, keys included."""
    if type(value) is str:
        return _SURROGATE_RE.sub("\ufffd", value)
    if type(value) is list:
        return [_replace_surrogates(v) for v in value]
    if type(value) is dict:
        return {_replace_surrogates(k): _replace_surrogates(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------- after the schema


def _finish(body: _Body, max_items: int) -> Push:
    job_id = unreserved_job_id(printable_text(body.job_id, "job_id", MAX_NAME))
    rank, pid, dropped = body.rank, body.pid, body.dropped
    if type(rank) is not int:
        rank = _integral(rank, "rank", 0, MAX_RANK)
    if type(pid) is not int:
        pid = _integral(pid, "pid", 1, MAX_PID)
    if type(dropped) is not int:
        dropped = 0 if dropped is None else _integral(dropped, "dropped", 0, MAX_COUNT)
    items = body.items
    if len(items) > max_items:
        raise ProtocolError(
            f"items: at most {max_items} per push (limits.max_items_per_push), got {len(items)}",
            code="too_large",
            status=413,
        )
    now = time.time()
    for i, item in enumerate(items):
        if type(item) is _StepWithText:
            item = items[i] = item.checked(i)
        if type(item) is StepItem:
            if type(item.step) is not int:
                item.step = _integral(item.step, f"items[{i}].step", 0, MAX_COUNT)
            metrics = item.metrics
            if metrics is None:
                item.metrics = {}
            elif not metrics.keys() <= _CHECKED_NAMES:
                _check_names(metrics, i)
        elif type(item) is EventItem and item.fields is None:
            item.fields = {}
        if item.time is None:
            item.time = now
    return Push(job_id, rank, pid, dropped, items, body.session, body.collectives, body.fr_dump)


def _integral(value: float, where: str, lo: int, hi: int) -> int:
    """An integer sent as an integral float (3.0), within [lo, hi]."""
    if not value.is_integer():
        raise ProtocolError(f"{where}: expected an integer, got {kind_of(value)}")
    if not lo <= value <= hi:
        raise ProtocolError(f"{where}: must be in [{lo}, {hi}], got {value}")
    return int(value)


_CHECKED_NAMES: set[str] = set()  # metric names already matched against NAME_RE (hot path)
_CHECKED_NAMES_MAX = 4096


def _check_names(metrics: dict[str, float], i: int) -> None:
    """Metric names become label values: each matches NAME_RE (checked once, then remembered)."""
    for k in metrics:
        if k not in _CHECKED_NAMES:
            if not NAME_RE.match(k):
                raise ProtocolError(f"items[{i}].metrics: metric name {k[:40]!r} is not {NAME_RULE}")
            if len(_CHECKED_NAMES) < _CHECKED_NAMES_MAX:
                _CHECKED_NAMES.add(k)


def _metric_value(value: Any, where: str) -> float:
    """A metric value read by the standard library: a number, or "nan"/"inf"/"-inf" in any case."""
    t = type(value)
    if t is int:
        try:
            return float(value)  # as msgspec reads an integer where a float goes
        except OverflowError:
            pass
    elif t is str:
        v = NONFINITE.get(value.lower())
        if v is not None:
            return v
    raise ProtocolError(f'{where}: expected a number or "nan"/"inf"/"-inf", got {kind_of(value)}')


# ---------------------------------------------------------------- msgspec's refusals, in our words

_MISSING = re.compile(r"Object missing required field `(\w+)`")
_REGEX = re.compile(r"Expected `str` matching regex '.*'")
_INVALID = re.compile(r"Invalid (enum )?value (.*)")  # "enum": a Literal's; none: a record's `type` tag


def _refusal(e: msgspec.ValidationError) -> ProtocolError:
    """`items[3].step: expected ...` from msgspec's `Expected ... - at `$.items[3].step``."""
    message, _, at = str(e).partition(" - at `$")
    where = at.rstrip("`").lstrip(".")
    missing = _MISSING.fullmatch(message)
    if missing:
        return ProtocolError(f"{_join(where, missing[1])}: required field is missing")
    if not where:
        return ProtocolError(f"body must be a JSON object: {_lower(message)}", code="bad_json")
    message = _REGEX.sub(f"expected {NAME_RULE}", message)
    invalid = _INVALID.fullmatch(message)
    if invalid:
        expected = '"start" or "end"' if invalid[1] else '"step", "phase" or "event"'
        message = f"expected {expected}, got {invalid[2]}"
    return ProtocolError(f"{where}: {_lower(message)}")


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _lower(message: str) -> str:
    return message[:1].lower() + message[1:]
