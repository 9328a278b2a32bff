"""One NVML call for one field of one GPU, and what its outcome means.

The rule: an error scoped to a field removes that field, for that GPU, and nothing else.
- GPU_IS_LOST: the device is gone (`GpuLost`); nothing it reports can be trusted.
- NOT_SUPPORTED, FUNCTION_NOT_FOUND (an older driver lacks the symbol; pynvml's unversioned
  wrappers raise NVMLLibraryMismatchError for it): the field is unavailable, asked again after
  RETRY_UNSUPPORTED_SECONDS or when the GPU's MIG mode changes.
- Anything else (NO_PERMISSION, NOT_READY, UNKNOWN, TIMEOUT, ...): the field is unavailable,
  asked again after RETRY_FAILED_SECONDS.
An unavailable field is not called until its retry time, so a field that never answers costs
one call per retry period, and it is reported as a state (`unavailable`), logged once when it
becomes unavailable, not on every round.

A field read through several generations of an NVML call (`_v3`, `_v2`, the unversioned one)
starts with the newest and drops, for the session, each whose symbol the driver lacks.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

RETRY_UNSUPPORTED_SECONDS = 600.0
RETRY_FAILED_SECONDS = 60.0
UNSUPPORTED = frozenset({"not_supported", "function_not_found"})
_MISSING_CALL = frozenset({"function_not_found", "argument_version_mismatch"})


class GpuLost(Exception):
    """NVML said GPU_IS_LOST, or the device handle itself cannot be had."""


_ERROR_NAMES: dict[str, dict[int, str]] = {}


def reason_of(nv: ModuleType, error: BaseException) -> str:
    """An NVML error as a short label: NVML_ERROR_NOT_READY -> "not_ready"."""
    if isinstance(error, nv.NVMLError):
        names = _ERROR_NAMES.get(nv.__name__)
        if names is None:
            names = _ERROR_NAMES[nv.__name__] = {
                getattr(nv, n): n[len("NVML_ERROR_") :].lower()
                for n in dir(nv)
                if n.startswith("NVML_ERROR_") and isinstance(getattr(nv, n), int)
            }
        return names.get(error.value, f"error_{error.value}")
    if type(error).__name__ == "NVMLLibraryMismatchError":  # pynvml's unversioned wrapper, symbol missing
        return "function_not_found"
    return "python_error"


@dataclass
class Unavailable:
    reason: str
    retry_at: float
    detail: str
    reported: bool = True  # False for NVLink links a board does not have


@dataclass
class FieldStates:
    """One GPU's unavailable fields, the call generation that works per field, its MIG mode."""

    unavailable: dict[str, Unavailable] = field(default_factory=dict)
    generation: dict[str, int] = field(default_factory=dict)
    newly_unavailable: list[tuple[str, Unavailable]] = field(default_factory=list)  # since the last log
    recovered: list[str] = field(default_factory=list)
    mig_mode: int | None = None

    def skipped(self, key: str, now: float) -> bool:
        u = self.unavailable.get(key)
        return u is not None and now < u.retry_at

    def failed(self, key: str, reason: str, detail: str, now: float, reported: bool = True) -> None:
        wait = RETRY_UNSUPPORTED_SECONDS if reason in UNSUPPORTED else RETRY_FAILED_SECONDS
        before = self.unavailable.get(key)
        u = self.unavailable[key] = Unavailable(reason, now + wait, detail, reported)
        if reported and (before is None or before.reason != reason):
            self.newly_unavailable.append((key, u))

    def succeeded(self, key: str) -> None:
        before = self.unavailable.pop(key, None)
        if before is not None and before.reported:
            self.recovered.append(key)

    def reset(self) -> None:
        """Ask again for everything (the MIG mode changed: what is supported changed with it)."""
        self.unavailable.clear()
        self.generation.clear()

    def reported(self) -> dict[str, str]:
        return {k: u.reason for k, u in self.unavailable.items() if u.reported}


class DeviceReader:
    """Reads fields of one device through NVML, applying the rule above."""

    def __init__(self, nv: ModuleType, handle: Any, gpu: str, states: FieldStates, now: float | None = None):
        self.nv, self.handle, self.gpu, self.states = nv, handle, gpu, states
        self.now = time.monotonic() if now is None else now

    def call(self, key: str, function: str, *args: Any, reported: bool = True) -> Any:
        """`nv.<function>(handle, *args)`, or None when the field is unavailable."""
        return self.first(key, [(function, getattr(self.nv, function, None))], *args, reported=reported)

    def first(
        self, key: str, generations: Sequence[tuple[str, Callable[..., Any] | None]], *args: Any, reported: bool = True
    ) -> Any:
        """The field from the first call generation the driver has (newest first)."""
        states = self.states
        if states.skipped(key, self.now):
            return None
        if key in states.unavailable:  # its retry is due: every generation may be asked again
            states.generation.pop(key, None)
        start = states.generation.get(key, 0)
        last = "function_not_found", f"{generations[-1][0]}: not in this nvidia-ml-py"
        for n in range(start, len(generations)):
            name, fn = generations[n]
            if fn is None:
                continue
            try:
                value = fn(self.handle, *args)
            except Exception as e:  # every outcome is sorted below; none escapes as a crash
                reason = reason_of(self.nv, e)
                if reason == "gpu_is_lost":
                    raise GpuLost(f"gpu {self.gpu}: {name}: {e}") from None
                last = reason, f"{name}: {e}"
                if reason in _MISSING_CALL and n + 1 < len(generations):
                    continue  # an older driver: try the previous generation of the call
                break
            states.generation[key] = n
            states.succeeded(key)
            return value
        states.failed(key, last[0], last[1], self.now, reported)
        return None


class _ProcessInfoV1(ctypes.Structure):
    """nvmlProcessInfo_v1_t (nvml.h before 11.x): what the unversioned symbol fills."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


def compute_processes_v1(nv: ModuleType) -> Callable[[Any], list[Any]] | None:
    """The unversioned `nvmlDeviceGetComputeRunningProcesses` symbol (R470 and older drivers),
    which nvidia-ml-py 12+ no longer wraps: its `nvmlDeviceGetComputeRunningProcesses` calls `_v3`.
    None when `nv` is not pynvml over a C library (the Python stand-in)."""
    if getattr(nv, "_nvmlGetFunctionPointer", None) is None:
        return None

    def call(handle: Any) -> list[_ProcessInfoV1]:
        fn = nv._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses")
        count = ctypes.c_uint(0)
        ret = fn(handle, ctypes.byref(count), None)
        if ret == nv.NVML_SUCCESS:
            return []
        if ret != nv.NVML_ERROR_INSUFFICIENT_SIZE:
            raise nv.NVMLError(ret)
        count.value = count.value * 2 + 5
        infos = (_ProcessInfoV1 * count.value)()
        ret = fn(handle, ctypes.byref(count), infos)
        if ret != nv.NVML_SUCCESS:
            raise nv.NVMLError(ret)
        return list(infos[: count.value])

    return call
