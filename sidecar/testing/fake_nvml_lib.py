"""A fake `libnvidia-ml.so.1` under the real nvidia-ml-py: the test path for the GPU collector.

`install()` puts a `FakeNvmlLibrary` where pynvml keeps its loaded CDLL (`pynvml.nvmlLib`) and
empties pynvml's function-pointer cache, so every pynvml wrapper runs its own code: its symbol
lookup (`_nvmlGetFunctionPointer`), its ctypes structs passed by pointer, its return-code checks
and its exception classes. Each symbol is a ctypes CFUNCTYPE callback with the C signature of
nvml.h: pointers arrive as addresses and are filled through ctypes structs laid out as in nvml.h
(declared here, not borrowed from pynvml, so a layout mismatch would show), and the result is an
nvmlReturn_t code.

The devices behave as the spec of `sidecar.testing.fake_nvml` says (the same JSON spec, state,
`configure`/`update`/`inject_xid`): that module is the driver model, this one its C face. Two spec
keys choose what the library *has*:

    "driver_generation": "r570"      # or "r535", "r470": symbols that generation lacks are absent
    "missing_functions": ["nvmlDeviceGetTemperature"]   # removed on top of that

An absent symbol is what `getattr(CDLL, name)` does on a real library without it: AttributeError,
which pynvml turns into NVMLError_FunctionNotFound (or NVMLLibraryMismatchError in its
unversioned wrappers). `calls` counts the C calls per symbol (the benchmark's NVML-calls figure).

Which stand-in to use: this library everywhere (the collector's and preflight's tests, every
test that starts a sidecar, the metrics benchmark, gpu_check's own test); the pure-Python
module `sidecar.testing.fake_nvml` (pynvml's API without pynvml's code) only for
`bench_metrics --nvml module`. As a `collectors.nvml_module`, name this module: it installs
itself on first use and then is pynvml.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from ctypes import CFUNCTYPE, Structure, c_int, c_uint, c_ulonglong, c_void_p, sizeof
from typing import Any

import pynvml

from sidecar.testing import fake_nvml as model
from sidecar.testing.nvml_h import (
    MEMORY_V2,
    NOT_AVAILABLE_ULL,
    TEMPERATURE_V1,
    EventData,
    FieldValue,
    Memory_v1,
    Memory_v2,
    PciInfo,
    ProcessInfo_v1,
    ProcessInfo_v2,
    Temperature_v1,
    Utilization,
    ViolationTime,
)

log = logging.getLogger(__name__)

# Symbols each modelled driver generation lacks (the newest has them all).
GENERATIONS: dict[str, frozenset[str]] = {
    "r570": frozenset(),
    "r535": frozenset({"nvmlDeviceGetTemperatureV"}),
    "r470": frozenset(
        {
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetComputeRunningProcesses_v2",
            "nvmlDeviceGetCurrentClocksEventReasons",
            "nvmlDeviceGetMemoryInfo_v2",
            "nvmlDeviceGetTemperatureV",
            "nvmlSystemGetCudaDriverVersion_v2",
        }
    ),
}


HANDLE_BASE = 0x7E57_0000_0000
EVENT_SET_BASE = 0x7E58_0000_0000
P, U, INT, ULL = c_void_p, c_uint, c_int, c_ulonglong


def _err(name: str) -> pynvml.NVMLError:
    return pynvml.NVMLError(getattr(pynvml, "NVML_ERROR_" + name.upper()))


def _out(ptr: int | None, ctype: Any, value: Any) -> None:
    if not ptr:
        raise _err("invalid_argument")
    ctype.from_address(ptr).value = value


def _struct(ptr: int | None, struct: type[Structure]) -> Any:
    if not ptr:
        raise _err("invalid_argument")
    return struct.from_address(ptr)


def _out_text(buf: int | None, length: int, text: str) -> None:
    data = text.encode() + b"\0"
    if not buf:
        raise _err("invalid_argument")
    if len(data) > length:
        raise _err("insufficient_size")
    ctypes.memmove(buf, data, len(data))


# ---------------------------------------------------------------- the symbol table

_SYMBOLS: dict[str, tuple[Any, Callable[..., Any]]] = {}


def symbol(name: str, *argtypes: Any, restype: Any = c_int):
    """Register `fn(lib, *c_args)` as the C function `name`. It returns nothing on success
    (or the value for a non-nvmlReturn_t restype) and raises NVMLError for an error code."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _SYMBOLS[name] = (CFUNCTYPE(restype, *argtypes), fn)
        return fn

    return register


