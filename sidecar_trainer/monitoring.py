"""The link to the node sidecar: `trainer_hooks.Monitor`, imported lazily, or a null object when it
is switched off or cannot be loaded (training never depends on the sidecar)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("sidecar_trainer")


class NullMonitor:
    """Same verbs as trainer_hooks.Monitor, doing nothing."""

    def step(self, step: int, **metrics: Any) -> None:
        pass

    @contextlib.contextmanager
    def phase(self, name: str, timeout: float | None = None) -> Iterator[None]:
        yield

    def event(self, name: str, **fields: Any) -> None:
        pass

    def close(self, reason: str = "finished") -> None:
        pass


def open_monitor(enabled: bool):
    if not enabled:
        return NullMonitor()
    try:
        from trainer_hooks import Monitor

        return Monitor()
    except Exception as e:  # missing or broken hooks must not stop training
        log.warning("monitor: trainer_hooks unavailable (%s: %s); running without the sidecar", type(e).__name__, e)
        return NullMonitor()
