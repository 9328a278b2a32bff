"""The frames of a dumped Python stack (faulthandler's or py-spy's), read and shown one way:
stackdumps.py reads them from a rank's dump, liveness.py compares and shows them."""

from __future__ import annotations

import re
from collections.abc import Iterator

from sidecar.safetext import printable

Frames = tuple[tuple[str, str, int], ...]  # (file, function, line), innermost first

_FAULTHANDLER_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>\S+)', re.M)
_PY_SPY_FRAME = re.compile(r"^\s+(?P<func>\S+) \((?P<file>[^:()]+):(?P<line>\d+)\)", re.M)


def matches(text: str) -> Iterator[re.Match[str]]:
    """Each frame of a dump, in its order (both formats list the most recent call first): a line
    is a frame when faulthandler's or py-spy's format reads it (groups file, func and line)."""
    found = (_FAULTHANDLER_FRAME.match(line) or _PY_SPY_FRAME.match(line) for line in text.split("\n"))
    return (m for m in found if m is not None)


def parse(text: str) -> Frames:
    """The frames of a dump as (file, function, line), in its order."""
    return tuple((m["file"], m["func"], int(m["line"])) for m in matches(text))


def first(text: str) -> tuple[str, str, str] | None:
    """The dump's first frame as (file, function, line) found by searching the whole text:
    faulthandler's format first, else py-spy's (stackdumps.stack_top, as it always read it)."""
    found = _FAULTHANDLER_FRAME.search(text) or _PY_SPY_FRAME.search(text)
    return None if found is None else (found["file"], found["func"], found["line"])


def label(file: str, func: str, line: int | str) -> str:
    """A frame for a log line, an incident or a report: `func (file:line)`, the file cut to its
    last two parts; escaped before it is cut (the rank wrote its own dump, and the frame reaches
    reports and screens)."""
    short = "/".join(file.replace("\\", "/").rsplit("/", 2)[-2:])
    return printable(f"{func} ({short}:{line})")[:240]