class FakeNvmlLibrary:
    """What `CDLL("libnvidia-ml.so.1")` would be: attribute lookup gives a C function or raises
    AttributeError for a symbol the modelled driver does not export."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.faults: list[str] = []  # Python errors inside a callback (a bug in this fake)
        self._functions: dict[str, Any] = {}
        self._handles: dict[int, Any] = {}  # address -> model handle
        self._event_sets: dict[int, Any] = {}
        self._event_sets_made: list[Any] = []
        self._lock = threading.Lock()
        self._error_strings: dict[int, ctypes.Array] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in _SYMBOLS or name in missing_functions():
            raise AttributeError(f"libnvidia-ml.so.1: undefined symbol: {name}")
        with self._lock:
            fn = self._functions.get(name)
            if fn is None:
                proto, impl = _SYMBOLS[name]
                fn = self._functions[name] = proto(self._guarded(name, impl, proto._restype_))
        return fn

    def _guarded(self, name: str, impl: Callable[..., Any], restype: Any) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.calls[name] += 1
            try:
                value = impl(self, *args)
            except pynvml.NVMLError as e:
                return e.value
            except Exception:  # never let ctypes swallow it and return 0 (SUCCESS)
                self.faults.append(f"{name}: {traceback.format_exc()}")
                log.exception("fake NVML library: %s failed", name)
                return pynvml.NVML_ERROR_UNKNOWN
            return pynvml.NVML_SUCCESS if restype is c_int else value

        return call

    # handles are addresses, as the real library's opaque pointers are
    def address(self, handle: Any) -> int:
        address = HANDLE_BASE + (handle.generation << 16) + (handle.index + 1) * 16
        self._handles[address] = handle
        return address

    def handle(self, address: int | None) -> Any:
        return self._handles.get(address or 0, object())  # unknown: the model says INVALID_ARGUMENT

    def event_set(self, address: int | None) -> Any:
        return self._event_sets.get(address or 0, object())

    def error_string(self, code: int) -> int:
        if code not in self._error_strings:
            text = pynvml.NVMLError._errcode_to_string.get(code, f"NVML error {code}")
            self._error_strings[code] = ctypes.create_string_buffer(text.encode())
        return ctypes.addressof(self._error_strings[code])


def missing_functions() -> frozenset[str]:
    spec = model._state.load() or {}
    generation = spec.get("driver_generation", "r570")
    if generation not in GENERATIONS:
        raise ValueError(f"fake NVML spec: unknown driver_generation {generation!r} (one of {sorted(GENERATIONS)})")
    return GENERATIONS[generation] | frozenset(spec.get("missing_functions", ()))


# ---------------------------------------------------------------- library and system


@symbol("nvmlInitWithFlags", U)
def _init(lib, flags):
    model.nvmlInitWithFlags(flags)


@symbol("nvmlShutdown")
def _shutdown(lib):
    model.nvmlShutdown()


@symbol("nvmlErrorString", INT, restype=c_void_p)
def _error_string(lib, code):
    return lib.error_string(code)


@symbol("nvmlSystemGetDriverVersion", P, U)
def _driver_version(lib, buf, length):
    _out_text(buf, length, model.nvmlSystemGetDriverVersion())


@symbol("nvmlSystemGetCudaDriverVersion", P)
def _cuda_version(lib, out):
    _out(out, c_int, model.nvmlSystemGetCudaDriverVersion())


_SYMBOLS["nvmlSystemGetCudaDriverVersion_v2"] = _SYMBOLS["nvmlSystemGetCudaDriverVersion"]


@symbol("nvmlDeviceGetCount_v2", P)
def _count(lib, out):
    _out(out, c_uint, model.nvmlDeviceGetCount())


@symbol("nvmlDeviceGetHandleByIndex_v2", U, P)
def _handle_by_index(lib, index, out):
    _out(out, c_void_p, lib.address(model.nvmlDeviceGetHandleByIndex(index)))


@symbol("nvmlDeviceGetIndex", P, P)
def _index(lib, device, out):
    _out(out, c_uint, model.nvmlDeviceGetIndex(lib.handle(device)))


@symbol("nvmlDeviceGetUUID", P, P, U)
def _uuid(lib, device, buf, length):
    _out_text(buf, length, model.nvmlDeviceGetUUID(lib.handle(device)))


@symbol("nvmlDeviceGetName", P, P, U)
def _name(lib, device, buf, length):
    _out_text(buf, length, model.nvmlDeviceGetName(lib.handle(device)))


@symbol("nvmlDeviceGetPciInfo_v3", P, P)
def _pci_info(lib, device, out):
    pci = model.nvmlDeviceGetPciInfo(lib.handle(device))
    info = _struct(out, PciInfo)
    info.busId, info.busIdLegacy = pci.busId, pci.busIdLegacy[:15]
    info.domain, info.bus, info.device, info.pciDeviceId = pci.domain, pci.bus, pci.device, pci.pciDeviceId


# ---------------------------------------------------------------- device fields


@symbol("nvmlDeviceGetUtilizationRates", P, P)
def _utilization(lib, device, out):
    util = model.nvmlDeviceGetUtilizationRates(lib.handle(device))
    s = _struct(out, Utilization)
    s.gpu, s.memory = util.gpu, util.memory


@symbol("nvmlDeviceGetMemoryInfo", P, P)
def _memory_v1(lib, device, out):
    mem = model.nvmlDeviceGetMemoryInfo(lib.handle(device))
    s = _struct(out, Memory_v1)
    s.total, s.free, s.used = mem.total, mem.free, mem.used


@symbol("nvmlDeviceGetMemoryInfo_v2", P, P)
def _memory_v2(lib, device, out):
    s = _struct(out, Memory_v2)
    if s.version != MEMORY_V2:
        raise _err("argument_version_mismatch")
    mem = model.nvmlDeviceGetMemoryInfo(lib.handle(device), version=MEMORY_V2)
    s.total, s.reserved, s.free, s.used = mem.total, mem.reserved, mem.free, mem.used


@symbol("nvmlDeviceGetTemperature", P, U, P)
def _temperature(lib, device, sensor, out):
    _out(out, c_uint, model.nvmlDeviceGetTemperature(lib.handle(device), sensor))


@symbol("nvmlDeviceGetTemperatureV", P, P)
def _temperature_v(lib, device, out):
    s = _struct(out, Temperature_v1)
    if s.version != TEMPERATURE_V1:
        raise _err("argument_version_mismatch")
    s.temperature = model.nvmlDeviceGetTemperature(lib.handle(device), s.sensorType)


@symbol("nvmlDeviceGetTemperatureThreshold", P, U, P)
def _threshold(lib, device, which, out):
    _out(out, c_uint, model.nvmlDeviceGetTemperatureThreshold(lib.handle(device), which))


def _device_value(function: str, ctype: Any) -> None:
    """A `nvmlReturn_t f(nvmlDevice_t, T *out)` symbol answered by the model's function of that name."""

    @symbol(function, P, P)
    def impl(lib, device, out):
        _out(out, ctype, getattr(model, function)(lib.handle(device)))


