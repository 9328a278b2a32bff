"""How the hooks treat their own errors: they never raise into training, and a problem that
repeats every flush (a sidecar that is down, a rejected metric) is logged once per
interval, not twice a second into the training log."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

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


F = TypeVar("F", bound=Callable[..., Any])


def guarded(method: F) -> F:
    """Framework callbacks run inside the training loop: an error of ours is logged
    (rate-limited) and swallowed, never raised into training."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception as e:
            warn(
                f"callback:{method.__qualname__}",
                "trainer_hooks: %s failed (%s: %s); ignored",
                method.__qualname__,
                type(e).__name__,
                e,
            )
            return None

    return wrapper  # type: ignore[return-value]
