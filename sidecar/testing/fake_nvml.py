"""An NVML stand-in: a module with the pynvml functions the GPU collector calls, driven by a
JSON spec instead of a driver. Select it with `collectors.nvml_module=sidecar.testing.fake_nvml`.

It reuses pynvml's real constants and exception classes, so `except pynvml.NVMLError_GPUIsLost`
catches what this module raises, and it keeps NVML's rules: nothing works before `nvmlInit`
(Uninitialized), handles must come from `nvmlDeviceGetHandleByIndex` (InvalidArgument), an
event wait times out with NVMLError_Timeout.

The spec comes from `configure(dict)` (tests; `update(dict)` changes it without a "reboot",
`inject_xid(gpu, xid)` fires an event) or from the JSON file named by the environment variable
SIDECAR_FAKE_NVML (re-read when the file changes, so a benchmark can update process lists while
the sidecar runs). With neither, NVML behaves as if the library were not installed.

    {"init_error": null,                  # e.g. "library_not_found", "driver_not_loaded"
     "driver_version": "550.54.15", "cuda_driver_version": 12040,
     "gpu_count": 8,
     "gpu": {...},                        # field values for every GPU (see DEFAULT_GPU)
     "gpus": {"3": {...}},                # overrides for one GPU, by index
     "xid_events": [{"gpu": 3, "xid": 79, "at_seconds": 0.5}]}

A GPU's "errors" maps an NVML function name (or "*" for every per-device call, or a field
value's NVML_FI_* name) to the error it raises: an NVML_ERROR_* name in lower case
("not_supported", "gpu_is_lost", "unknown", "not_ready", "no_permission"). "mig_mode": [1, 1]
makes a GPU answer NOT_SUPPORTED where MIG hides a field (nvml_model.MIG_UNSUPPORTED).
Energy grows with power over time, as on a real board.

The driver state lives in sidecar.testing.nvml_model, shared with the fake C library
(sidecar.testing.fake_nvml_lib), which the GPU collector's tests use. This module is the
lighter stand-in: pynvml's API without pynvml's code, for `bench_metrics --nvml module` and
quick experiments.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pynvml as _real

from sidecar.testing.nvml_model import (  # noqa: F401
    _NVLINK_COUNTERS,
    DEFAULT_GPU,
    ENV_VAR,
    MIG_UNSUPPORTED,
    VIOLATION_POLICIES,
    _energy_mj,
    _error,
    _EventSet,
    _gpu,
    _Handle,
    _require_init,
    _spec,
    _state,
    configure,
    inject_xid,
    update,
)

# The real constants and error classes, so code written against pynvml behaves identically.
for _name in dir(_real):
    if _name.startswith(("NVML_", "NVMLError", "nvmlClocksEventReason", "nvmlClocksThrottleReason", "nvmlEventType")):
        globals()[_name] = getattr(_real, _name)
NVMLError = _real.NVMLError


# ---------------------------------------------------------------- library and system


def nvmlInit() -> None:
    nvmlInitWithFlags(0)


def nvmlInitWithFlags(flags: int) -> None:
    spec = _spec()
    if spec.get("init_error"):
        raise _error(spec["init_error"])
    with _state.lock:
        if _state.refcount == 0:
            _state.generation += 1
            _state.init_time = time.monotonic()
            _state.pending_xids = sorted(
                (
                    {
                        "gpu": int(e["gpu"]),
                        "xid": int(e["xid"]),
                        "due": _state.init_time + float(e.get("at_seconds", 0)),
                    }
                    for e in spec.get("xid_events", [])
                ),
                key=lambda e: e["due"],
            )
        _state.refcount += 1


def nvmlShutdown() -> None:
    _require_init()
    with _state.lock:
        _state.refcount -= 1
        _state.lock.notify_all()


def nvmlSystemGetDriverVersion() -> str:
    return str(_require_init().get("driver_version", "550.54.15"))


def nvmlSystemGetCudaDriverVersion() -> int:
    return int(_require_init().get("cuda_driver_version", 12040))


nvmlSystemGetCudaDriverVersion_v2 = nvmlSystemGetCudaDriverVersion


def nvmlErrorString(result: int) -> str:
    return _real.NVMLError._errcode_to_string.get(result, f"NVML error {result}")


# ---------------------------------------------------------------- devices


def nvmlDeviceGetCount() -> int:
    return int(_require_init().get("gpu_count", 0))


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    spec = _require_init()
    if not isinstance(index, int) or not 0 <= index < int(spec.get("gpu_count", 0)):
        raise _error("invalid_argument")
    handle = _Handle(index, _state.generation)
    _gpu(handle, "nvmlDeviceGetHandleByIndex")
    return handle


def nvmlDeviceGetIndex(handle: _Handle) -> int:
    return _gpu(handle, "nvmlDeviceGetIndex")[0]


def nvmlDeviceGetUUID(handle: _Handle) -> str:
    i, v = _gpu(handle, "nvmlDeviceGetUUID")
    return v.get("uuid") or f"GPU-fa4e0000-0000-4000-8000-{i:012d}"


def nvmlDeviceGetName(handle: _Handle) -> str:
    return _gpu(handle, "nvmlDeviceGetName")[1]["name"]


def nvmlDeviceGetPciInfo(handle: _Handle) -> SimpleNamespace:
    i, v = _gpu(handle, "nvmlDeviceGetPciInfo")
    bus_id = v.get("pci_bus_id") or f"00000000:{0x18 + 0x10 * i:02X}:00.0"
    # The real struct's busId is a char array: bytes, not str.
    return SimpleNamespace(
        busId=bus_id.encode(),
        busIdLegacy=bus_id.encode(),
        domain=0,
        bus=int(bus_id.split(":")[1], 16),
        device=0,
        pciDeviceId=0x233010DE,
    )


nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo


def nvmlDeviceGetUtilizationRates(handle: _Handle) -> SimpleNamespace:
    v = _gpu(handle, "nvmlDeviceGetUtilizationRates")[1]
    return SimpleNamespace(gpu=int(v["utilization_gpu"]), memory=int(v["utilization_memory"]))


def nvmlDeviceGetMemoryInfo(handle: _Handle, version: int | None = None) -> SimpleNamespace:
    """Version 1 (no `reserved`; used includes the driver's reservation) or, with
    version=nvmlMemory_v2, version 2 (reserved apart: total = reserved + used + free)."""
    v = _gpu(handle, "nvmlDeviceGetMemoryInfo")[1]
    total, used, reserved = int(v["memory_total_bytes"]), int(v["memory_used_bytes"]), int(v["memory_reserved_bytes"])
    if version:
        return SimpleNamespace(version=version, total=total, reserved=reserved, used=used, free=total - used - reserved)
    return SimpleNamespace(total=total, used=used + reserved, free=total - used - reserved)


def nvmlDeviceGetTemperature(handle: _Handle, sensor: int) -> int:
    v = _gpu(handle, "nvmlDeviceGetTemperature")[1]
    if sensor != _real.NVML_TEMPERATURE_GPU:
        raise _error("invalid_argument")
    return int(v["temperature_celsius"])


def nvmlDeviceGetTemperatureV1(handle: _Handle, sensor: int) -> int:
    return nvmlDeviceGetTemperature(handle, sensor)


def nvmlDeviceGetTemperatureThreshold(handle: _Handle, threshold: int) -> int:
    v = _gpu(handle, "nvmlDeviceGetTemperatureThreshold")[1]
    if threshold == _real.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
        return int(v["slowdown_celsius"])
    if threshold == _real.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
        return int(v["shutdown_celsius"])
    raise _error("not_supported")


def nvmlDeviceGetPowerUsage(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetPowerUsage")[1]["power_mw"])


def nvmlDeviceGetEnforcedPowerLimit(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetEnforcedPowerLimit")[1]["power_limit_mw"])


def nvmlDeviceGetTotalEnergyConsumption(handle: _Handle) -> int:
    return _energy_mj(_gpu(handle, "nvmlDeviceGetTotalEnergyConsumption")[1])


def nvmlDeviceGetClockInfo(handle: _Handle, clock_type: int) -> int:
    v = _gpu(handle, "nvmlDeviceGetClockInfo")[1]
    if clock_type == _real.NVML_CLOCK_SM:
        return int(v["sm_clock_mhz"])
    if clock_type == _real.NVML_CLOCK_MEM:
        return int(v["memory_clock_mhz"])
    raise _error("not_supported")


def nvmlDeviceGetCurrentClocksEventReasons(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons")[1]["clock_event_reasons"])


def nvmlDeviceGetCurrentClocksThrottleReasons(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons")[1]["clock_event_reasons"])


def nvmlDeviceGetTotalEccErrors(handle: _Handle, error_type: int, counter_type: int) -> int:
    v = _gpu(handle, "nvmlDeviceGetTotalEccErrors")[1]
    prefix = {_real.NVML_AGGREGATE_ECC: "ecc_", _real.NVML_VOLATILE_ECC: "ecc_volatile_"}.get(counter_type)
    kind = {
        _real.NVML_MEMORY_ERROR_TYPE_CORRECTED: "corrected",
        _real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "uncorrected",
    }.get(error_type)
    if prefix is None or kind is None:
        raise _error("invalid_argument")
    return int(v[prefix + kind])


def nvmlDeviceGetRetiredPages(handle: _Handle, cause: int) -> list[int]:
    v = _gpu(handle, "nvmlDeviceGetRetiredPages")[1]
    if cause == _real.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS:
        count = int(v["retired_pages_single_bit"])
    elif cause == _real.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR:
        count = int(v["retired_pages_double_bit"])
    else:
        raise _error("invalid_argument")
    return [0x1000 * (n + 1) for n in range(count)]  # page addresses


def nvmlDeviceGetRetiredPagesPendingStatus(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetRetiredPagesPendingStatus")[1]["retired_pages_pending"])


def nvmlDeviceGetRemappedRows(handle: _Handle) -> tuple[int, int, int, int]:
    rows = _gpu(handle, "nvmlDeviceGetRemappedRows")[1]["remapped_rows"]
    return tuple(int(x) for x in rows)  # type: ignore[return-value]


def nvmlDeviceGetPcieReplayCounter(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetPcieReplayCounter")[1]["pcie_replay"])


def nvmlDeviceGetCurrPcieLinkGeneration(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetCurrPcieLinkGeneration")[1]["pcie_gen"])


def nvmlDeviceGetMaxPcieLinkGeneration(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetMaxPcieLinkGeneration")[1]["pcie_max_gen"])


def nvmlDeviceGetCurrPcieLinkWidth(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetCurrPcieLinkWidth")[1]["pcie_width"])


def nvmlDeviceGetMaxPcieLinkWidth(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetMaxPcieLinkWidth")[1]["pcie_max_width"])


def _nvlink(handle: _Handle, function: str, link: int) -> dict[str, Any]:
    v = _gpu(handle, function)[1]
    if not isinstance(link, int) or not 0 <= link < _real.NVML_NVLINK_MAX_LINKS:
        raise _error("invalid_argument")
    if link >= int(v["nvlink_links"]):
        raise _error("not_supported")  # what NVML answers for links the board does not have
    return v


def nvmlDeviceGetNvLinkState(handle: _Handle, link: int) -> int:
    v = _nvlink(handle, "nvmlDeviceGetNvLinkState", link)
    return _real.NVML_FEATURE_DISABLED if link in v["nvlink_down"] else _real.NVML_FEATURE_ENABLED


def nvmlDeviceGetNvLinkErrorCounter(handle: _Handle, link: int, counter: int) -> int:
    v = _nvlink(handle, "nvmlDeviceGetNvLinkErrorCounter", link)
    if counter not in _NVLINK_COUNTERS:
        raise _error("invalid_argument")
    counts = dict(v["nvlink_errors"])
    counts.update(v["nvlink_link_errors"].get(str(link), {}))
    return int(counts.get(_NVLINK_COUNTERS[counter], 0))


def nvmlDeviceGetComputeRunningProcesses(handle: _Handle) -> list[SimpleNamespace]:
    v = _gpu(handle, "nvmlDeviceGetComputeRunningProcesses")[1]
    return [
        SimpleNamespace(
            pid=int(p["pid"]),
            usedGpuMemory=p.get("used_memory_bytes"),
            gpuInstanceId=0xFFFFFFFF,
            computeInstanceId=0xFFFFFFFF,
        )
        for p in v["processes"]
    ]


nvmlDeviceGetComputeRunningProcesses_v3 = nvmlDeviceGetComputeRunningProcesses


def nvmlDeviceGetPcieThroughput(handle: _Handle, counter: int) -> int:
    v = _gpu(handle, "nvmlDeviceGetPcieThroughput")[1]
    if counter == _real.NVML_PCIE_UTIL_TX_BYTES:
        return int(v["pcie_tx_kbps"])
    if counter == _real.NVML_PCIE_UTIL_RX_BYTES:
        return int(v["pcie_rx_kbps"])
    raise _error("invalid_argument")


def nvmlDeviceGetEncoderUtilization(handle: _Handle) -> list[int]:
    return [int(_gpu(handle, "nvmlDeviceGetEncoderUtilization")[1]["encoder_utilization"]), 167_000]


def nvmlDeviceGetDecoderUtilization(handle: _Handle) -> list[int]:
    return [int(_gpu(handle, "nvmlDeviceGetDecoderUtilization")[1]["decoder_utilization"]), 167_000]


def violation_ns(handle: _Handle, policy: int) -> tuple[int, int]:
    """(reference time, violation time) in ns, as nvmlDeviceGetViolationStatus fills them."""
    v = _gpu(handle, "nvmlDeviceGetViolationStatus")[1]
    if policy not in VIOLATION_POLICIES:
        raise _error("invalid_argument")
    return time.time_ns() // 1000, int(v["violation_ns"].get(VIOLATION_POLICIES[policy], 0))


def nvmlDeviceGetViolationStatus(handle: _Handle, policy: int) -> SimpleNamespace:
    reference, violation = violation_ns(handle, policy)
    return SimpleNamespace(referenceTime=reference, violationTime=violation)


def field_value(handle: _Handle, field_id: int) -> tuple[int, int, int]:
    """One entry of nvmlDeviceGetFieldValues: (nvmlReturn, value type, value). A field's own
    error comes from the spec's errors under its NVML_FI_* name."""
    v = _gpu(handle, "nvmlDeviceGetFieldValues")[1]
    names = {_real.NVML_FI_DEV_MEMORY_TEMP: "NVML_FI_DEV_MEMORY_TEMP"}
    name = names.get(field_id)
    if name is None:
        return _real.NVML_ERROR_NOT_SUPPORTED, 0, 0
    failure = (v.get("errors") or {}).get(name)
    if failure:
        return _error(failure).value, 0, 0
    return _real.NVML_SUCCESS, _real.NVML_VALUE_TYPE_UNSIGNED_INT, int(v["memory_temperature_celsius"])


def nvmlDeviceGetFieldValues(handle: _Handle, field_ids: list[int]) -> Any:
    values = (_real.c_nvmlFieldValue_t * len(field_ids))()
    for n, field_id in enumerate(field_ids):
        ret, value_type, value = field_value(handle, field_id)
        values[n].fieldId, values[n].nvmlReturn, values[n].valueType = field_id, ret, value_type
        values[n].value.uiVal = value
    return values


def nvmlDeviceGetMigMode(handle: _Handle) -> list[int]:
    return [int(x) for x in _gpu(handle, "nvmlDeviceGetMigMode")[1]["mig_mode"]]


# ---------------------------------------------------------------- events


def nvmlEventSetCreate() -> _EventSet:
    _require_init()
    event_set = _EventSet()
    with _state.lock:
        _state.event_sets.append(event_set)
    return event_set


def nvmlDeviceRegisterEvents(handle: _Handle, event_types: int, event_set: _EventSet) -> None:
    i, v = _gpu(handle, "nvmlDeviceRegisterEvents")
    if not isinstance(event_set, _EventSet) or event_set.freed:
        raise _error("invalid_argument")
    if event_types & ~_real.nvmlEventTypeXidCriticalError or not v.get("xid_supported", True):
        raise _error("not_supported")
    with _state.lock:
        event_set.registered.add(i)


def nvmlEventSetWait_v2(event_set: _EventSet, timeout_ms: int) -> SimpleNamespace:
    _require_init()
    if not isinstance(event_set, _EventSet) or event_set.freed:
        raise _error("invalid_argument")
    deadline = time.monotonic() + max(0, timeout_ms) / 1000.0
    with _state.lock:
        while True:
            if _state.refcount <= 0:
                raise _error("uninitialized")
            now = time.monotonic()
            for n, event in enumerate(_state.pending_xids):
                if event["due"] <= now and event["gpu"] in event_set.registered:
                    del _state.pending_xids[n]
                    return SimpleNamespace(
                        device=_Handle(event["gpu"], _state.generation),
                        eventType=_real.nvmlEventTypeXidCriticalError,
                        eventData=event["xid"],
                        gpuInstanceId=0xFFFFFFFF,
                        computeInstanceId=0xFFFFFFFF,
                    )
            if now >= deadline:
                raise _error("timeout")
            due = [e["due"] for e in _state.pending_xids if e["gpu"] in event_set.registered]
            wake = min([deadline] + [d for d in due if d > now])
            _state.lock.wait(timeout=max(0.0, min(wake - now, 1.0)))


def nvmlEventSetWait(event_set: _EventSet, timeout_ms: int) -> SimpleNamespace:
    return nvmlEventSetWait_v2(event_set, timeout_ms)


def nvmlEventSetFree(event_set: _EventSet) -> None:
    _require_init()
    if not isinstance(event_set, _EventSet) or event_set.freed:
        raise _error("invalid_argument")
    with _state.lock:
        event_set.freed = True
        _state.event_sets.remove(event_set)