for _function, _ctype in (
    ("nvmlDeviceGetPowerUsage", c_uint),
    ("nvmlDeviceGetEnforcedPowerLimit", c_uint),
    ("nvmlDeviceGetTotalEnergyConsumption", c_ulonglong),
    ("nvmlDeviceGetCurrentClocksEventReasons", c_ulonglong),
    ("nvmlDeviceGetCurrentClocksThrottleReasons", c_ulonglong),
    ("nvmlDeviceGetRetiredPagesPendingStatus", c_uint),
    ("nvmlDeviceGetPcieReplayCounter", c_uint),
    ("nvmlDeviceGetCurrPcieLinkGeneration", c_uint),
    ("nvmlDeviceGetMaxPcieLinkGeneration", c_uint),
    ("nvmlDeviceGetCurrPcieLinkWidth", c_uint),
    ("nvmlDeviceGetMaxPcieLinkWidth", c_uint),
):
    _device_value(_function, _ctype)


@symbol("nvmlDeviceGetClockInfo", P, U, P)
def _clock(lib, device, clock, out):
    _out(out, c_uint, model.nvmlDeviceGetClockInfo(lib.handle(device), clock))


@symbol("nvmlDeviceGetTotalEccErrors", P, U, U, P)
def _ecc(lib, device, error_type, counter_type, out):
    _out(out, c_ulonglong, model.nvmlDeviceGetTotalEccErrors(lib.handle(device), error_type, counter_type))


