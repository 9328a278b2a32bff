"""How late the event loop runs: everything the sidecar serves (health checks, registrations,
pushes) and the watchdog share one loop, so a stretch of work that holds it delays them all,
and past a rank's timeout makes a healthy rank look stalled. A task sleeps SAMPLE_SECONDS
again and again and measures how much later it woke; the worst of the last WINDOW_SECONDS is
`sidecar_event_loop_lag_seconds` (api.py)."""

from __future__ import annotations

import asyncio
import collections
import time

SAMPLE_SECONDS = 0.1
WINDOW_SECONDS = 60.0


class LoopLag:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._worst: collections.deque[tuple[float, float]] = collections.deque()  # (second, worst lag in it)

    def record(self, lag: float) -> None:
        now = self.clock()
        second = float(int(now))
        if self._worst and self._worst[-1][0] == second:
            if lag > self._worst[-1][1]:
                self._worst[-1] = (second, lag)
        else:
            self._worst.append((second, lag))
        while self._worst and self._worst[0][0] <= now - WINDOW_SECONDS:
            self._worst.popleft()

    def worst(self) -> float:
        """The longest the loop was late over the last WINDOW_SECONDS, in seconds."""
        cutoff = self.clock() - WINDOW_SECONDS
        worst = list(self._worst)  # a copy: read from the exposition thread while the loop appends
        return max((lag for second, lag in worst if second > cutoff), default=0.0)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(SAMPLE_SECONDS)
            self.record(max(0.0, loop.time() - start - SAMPLE_SECONDS))
