"""A rank writes its own stack-dump file: the innermost frame the sidecar takes from it is escaped
before it is cut (round 3, row 9), so no report, verdict or screen gets a raw control character."""

from __future__ import annotations

from sidecar.watchdog.stackdumps import stack_top


def test_the_innermost_frame_is_escaped_before_it_is_cut():
    dump = (
        "Thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/x/\x1b]52;c;ZXZpbA==\x07\u202eevil.py", line 3 in lie\x9b2J\n'
    )
    top = stack_top(dump)
    assert top is not None and "\\x1b" in top and "\\u202e" in top
    assert not any(ord(c) < 32 or 0x7F <= ord(c) <= 0x9F or c == "\u202e" for c in top), repr(top)
    assert len(stack_top(dump.replace("evil", "e" * 500)) or "") <= 240