@symbol("nvmlDeviceGetRetiredPages", P, U, P, P)
def _retired_pages(lib, device, cause, count, addresses):
    pages = model.nvmlDeviceGetRetiredPages(lib.handle(device), cause)
    capacity = c_uint.from_address(count).value if count else 0
    _out(count, c_uint, len(pages))
    if not addresses or capacity < len(pages):
        if pages:
            raise _err("insufficient_size")
        return
    for n, page in enumerate(pages):
        c_ulonglong.from_address(addresses + n * sizeof(c_ulonglong)).value = page


@symbol("nvmlDeviceGetRemappedRows", P, P, P, P, P)
def _remapped_rows(lib, device, corr, unc, pending, failure):
    rows = model.nvmlDeviceGetRemappedRows(lib.handle(device))
    for ptr, value in zip((corr, unc, pending, failure), rows, strict=True):
        _out(ptr, c_uint, value)


@symbol("nvmlDeviceGetPcieThroughput", P, U, P)
def _pcie_throughput(lib, device, counter, out):
    _out(out, c_uint, model.nvmlDeviceGetPcieThroughput(lib.handle(device), counter))


@symbol("nvmlDeviceGetEncoderUtilization", P, P, P)
def _encoder(lib, device, util, period):
    value, sampling_us = model.nvmlDeviceGetEncoderUtilization(lib.handle(device))
    _out(util, c_uint, value)
    _out(period, c_uint, sampling_us)


@symbol("nvmlDeviceGetDecoderUtilization", P, P, P)
def _decoder(lib, device, util, period):
    value, sampling_us = model.nvmlDeviceGetDecoderUtilization(lib.handle(device))
    _out(util, c_uint, value)
    _out(period, c_uint, sampling_us)


@symbol("nvmlDeviceGetViolationStatus", P, U, P)
def _violation(lib, device, policy, out):
    reference, violation = model.violation_ns(lib.handle(device), policy)
    s = _struct(out, ViolationTime)
    s.referenceTime, s.violationTime = reference, violation


@symbol("nvmlDeviceGetFieldValues", P, INT, P)
def _field_values(lib, device, count, values):
    handle = lib.handle(device)
    model.field_value(handle, -1)  # the device itself answers first (lost, invalid handle)
    if not values or count < 0:
        raise _err("invalid_argument")
    for n in range(count):
        entry = FieldValue.from_address(values + n * sizeof(FieldValue))
        entry.nvmlReturn, entry.valueType, value = model.field_value(handle, entry.fieldId)
        entry.value.uiVal = value


@symbol("nvmlDeviceGetMigMode", P, P, P)
def _mig_mode(lib, device, current, pending):
    now, later = model.nvmlDeviceGetMigMode(lib.handle(device))
    _out(current, c_uint, now)
    _out(pending, c_uint, later)


@symbol("nvmlDeviceGetNvLinkState", P, U, P)
def _nvlink_state(lib, device, link, out):
    _out(out, c_uint, model.nvmlDeviceGetNvLinkState(lib.handle(device), link))


