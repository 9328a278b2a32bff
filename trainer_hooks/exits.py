"""The rank's last word: the exception it dies of, sent with its deregistration.

`install()` chains `sys.excepthook` and `threading.excepthook` once per process. The hooks that
were there before (the user's own, or Python's default that prints the traceback) always run
after ours, whatever ours does. An uncaught exception in the main thread closes every live
Monitor within EXCEPTION_BUDGET_SECONDS, sending one report: the exception's type (with its
bases), the first line of its message and the innermost frames of its traceback, all bounded.
An exception that ends another thread does not end the process: it is sent as a
`thread_exception` event instead.

A Monitor closed while an exception propagates (a `finally:` around the training loop, as in
the bundled trainer, or Lightning's teardown after a failure) sends that exception the same
way, so neither needs any code of its own for this. The sidecar decides the exit's reason; the
report is only this rank's claim about itself.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from trainer_hooks.wire import EXIT_MAX_FRAMES as MAX_FRAMES
from trainer_hooks.wire import EXIT_MAX_TEXT as MAX_TEXT
from trainer_hooks.wire import EXIT_MAX_TYPES as MAX_TYPES

EXCEPTION_BUDGET_SECONDS = 0.4  # a dead or hung sidecar delays the exit by about this much, at most

_lock = threading.Lock()
_installed = False
_on_fatal: list[Callable[[dict], None]] = []
_on_thread: list[Callable[[dict], None]] = []


def _name(cls: type) -> str:
    module = getattr(cls, "__module__", None)
    name = str(getattr(cls, "__qualname__", None) or getattr(cls, "__name__", "?"))
    return name if module in (None, "builtins") else f"{module}.{name}"


def _first_line(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        return "<unprintable message>"
    return (text.strip().splitlines() or [""])[0][:MAX_TEXT]


def _frame(f: traceback.FrameSummary) -> str:
    text = f"{f.filename}:{f.lineno} in {f.name}"
    return text if len(text) <= MAX_TEXT else "..." + text[-(MAX_TEXT - 3) :]


def report(exc: BaseException, thread: str | None = None) -> dict[str, Any]:
    """The wire form of an exception (docs/architecture/wire-protocol.md, `/v1/deregister`)."""
    types = [_name(c) for c in type(exc).__mro__ if c is not object][:MAX_TYPES]
    try:
        frames = traceback.extract_tb(exc.__traceback__)[-MAX_FRAMES:]
    except Exception:
        frames = []
    out: dict[str, Any] = {
        "type": types[0],
        "types": types,
        "message": _first_line(exc),
        "traceback": [_frame(f) for f in frames],
        "time": time.time(),  # when it was reported, by this host's clock: exits are ordered by it (protocol 8)
    }
    if thread is not None:
        out["thread"] = str(thread)[:MAX_TEXT]
    return out


def in_flight() -> dict[str, Any] | None:
    """The report of the exception being raised or handled right now, if any (a clean
    SystemExit is not one)."""
    exc = sys.exc_info()[1]
    if exc is None or (isinstance(exc, SystemExit) and exc.code in (None, 0)):
        return None
    return report(exc)


def uncaught_at_exit() -> dict[str, Any] | None:
    """At interpreter exit: the exception that ended the main script, which Python keeps in
    sys.last_exc (3.12) or sys.last_value after printing it, when our hook was replaced."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if not isinstance(exc, BaseException) or (isinstance(exc, SystemExit) and exc.code in (None, 0)):
        return None
    return report(exc)


def _run(callbacks: list[Callable[[dict], None]], rep: dict) -> None:
    for cb in list(callbacks):
        try:
            cb(rep)
        except Exception:
            pass


def install(on_fatal: Callable[[dict], None], on_thread: Callable[[dict], None]) -> None:
    """Chain the exception hooks (once per process) and add these callbacks."""
    global _installed
    with _lock:
        if on_fatal not in _on_fatal:
            _on_fatal.append(on_fatal)
        if on_thread not in _on_thread:
            _on_thread.append(on_thread)
        if _installed:
            return
        _installed = True
        previous = sys.excepthook
        previous_thread = threading.excepthook

    def excepthook(exc_type, exc, tb):
        try:
            if exc is not None and not (isinstance(exc, SystemExit) and exc.code in (None, 0)):
                if exc.__traceback__ is None and tb is not None:
                    exc = exc.with_traceback(tb)
                _run(_on_fatal, report(exc))
        except Exception:
            pass
        finally:
            previous(exc_type, exc, tb)

    def thread_excepthook(args):
        try:
            if args.exc_value is not None and not issubclass(args.exc_type, SystemExit):
                name = args.thread.name if args.thread is not None else None
                if name != "trainer_hooks-sender":
                    _run(_on_thread, report(args.exc_value, thread=name))
        except Exception:
            pass
        finally:
            previous_thread(args)

    # changes: exception-hooks (docs/changes-to-others.md)
    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
