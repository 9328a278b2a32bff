"""The simulated NVIDIA driver behind both NVML stand-ins: the spec (see sidecar.testing.fake_nvml
for its keys), the init refcount, handles, merged per-GPU values with their injected errors,
and the XID event queue. `fake_nvml` is its pynvml-shaped Python face, `fake_nvml_lib` its C face
(a fake libnvidia-ml under the real pynvml)."""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import pynvml as _real

ENV_VAR = "SIDECAR_FAKE_NVML"

DEFAULT_GPU: dict[str, Any] = {
    "name": "NVIDIA H100 80GB HBM3",
    "utilization_gpu": 97,
    "utilization_memory": 41,
    "memory_total_bytes": 85_520_809_984,
    "memory_used_bytes": 61_203_283_968,
    "temperature_celsius": 62,
    "slowdown_celsius": 87,
    "shutdown_celsius": 92,
    "power_mw": 612_000,
    "power_limit_mw": 700_000,
    "energy_mj": 1_500_000_000,
    "sm_clock_mhz": 1980,
    "memory_clock_mhz": 2619,
    "clock_event_reasons": 0,  # bitmask of nvmlClocksEventReason*
    "ecc_corrected": 0,
    "ecc_uncorrected": 0,
    "retired_pages_single_bit": 0,
    "retired_pages_double_bit": 0,
    "retired_pages_pending": 0,
    "remapped_rows": [0, 0, 0, 0],  # correctable, uncorrectable, pending, failed
    "pcie_replay": 0,
    "pcie_gen": 5,
    "pcie_max_gen": 5,
    "pcie_width": 16,
    "pcie_max_width": 16,
    "nvlink_links": 18,
    "nvlink_down": [],
    "nvlink_errors": {"replay": 0, "recovery": 0, "crc_flit": 0, "crc_data": 0},  # every link
    "nvlink_link_errors": {},  # per link overrides: {"3": {"crc_flit": 12}}
    "processes": [],  # [{"pid": 123, "used_memory_bytes": 456}]
    "xid_supported": True,
    "memory_temperature_celsius": 48,
    "memory_reserved_bytes": 553_648_128,
    "pcie_tx_kbps": 12_000,
    "pcie_rx_kbps": 34_000,  # nvmlDeviceGetPcieThroughput answers in KB/s
    "encoder_utilization": 0,
    "decoder_utilization": 0,
    "ecc_volatile_corrected": 0,
    "ecc_volatile_uncorrected": 0,
    "violation_ns": {},  # {"power": ns, "thermal": ns, ...}: time held down, per policy
    "mig_mode": [0, 0],  # current, pending; with MIG on, MIG_UNSUPPORTED answer NOT_SUPPORTED
    "errors": {},
}

# What a MIG-enabled GPU with instances answers NOT_SUPPORTED for on its parent device.
MIG_UNSUPPORTED = frozenset(
    {
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetEncoderUtilization",
        "nvmlDeviceGetDecoderUtilization",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetRetiredPages",
        "nvmlDeviceGetRetiredPagesPendingStatus",
    }
)

VIOLATION_POLICIES = {
    _real.NVML_PERF_POLICY_POWER: "power",
    _real.NVML_PERF_POLICY_THERMAL: "thermal",
    _real.NVML_PERF_POLICY_SYNC_BOOST: "sync_boost",
    _real.NVML_PERF_POLICY_BOARD_LIMIT: "board_limit",
    _real.NVML_PERF_POLICY_LOW_UTILIZATION: "low_utilization",
    _real.NVML_PERF_POLICY_RELIABILITY: "reliability",
}

_NVLINK_COUNTERS = {
    _real.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
    _real.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
    _real.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit",
    _real.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data",
}


def _error(name: str) -> _real.NVMLError:
    code = getattr(_real, "NVML_ERROR_" + name.upper(), None)
    if code is None:
        raise ValueError(f"fake_nvml spec: unknown NVML error name {name!r}")
    return _real.NVMLError(code)


@dataclass(frozen=True)
class _Handle:
    index: int
    generation: int