@symbol("nvmlDeviceGetNvLinkErrorCounter", P, U, U, P)
def _nvlink_errors(lib, device, link, counter, out):
    _out(out, c_ulonglong, model.nvmlDeviceGetNvLinkErrorCounter(lib.handle(device), link, counter))


def _processes(function: str, struct: type[Structure]) -> None:
    @symbol(function, P, P, P)
    def impl(lib, device, count, infos):
        procs = model.nvmlDeviceGetComputeRunningProcesses(lib.handle(device))
        capacity = c_uint.from_address(count).value if count else 0
        _out(count, c_uint, len(procs))
        if not infos or capacity < len(procs):
            if procs:
                raise _err("insufficient_size")
            return
        for n, p in enumerate(procs):
            entry = struct.from_address(infos + n * sizeof(struct))
            entry.pid = p.pid
            entry.usedGpuMemory = NOT_AVAILABLE_ULL if p.usedGpuMemory is None else p.usedGpuMemory
            if struct is ProcessInfo_v2:
                entry.gpuInstanceId, entry.computeInstanceId = p.gpuInstanceId, p.computeInstanceId


_processes("nvmlDeviceGetComputeRunningProcesses", ProcessInfo_v1)
_processes("nvmlDeviceGetComputeRunningProcesses_v2", ProcessInfo_v2)
_processes("nvmlDeviceGetComputeRunningProcesses_v3", ProcessInfo_v2)


# ---------------------------------------------------------------- events


@symbol("nvmlEventSetCreate", P)
def _event_set_create(lib, out):
    event_set = model.nvmlEventSetCreate()
    address = EVENT_SET_BASE + len(lib._event_sets_made) * 16
    lib._event_sets_made.append(event_set)
    lib._event_sets[address] = event_set
    _out(out, c_void_p, address)


@symbol("nvmlDeviceRegisterEvents", P, ULL, P)
def _register(lib, device, types, event_set):
    model.nvmlDeviceRegisterEvents(lib.handle(device), types, lib.event_set(event_set))


@symbol("nvmlEventSetWait_v2", P, P, U)
def _wait(lib, event_set, out, timeout_ms):
    data = model.nvmlEventSetWait_v2(lib.event_set(event_set), timeout_ms)
    s = _struct(out, EventData)
    s.device, s.eventType, s.eventData = lib.address(data.device), data.eventType, data.eventData
    s.gpuInstanceId, s.computeInstanceId = data.gpuInstanceId, data.computeInstanceId


_SYMBOLS["nvmlEventSetWait"] = _SYMBOLS["nvmlEventSetWait_v2"]


@symbol("nvmlEventSetFree", P)
def _event_set_free(lib, event_set):
    model.nvmlEventSetFree(lib.event_set(event_set))
    lib._event_sets.pop(event_set or 0, None)


# ---------------------------------------------------------------- installing it under pynvml

library: FakeNvmlLibrary | None = None


def install() -> FakeNvmlLibrary:
    """Make pynvml load this library (a fresh one, with its call counts at zero)."""
    global library
    with pynvml.libLoadLock:
        library = FakeNvmlLibrary()
        pynvml.nvmlLib = library
        pynvml._nvmlGetFunctionPointer_cache.clear()
    return library


def uninstall() -> None:
    """Back to pynvml's own loading (a real libnvidia-ml.so.1, or LIBRARY_NOT_FOUND)."""
    global library
    with pynvml.libLoadLock:
        library = None
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()


def configure(spec: dict[str, Any] | None) -> FakeNvmlLibrary:
    """A machine booted with this spec (see sidecar.testing.fake_nvml), its library installed."""
    model.configure(spec)
    return install()


update = model.update
inject_xid = model.inject_xid


def __getattr__(name: str) -> Any:
    """Used as `collectors.nvml_module`, this module is pynvml over the fake library."""
    if library is None:
        install()
    return getattr(pynvml, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(pynvml)))
