"""Buffered records and their wire form.

The training thread stores a record as a plain tuple `(seq, kind, time, subject, payload)`:
the cheapest thing to build. `seq` numbers every record so the sender can count the ones
the bounded buffer dropped (gaps in the sequence). Only the sender thread turns records into
protocol items, and that is where tensors are read (`.detach()`, then a Python number):
the training thread never forces a device sync.

A `STEP` record whose step or metrics hold a CUDA tensor has a sixth element, a marker: an
event the training thread recorded on that tensor's stream (monitor.py). The sender reads the
record only once `marker.query()` is true, when the GPU has computed the values (sender.py):
read earlier, `.item()` would wait for all the work queued on the GPU so far.

| kind | subject | payload |
| --- | --- | --- |
| `STEP` | the step number | dict of metrics |
| `PHASE_START` | phase name | timeout in seconds, or None |
| `PHASE_END` | phase name | None |
| `EVENT` | event name | dict of fields |
"""

from __future__ import annotations

import math
from typing import Any

from trainer_hooks.errors import warn
from trainer_hooks.wire import (
    MAX_CUSTOM_METRICS,
    MAX_EVENT_FIELDS,
    MAX_FIELD_CHARS,
    MAX_NAME,
    NAME_BAD_CHARS_RE,
    NAME_RE,
    WELL_KNOWN_METRICS,
)

# Types that are never a tensor: a value of one is sent as it is (`number`), never looked at for a GPU.
PLAIN_TYPES = frozenset({float, int, bool, type(None), str})

STEP = "step"
PHASE_START = "phase_start"
PHASE_END = "phase_end"
EVENT = "event"

# The names, patterns and limits the sidecar checks are the wire contract (trainer_hooks/wire.py):
# the hooks shape what they send to fit them rather than have a whole batch refused.


class Unconvertible(ValueError):
    """A value that is not a number (or a one-element tensor)."""


def number(value: Any) -> int | float | str:
    """A JSON-safe number: ints stay ints, non-finite floats become "nan"/"inf"/"-inf" (the
    protocol's strict JSON). Tensors and numpy scalars are read here (`.detach()`, `.item()`)."""
    tp = type(value)
    if tp is float:
        return value if math.isfinite(value) else _nonfinite(value)
    if tp is int:
        return value
    if tp is bool:
        return int(value)
    detach = getattr(value, "detach", None)
    if callable(detach):
        value = detach()
    item = getattr(value, "item", None)
    if callable(item):
        try:
            value = item()
        except (ValueError, RuntimeError) as e:  # a tensor with more than one element
            raise Unconvertible(str(e)) from None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return int(value)
    try:
        out = float(value)
    except (TypeError, ValueError) as e:
        raise Unconvertible(f"{type(value).__name__} is not a number") from e
    return out if math.isfinite(out) else _nonfinite(out)


def gpu_device(step: Any, metrics: dict) -> Any:
    """The device of the first CUDA tensor among a step record's step and metrics, or None."""
    for value in (step, *metrics.values()):
        if type(value) not in PLAIN_TYPES and getattr(value, "is_cuda", False) is True:
            return value.device
    return None


def without_gpu_values(record: tuple) -> tuple | None:
    """A step record without its CUDA tensors or marker (a close that cannot wait for the GPU sends
    the step without them), or None when the step itself is one."""
    _seq, kind, when, step, metrics = record[:5]
    if getattr(step, "is_cuda", False) is True:
        return None
    return (_seq, kind, when, step, {k: v for k, v in metrics.items() if getattr(v, "is_cuda", False) is not True})


def _nonfinite(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def name(text: Any) -> str:
    """`text` as a name the sidecar accepts: other characters become `_`."""
    text = str(text)
    if NAME_RE.match(text):
        return text
    cleaned = NAME_BAD_CHARS_RE.sub("_", text)
    if not cleaned or not (cleaned[0].isalpha() or cleaned[0] == "_"):
        cleaned = "_" + cleaned
    return cleaned[:MAX_NAME]


def _field(value: Any) -> Any:
    """An event field as JSON: strings, numbers, booleans and null as they are, numbers
    (tensors too) made JSON-safe, anything else as its (bounded) text."""
    if value is None or isinstance(value, (bool, str)):
        return value[:MAX_FIELD_CHARS] if isinstance(value, str) else value
    try:
        return number(value)
    except Unconvertible:
        return str(value)[:MAX_FIELD_CHARS]


class Encoder:
    """Turns buffered records into protocol items. Lives on the sender thread."""

    def __init__(self, max_custom_metrics: int = MAX_CUSTOM_METRICS):
        self.max_custom_metrics = max_custom_metrics
        self._custom: set[str] = set()

    def item(self, record: tuple) -> dict | None:
        """The protocol item of one record (5 elements, or 6 with a GPU marker: it is not read
        here), or None when nothing of it can be sent."""
        kind, when, subject, payload = record[1], record[2], record[3], record[4]
        if kind == STEP:
            return self._step(when, subject, payload)
        if kind == PHASE_START:
            item = {"type": "phase", "name": name(subject), "action": "start", "time": when}
            if payload is not None:
                timeout = number(payload)
                if isinstance(timeout, (int, float)) and timeout > 0:
                    item["timeout_seconds"] = timeout
            return item
        if kind == PHASE_END:
            return {"type": "phase", "name": name(subject), "action": "end", "time": when}
        if kind == EVENT:
            if len(payload) > MAX_EVENT_FIELDS:
                warn(
                    f"event_fields:{subject}",
                    "trainer_hooks: event %r has %d fields; sending the first %d",
                    subject,
                    len(payload),
                    MAX_EVENT_FIELDS,
                )
            fields = {str(k)[:MAX_NAME]: _field(v) for k, v in list(payload.items())[:MAX_EVENT_FIELDS]}
            return {"type": "event", "name": name(subject), "time": when, "fields": fields}
        return None

    def _step(self, when: float, step: Any, metrics: dict) -> dict | None:
        try:
            step_number = number(step)
        except Unconvertible:
            step_number = None
        if isinstance(step_number, float) and step_number.is_integer():
            step_number = int(step_number)
        if not isinstance(step_number, int) or step_number < 0:
            warn("bad_step", "trainer_hooks: step must be an integer >= 0, got %r; record dropped", step)
            return None
        out = {}
        for key, value in metrics.items():
            if value is None:
                continue
            if key not in WELL_KNOWN_METRICS:
                key = name(key)
                if not self._custom_allowed(key):
                    continue
            try:
                out[key] = number(value)
            except Unconvertible as e:
                warn(f"bad_metric:{key}", "trainer_hooks: metric %r is not a number (%s); skipped", key, e)
        return {"type": "step", "step": step_number, "time": when, "metrics": out}

    def _custom_allowed(self, key: str) -> bool:
        if key in self._custom:
            return True
        if len(self._custom) >= self.max_custom_metrics:
            warn(
                f"custom_limit:{key}",
                "trainer_hooks: not sending custom metric %r (at most %d custom metric names)",
                key,
                self.max_custom_metrics,
            )
            return False
        self._custom.add(key)
        return True
