"""Reading a step's GPU values on the hooks' sender thread without waiting for the GPU (sender.py).

A step record with a CUDA value carries a marker, a CUDA event the training thread recorded on the
value's stream (monitor.py, records.py). The sender takes such a record only once `computed()` says
the GPU has run the work up to it, then reads the values with `GpuReader.item`: on a side stream of
their device, never behind the work the training thread queued since. A close waits for values at
most until its deadline, then sends the step without them.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from typing import Any

from trainer_hooks.errors import warn
from trainer_hooks.records import Encoder, gpu_device, without_gpu_values


def computed(marker: Any) -> bool:
    """Whether the GPU has computed the values `marker` covers; one that cannot tell (it raises)
    counts as done: the values are then read as they would be without it."""
    try:
        return bool(marker.query())
    except Exception:
        return True


def side_stream(device: Any) -> Any:
    """A CUDA stream of `device` to read computed GPU values on; None when not now, False when never
    (no torch, not a CUDA device, an error): values are then read on this thread's current stream.

    `.item()` on the current stream, the default one, waits for all the work queued there since the
    value was computed (1 s behind a 1 s kernel, on an H200). torch's pool streams are non-blocking:
    a read there waits for nothing. But the first pool stream of a process waits for the GPU to
    finish its queued work, holding the GIL (the training thread stood still 1 s on an H200), so it
    is only asked for when the default stream is idle. Jobs with NCCL made the pool long before."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(device, "type", None) != "cuda":
        return False
    try:
        if not torch.cuda.default_stream(device).query():
            return None
        return torch.cuda.Stream(device=device)
    except Exception:
        return False


def pop_ready(buffer: deque, final: bool) -> tuple | None:
    """The oldest record, taken from the buffer; None, leaving it first there, while its GPU
    values are not computed (in a close it is taken anyway: `GpuReader.item`)."""
    head = buffer[0]
    if len(head) > 5 and not final and not computed(head[5]):
        return None
    record = buffer.popleft()
    if record is not head and len(record) > 5 and not final and not computed(record[5]):
        buffer.appendleft(record)  # a full buffer dropped `head` meanwhile; this one waits in its place
        return None
    return record


class GpuReader:
    """Items of step records with computed GPU values (`item`), each device's side stream kept."""

    def __init__(self, encoder: Encoder) -> None:
        self.encoder = encoder
        self.deadline = 0.0  # monotonic: in a close, the GPU values not computed by then are left out
        self._streams: dict[Any, Any] = {}  # device -> its side stream for reads (False: none)

    def item(self, record: tuple, final: bool) -> dict | None:
        """The item of a step with computed GPU values, read on a side stream of their device when it
        has one (`side_stream`), else on the current one. In a close, values still not computed at
        `deadline` are left out: a GPU that hangs must not keep the push and the deregistration
        from the sidecar."""
        if final:
            while not computed(record[5]):
                if time.monotonic() >= self.deadline:
                    warn(
                        "gpu_close",
                        "trainer_hooks: closing; a step's GPU values were not computed in time, sent without them",
                    )
                    stripped = without_gpu_values(record)
                    return None if stripped is None else self.encoder.item(stripped)
                time.sleep(0.002)
        with self._reading(record):
            return self.encoder.item(record)

    def _reading(self, record: tuple) -> contextlib.AbstractContextManager:
        """The side stream to read `record`'s GPU values on, made current for this thread alone."""
        try:
            device = gpu_device(record[3], record[4])
            stream = self._streams.get(device)
            if stream is None:
                stream = side_stream(device)
                if stream is not None:
                    self._streams[device] = stream
            if stream is not None and stream is not False:
                return sys.modules["torch"].cuda.stream(stream)
        except Exception:
            pass
        return contextlib.nullcontext()
