"""XID errors: the driver's fault reports (79 = fallen off the bus, 48 = double-bit ECC, 13/31/43 =
application faults, ...). NVML delivers them as events; a daemon thread blocks in
`nvmlEventSetWait_v2` and counts them per GPU and XID, so none is missed between samples.

`HARDWARE_XIDS` are the XIDs whose documented recovery is a GPU reset or a node reboot
(NVIDIA's XID catalogue): one list for the critical alert (alerts/build.py), preflight (a node
that logged one since boot should not start a job) and the exit reasons. Others (13, 31, 43, ...)
are mostly application faults."""

from __future__ import annotations

import logging
import math
import threading
import time
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)
HARDWARE_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    64: "ECC page retirement or row remapper failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}

WAIT_MS = 1000  # how long one wait blocks: bounds how late `stop` takes effect
MAX_XIDS_PER_GPU = 32  # distinct XID labels per GPU; rarer ones are counted as "other"


class XidWatcher:
    def __init__(self, nv: ModuleType, handles: dict[str, Any]):
        """`handles` maps GPU label ("0") to its NVML handle."""
        self.nv = nv
        self.handles = handles
        self.watched: list[str] = []  # GPUs registered for XID events
        self._counts: dict[tuple[str, str], int] = {}
        self._last: dict[str, tuple[int, float]] = {}  # gpu -> (xid, unix time)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None

    def start(self) -> None:
        nv = self.nv
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            log.warning("XID events unavailable: nvmlEventSetCreate: %s", e)
            return
        for gpu, handle in self.handles.items():
            try:
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, self._event_set)
                self.watched.append(gpu)
            except nv.NVMLError as e:  # not supported on this board, or the GPU is lost
                log.info("XID events not available on gpu %s: %s", gpu, e)
        if not self.watched:
            self._free()
            return
        self._thread = threading.Thread(target=self._run, name="sidecar-xid-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=WAIT_MS / 1000 * 3)
        self._free()

    def _free(self) -> None:
        if self._event_set is not None and (self._thread is None or not self._thread.is_alive()):
            try:
                self.nv.nvmlEventSetFree(self._event_set)
            except self.nv.NVMLError:
                pass
            self._event_set = None

    def snapshot(self) -> tuple[dict[tuple[str, str], int], dict[str, tuple[int, float]]]:
        """(counts by (gpu, xid), last (xid, time) by gpu), copied under the lock."""
        with self._lock:
            return dict(self._counts), dict(self._last)

    def record(self, gpu: str, xid: int) -> None:
        with self._lock:
            label = str(xid)
            if (gpu, label) not in self._counts and sum(1 for g, _ in self._counts if g == gpu) >= MAX_XIDS_PER_GPU:
                label = "other"
            count = self._counts[(gpu, label)] = self._counts.get((gpu, label), 0) + 1
            self._last[gpu] = (xid, time.time())
        if math.log10(count).is_integer():  # the 1st, 10th, 100th ...: a storm does not flood the log
            log.warning("XID %d on gpu %s (%d so far)", xid, gpu, count)

    def _run(self) -> None:
        nv = self.nv
        wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        failures = 0
        while not self._stop.is_set():
            try:
                data = wait(self._event_set, WAIT_MS)
            except nv.NVMLError_Timeout:
                failures = 0
                continue
            except nv.NVMLError_FunctionNotFound:
                if wait is nv.nvmlEventSetWait:
                    log.warning("XID events unavailable: this driver has no nvmlEventSetWait")
                    return
                wait = nv.nvmlEventSetWait  # a driver older than nvmlEventSetWait_v2 (NVML 11)
                continue
            except nv.NVMLError as e:
                # A lost GPU or a driver in trouble: keep listening, without spinning.
                failures += 1
                if failures == 1:
                    log.warning("waiting for XID events failed: %s (retrying)", e)
                self._stop.wait(min(30.0, 0.5 * failures))
                continue
            failures = 0
            if data.eventType & nv.nvmlEventTypeXidCriticalError:
                self.record(self._gpu_of(data.device), int(data.eventData))

    def _gpu_of(self, device: Any) -> str:
        try:
            return str(self.nv.nvmlDeviceGetIndex(device))
        except Exception:  # a null device: an XID the driver could not attribute to one GPU
            return ""
