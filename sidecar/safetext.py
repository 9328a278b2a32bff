"""Text that a rank controls, made safe to print: the one escaping function for everything the
sidecar writes for people (incident summaries, `sidecar incidents`, `sidecar status`, log lines).

A rank writes its own stack-dump file, names its own cgroup, reports its own exceptions and
event fields; a job's coordinator, which a rank names (a host its owner may run), answers its
verdict and story. Printed raw to an operator's terminal, such text can clear the screen, write the
clipboard (OSC 52), retitle the window, or move the cursor to overwrite a line ("evidence:
none"); a newline or carriage return inside one field can fake a line of the record. So every
control character (C0, DEL, C1) and the invisible bidirectional overrides (which reorder what a
reader sees) become visible escapes: `\\x1b`, `\\u202e`. Only the line breaks the sidecar itself
puts between lines survive, and only where the caller says so (`keep_newlines`).

JSON records need nothing: `json.dumps` escapes control characters itself.
"""

from __future__ import annotations

import re

# C0 controls, DEL, C1 controls; the bidi embeddings, overrides and isolates, and the marks.
# Also the Arabic letter mark (bidi), the line and paragraph separators (line breaks to Unicode-aware
# readers) and lone surrogates (no encoding can write them: printing one raises).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")
_UNSAFE_BUT_NEWLINE = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]"
)


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, keep_newlines: bool = False) -> str:
    """`text` with every control character escaped (`\\x1b`); `keep_newlines` leaves `\\n`
    alone, for a whole document whose fields were escaped when it was put together."""
    return (_UNSAFE_BUT_NEWLINE if keep_newlines else _UNSAFE).sub(_escape, text)


def unsafe(text: str) -> bool:
    """Whether `text` holds a character `printable` would escape (input checks refuse such text)."""
    return _UNSAFE.search(text) is not None


# One escape of JSON text: an escaped backslash (kept), a surrogate pair (kept: one code point), any
# other \uXXXX, or a short escape.
_JSON_ESCAPE = re.compile(r'\\(\\|u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|[bfnrt"/])')
_SHORT = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _json_escape(match: re.Match) -> str:
    seq = match.group(1)
    if seq[0] == "u" and len(seq) == 5:
        char = chr(int(seq[1:], 16))
    elif seq in _SHORT:
        char = _SHORT[seq]
    else:
        return match.group()
    if not _UNSAFE.match(char):
        return match.group()
    return "\\\\" + _escape(_UNSAFE.match(char))[1:]  # type: ignore[arg-type]


def printable_json(text: str) -> str:
    """JSON text (ASCII, as `json.dumps` writes it by default) whose every string, once parsed,
    holds `printable`'s escapes instead of control characters: `\\u001b` becomes the four
    characters `\\x1b`. Linear in the text, however deeply it nests."""
    return _JSON_ESCAPE.sub(_json_escape, text)
