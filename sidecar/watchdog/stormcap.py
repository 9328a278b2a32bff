"""The storm cap: how many remediations a window allows, per owner under a node-wide cap."""

from __future__ import annotations

import time
from collections.abc import Callable


class StormCap:
    """At most `limit` remediations per sliding `window` seconds."""

    def __init__(self, limit: int, window: float, clock: Callable[[], float] = time.monotonic):
        self.limit, self.window, self.clock = limit, window, clock
        self._times: list[float] = []

    def _prune(self) -> None:
        cutoff = self.clock() - self.window
        self._times = [t for t in self._times if t > cutoff]

    def allow(self) -> bool:
        """Take one slot if there is one."""
        self._prune()
        if len(self._times) >= self.limit:
            return False
        self._times.append(self.clock())
        return True

    def in_window(self) -> int:
        self._prune()
        return len(self._times)


class OwnerStormCaps:
    """The storm cap per owner (the uid a job's ranks run as), under a node-wide ceiling: one
    user's restart storm spends its own budget, never the one another user's job needs."""

    def __init__(self, per_owner: int, node: int, window: float, clock: Callable[[], float] = time.monotonic):
        self.per_owner, self.window, self.clock = per_owner, window, clock
        self.node = StormCap(node, window, clock)
        self._owners: dict[object, StormCap] = {}

    def allow(self, owner: object) -> str | None:
        """Take a slot of `owner` and of the node; None when taken, else which cap is full."""
        cap = self._owners.get(owner)
        if cap is None:
            cap = self._owners[owner] = StormCap(self.per_owner, self.window, self.clock)
        if cap.in_window() >= cap.limit:
            return f"{self.per_owner} remediations of uid {owner} per {self.window:.0f}s (remediation.max_per_window)"
        if not self.node.allow():
            return (
                f"{self.node.limit} remediations on this node per {self.window:.0f}s (remediation.max_per_window_node)"
            )
        cap.allow()
        for key in [k for k, c in self._owners.items() if k != owner and c.in_window() == 0]:
            del self._owners[key]  # bounded by the owners with a remediation in the window
        return None

    def in_window(self) -> int:
        return self.node.in_window()
