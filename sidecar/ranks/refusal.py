"""What every parser of the wire shares (the hooks' protocol, its push decoder, peer reports): the
strict-JSON parse, the `ProtocolError` a refusal raises, how a refused value is described, and the text checks that a
schema cannot say (control characters and lone surrogates, the job_ids the diag dir reserves)."""

from __future__ import annotations

import json
import re
from typing import Any

from trainer_hooks.wire import NONFINITE_VALUES, RESERVED_JOB_IDS

NONFINITE = {text: float(text) for text in NONFINITE_VALUES}
CONTROL_RE = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")  # controls, and lone surrogates (unprintable)


class ProtocolError(ValueError):
    """A request body the protocol refuses. `code` is the machine code of the error body."""

    def __init__(self, message: str, code: str = "bad_field", status: int = 400):
        super().__init__(message)
        self.code = code
        self.status = status


def kind_of(value: Any) -> str:
    """A refused value as a message shows it: its JSON kind, and a short excerpt of a scalar."""
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


def printable_text(value: str, where: str, max_len: int) -> str:
    """`value` when it is 1 to max_len characters without control characters or lone surrogates."""
    if not value or len(value) > max_len or CONTROL_RE.search(value):
        raise ProtocolError(f"{where}: expected 1 to {max_len} printable characters, got {value[:40]!r}")
    return value


def unreserved_job_id(job_id: str) -> str:
    """A job_id names the job's directory under the diag dir (sidecar/host/diagfiles.py): it may not
    be one of the sidecar's own directories, nor a dot name."""
    if job_id.startswith(".") or job_id.lower() in RESERVED_JOB_IDS:
        raise ProtocolError(
            f"job_id: {job_id[:40]!r} is reserved (it may not start with '.' nor be "
            f"{', '.join(sorted(RESERVED_JOB_IDS))})"
        )
    return job_id


def _refuse_constant(token: str) -> Any:
    raise ProtocolError(
        f"body is not strict JSON: bare {token} is not allowed "
        f'(send a non-finite metric value as the string "nan", "inf" or "-inf")',
        code="bad_json",
    )


def strict_json_object(body: bytes) -> dict:
    """Parse a strict-JSON object body (no bare NaN or Infinity)."""
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except ProtocolError:
        raise
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise ProtocolError(f"body is not valid JSON: {e}", code="bad_json") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"body must be a JSON object, got {kind_of(data)}", code="bad_json")
    return data