class _EventSet:
    def __init__(self) -> None:
        self.registered: set[int] = set()
        self.freed = False


class _State:
    """The simulated driver: the spec, init refcount, event queue."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Back to a driver that was never initialised (as if the machine had rebooted)."""
        self.lock = threading.Condition()
        self.spec: dict[str, Any] | None = None
        self.programmatic = False  # set by configure(): the env file is not consulted
        self.spec_file: str | None = None
        self.spec_mtime = 0.0
        self.checked_at = float("-inf")
        self.refcount = 0
        self.generation = 0
        self.init_time = 0.0
        self.pending_xids: list[dict] = []  # not yet delivered, sorted by due time
        self.event_sets: list[_EventSet] = []
        self.merged: dict[int, dict[str, Any]] = {}  # GPU index -> DEFAULT_GPU + spec values
        self.merged_for: dict[str, Any] | None = None

    def load(self) -> dict[str, Any] | None:
        """The spec, re-reading the env file when it changed (looked at twice a second)."""
        if self.programmatic:
            return self.spec
        now = time.monotonic()
        if now - self.checked_at < 0.5:
            return self.spec
        self.checked_at = now
        path = os.environ.get(ENV_VAR)
        if not path:
            self.spec = self.spec_file = None
            return None
        try:
            mtime = os.stat(path).st_mtime
            if path != self.spec_file or mtime != self.spec_mtime:
                with open(path) as f:
                    self.spec = json.load(f)
                self.spec_file, self.spec_mtime = path, mtime
        except (OSError, ValueError):
            pass  # a file being rewritten: keep the previous spec
        return self.spec


_state = _State()


def configure(spec: dict[str, Any] | None) -> None:
    """Replace the spec (None: back to the SIDECAR_FAKE_NVML file) and reset the driver state,
    as if the machine had rebooted."""
    _state.reset()  # in place: the fronts hold this object
    if spec is not None:
        _state.spec = copy.deepcopy(spec)
        _state.programmatic = True


def update(spec: dict[str, Any]) -> None:
    """Change the spec while the driver stays initialized: a GPU fails or recovers, values move."""
    _state.spec = copy.deepcopy(spec)
    _state.programmatic = True


def inject_xid(gpu: int, xid: int) -> None:
    """Deliver an XID event now, as the driver would on a GPU fault."""
    with _state.lock:
        _state.pending_xids.insert(0, {"gpu": gpu, "xid": xid, "due": 0.0})
        _state.lock.notify_all()


# ---------------------------------------------------------------- internals


def _spec() -> dict[str, Any]:
    spec = _state.load()
    if spec is None:
        raise _error("library_not_found")
    return spec


def _require_init() -> dict[str, Any]:
    if _state.refcount <= 0:
        raise _error("uninitialized")
    return _spec()


def _gpu(handle: Any, function: str) -> tuple[int, dict[str, Any]]:
    """The GPU's merged field values; raises the error the spec assigns to `function`."""
    spec = _require_init()
    if (
        not isinstance(handle, _Handle)
        or handle.generation != _state.generation
        or not 0 <= handle.index < int(spec.get("gpu_count", 0))
    ):
        raise _error("invalid_argument")
    if _state.merged_for is not spec:  # the spec changed: merge again (once per GPU, not per call)
        _state.merged, _state.merged_for = {}, spec
    values = _state.merged.get(handle.index)
    if values is None:
        values = dict(DEFAULT_GPU)
        values.update(spec.get("gpu", {}))
        values.update(spec.get("gpus", {}).get(str(handle.index), {}))
        _state.merged[handle.index] = values
    errors = values.get("errors") or {}
    failure = errors.get(function) or errors.get("*")
    if failure:
        raise _error(failure)
    if function in MIG_UNSUPPORTED and int(values["mig_mode"][0]) == _real.NVML_DEVICE_MIG_ENABLE:
        raise _error("not_supported")
    return handle.index, values


def _energy_mj(values: dict[str, Any]) -> int:
    elapsed = time.monotonic() - _state.init_time
    return int(values["energy_mj"] + values["power_mw"] * elapsed)  # mW x s = mJ
