"""Rate-limited warnings: a problem that repeats every flush (a sidecar that is down, a
rejected metric) is logged once per interval, not 2 times a second into the training log."""
from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger("trainer_hooks")

INTERVAL_SECONDS = 60.0
_MAX_KEYS = 256
_last: dict[str, float] = {}
_lock = threading.Lock()


def _reset_after_fork() -> None:
    # The sender thread may have held the lock at fork time; the child starts unlocked.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def warn(key: str, msg: str, *args: object, interval: float = INTERVAL_SECONDS) -> bool:
    """Log `msg` at WARNING unless the same `key` was logged less than `interval` ago.
    Returns whether it was logged."""
    now = time.monotonic()
    with _lock:
        last = _last.get(key)
        if last is not None and now - last < interval:
            return False
        if len(_last) >= _MAX_KEYS:
            _last.clear()
        _last[key] = now
    try:
        log.warning(msg, *args)
    except Exception:  # a broken handler must not break the hooks
        pass
    return True
