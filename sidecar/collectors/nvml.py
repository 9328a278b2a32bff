"""Reading NVIDIA GPUs through NVML: the library session (imported by name, initialized once,
handles cached) and a reader that turns one device into a typed `GpuReading`.

The NVML module is nvidia-ml-py's `pynvml` or any module with its API (tests use
`sidecar.testing.fake_nvml`). Errors follow NVML's meaning:
- library or driver absent: no GPUs here, which is not a failure;
- NOT_SUPPORTED / FUNCTION_NOT_FOUND for a field: this board has no such field; it is skipped
  and not asked again in this session;
- GPU_IS_LOST / UNKNOWN on a device: the device is unusable; it is skipped this round;
- anything else on a field: that field failed; the others are still read.

Utilization, memory, power, clocks and processes are read every round; error counters,
thresholds and NVLink health (most of the calls, values that rarely move) every HEALTH_SECONDS.
"""
from __future__ import annotations

import importlib
import logging
import threading
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

# nvmlClocksEventReason* bits (nvml.h; the same values as the older ClocksThrottleReason names).
CLOCK_EVENT_REASONS: tuple[tuple[str, int], ...] = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)

NVLINK_COUNTERS = (("replay", 0), ("recovery", 1), ("crc_flit", 2), ("crc_data", 3))  # NVML_NVLINK_ERROR_DL_*

RETRY_ABSENT_SECONDS = 60.0  # a driver may be loaded after the sidecar starts
HEALTH_SECONDS = 10.0  # error counters and link health are re-read this often at most

# GpuReading fields read by `_read_health`, kept between its reads.
HEALTH_FIELDS = ("slowdown_temperature_celsius", "shutdown_temperature_celsius", "ecc_corrected",
                 "ecc_uncorrected", "retired_pages_single_bit", "retired_pages_double_bit",
                 "retired_pages_pending", "remapped_rows", "pcie_replay", "pcie_link_max_generation",
                 "pcie_link_max_width", "nvlinks")


class NvmlBroken(Exception):
    """NVML is installed but unusable (e.g. a driver/library version mismatch after an upgrade)."""


class GpuLost(Exception):
    """The device answered GPU_IS_LOST or UNKNOWN: nothing it reports can be trusted."""


def cuda_version_string(version: int) -> str:
    """NVML's integer CUDA driver version (12040) as "12.4"."""
    return f"{version // 1000}.{version % 1000 // 10}"


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


@dataclass
class NvLinkReading:
    link: int
    up: bool | None = None
    errors: dict[str, int] = field(default_factory=dict)  # counter name -> count


@dataclass
class GpuReading:
    """One device's sample; None where the board does not support a field or reading it failed."""

    gpu: str
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: float | None = None
    slowdown_temperature_celsius: float | None = None
    shutdown_temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules: float | None = None
    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    clock_event_reasons: int | None = None  # bitmask, see CLOCK_EVENT_REASONS
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows: tuple[int, int, int, int] | None = None  # correctable, uncorrectable, pending, failed
    pcie_replay: int | None = None
    pcie_link_generation: int | None = None
    pcie_link_max_generation: int | None = None
    pcie_link_width: int | None = None
    pcie_link_max_width: int | None = None
    nvlinks: list[NvLinkReading] = field(default_factory=list)
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, used GPU memory bytes)
    errors: list[str] = field(default_factory=list)  # fields that failed this round


class _DeviceReader:
    """Calls NVML for one device, sorting errors into skipped, failed and lost."""

    def __init__(self, nv: ModuleType, handle: Any, reading: GpuReading, unsupported: set[str]):
        self.nv, self.handle, self.reading, self.unsupported = nv, handle, reading, unsupported

    def call(self, function: str, *args: Any, key: str | None = None) -> Any:
        key = key or function
        if key in self.unsupported:
            return None
        fn = getattr(self.nv, function, None)
        if fn is None:  # an older nvidia-ml-py: the same as an unsupported field
            self.unsupported.add(key)
            return None
        nv = self.nv
        try:
            return fn(self.handle, *args)
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
            self.unsupported.add(key)
        except (nv.NVMLError_GpuIsLost, nv.NVMLError_Unknown) as e:
            raise GpuLost(f"gpu {self.reading.gpu}: {function}: {e}") from None
        except nv.NVMLError as e:
            self.reading.errors.append(f"{function}: {e}")
        return None


class NvmlSession:
    """The NVML library for this process: imported and initialized on first use (in the
    collector's executor thread), retried when absent, with device handles and the facts that
    never change (name, UUID, PCI bus id) cached."""

    def __init__(self, module_name: str = "pynvml", health_seconds: float = HEALTH_SECONDS):
        self.module_name = module_name
        self.health_seconds = health_seconds
        self._health: dict[int, tuple[float, dict[str, Any]]] = {}  # index -> (monotonic time, fields)
        self.nv: ModuleType | None = None
        self.handles: list[Any] = []
        self.static: dict[int, tuple[str, str, str]] = {}  # index -> (uuid, name, pci_bus_id)
        self.unsupported: dict[int, set[str]] = {}
        self.driver_version = ""
        self.cuda_version = ""
        self._next_attempt = 0.0
        self._absent_logged = False
        self._broken: str | None = None  # why NVML is present but unusable, until the next attempt
        self._lock = threading.Lock()

    # -------------------------------------------------------------- session

    def start(self) -> bool:
        """True when NVML is initialized. False (and logged once) when the library or driver is
        absent. Any other init failure raises: NVML is there but broken, which is worth a page."""
        with self._lock:
            if self.nv is not None:
                return True
            if time.monotonic() < self._next_attempt:
                if self._broken:  # keep reporting the failure until the next attempt
                    raise NvmlBroken(self._broken)
                return False
            self._next_attempt = time.monotonic() + RETRY_ABSENT_SECONDS
            self._broken = None
            try:
                nv = importlib.import_module(self.module_name)
            except ImportError as e:
                return self._absent(f"cannot import {self.module_name}: {e}")
            try:
                nv.nvmlInit()
            except (nv.NVMLError_LibraryNotFound, nv.NVMLError_DriverNotLoaded) as e:
                return self._absent(str(e))
            except nv.NVMLError as e:
                self._broken = f"nvmlInit: {e}"
                raise NvmlBroken(self._broken) from None
            try:
                count = nv.nvmlDeviceGetCount()
                self.driver_version = _text(nv.nvmlSystemGetDriverVersion())
                self.cuda_version = cuda_version_string(int(nv.nvmlSystemGetCudaDriverVersion()))
            except nv.NVMLError as e:
                nv.nvmlShutdown()
                self._broken = f"NVML initialized but cannot list GPUs: {e}"
                raise NvmlBroken(self._broken) from None
            self.handles = [None] * count
            self.nv = nv
            log.info("NVML: %d GPU(s), driver %s, CUDA %s", count, self.driver_version, self.cuda_version)
            return True

    def _absent(self, why: str) -> bool:
        if not self._absent_logged:
            log.info("no NVIDIA GPUs: %s (GPU metrics off; retried every %.0fs)", why, RETRY_ABSENT_SECONDS)
            self._absent_logged = True
        return False

    def close(self) -> None:
        with self._lock:
            if self.nv is not None:
                try:
                    self.nv.nvmlShutdown()
                except self.nv.NVMLError:
                    pass
                self.nv = None

    @property
    def count(self) -> int:
        return len(self.handles)

    def handle(self, index: int) -> Any:
        """The cached handle; fetched again while a device keeps failing to give one."""
        nv = self.nv
        assert nv is not None
        if self.handles[index] is None:
            try:
                self.handles[index] = nv.nvmlDeviceGetHandleByIndex(index)
            except nv.NVMLError as e:
                raise GpuLost(f"gpu {index}: nvmlDeviceGetHandleByIndex: {e}") from None
        return self.handles[index]

    # -------------------------------------------------------------- reading

    def read(self, index: int) -> GpuReading:
        """Sample one device. Raises GpuLost when the device is unusable."""
        nv = self.nv
        assert nv is not None
        handle = self.handle(index)
        r = GpuReading(gpu=str(index))
        d = _DeviceReader(nv, handle, r, self.unsupported.setdefault(index, set()))
        try:
            self._read_static(index, d)
            self._read_fast(d)
            self._read_health(index, d)
        except GpuLost:
            self._health.pop(index, None)
            raise
        return r

    @staticmethod
    def _read_fast(d: _DeviceReader) -> None:
        """What changes from one second to the next."""
        nv, r = d.nv, d.reading
        util = d.call("nvmlDeviceGetUtilizationRates")
        if util is not None:
            r.utilization_ratio, r.memory_utilization_ratio = util.gpu / 100.0, util.memory / 100.0
        mem = d.call("nvmlDeviceGetMemoryInfo")
        if mem is not None:
            r.memory_used_bytes, r.memory_total_bytes = int(mem.used), int(mem.total)
        r.temperature_celsius = d.call("nvmlDeviceGetTemperature", nv.NVML_TEMPERATURE_GPU)
        r.power_watts = _scaled(d.call("nvmlDeviceGetPowerUsage"), 1e-3)
        r.power_limit_watts = _scaled(d.call("nvmlDeviceGetEnforcedPowerLimit"), 1e-3)
        r.energy_joules = _scaled(d.call("nvmlDeviceGetTotalEnergyConsumption"), 1e-3)
        r.sm_clock_hertz = _scaled(d.call("nvmlDeviceGetClockInfo", nv.NVML_CLOCK_SM, key="clock_sm"), 1e6)
        r.memory_clock_hertz = _scaled(d.call("nvmlDeviceGetClockInfo", nv.NVML_CLOCK_MEM, key="clock_mem"), 1e6)
        r.clock_event_reasons = NvmlSession._clock_event_reasons(d)
        r.pcie_link_generation = d.call("nvmlDeviceGetCurrPcieLinkGeneration")  # drops at idle to save power
        r.pcie_link_width = d.call("nvmlDeviceGetCurrPcieLinkWidth")
        procs = d.call("nvmlDeviceGetComputeRunningProcesses") or []
        r.processes = [(int(p.pid), int(p.usedGpuMemory)) for p in procs if p.usedGpuMemory is not None]

    def _read_health(self, index: int, d: _DeviceReader) -> None:
        """Error counters, thresholds and link health: read at most every `health_seconds` (about
        120 NVML calls per GPU with NVLink, which rarely change); reused in between."""
        cached = self._health.get(index)
        if cached is not None and time.monotonic() - cached[0] < self.health_seconds:
            for name, value in cached[1].items():
                setattr(d.reading, name, value)
            return
        nv, r = d.nv, d.reading
        errors_before = len(r.errors)
        r.slowdown_temperature_celsius = d.call("nvmlDeviceGetTemperatureThreshold",
                                                nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN, key="threshold_slowdown")
        r.shutdown_temperature_celsius = d.call("nvmlDeviceGetTemperatureThreshold",
                                                nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN, key="threshold_shutdown")
        r.ecc_corrected = d.call("nvmlDeviceGetTotalEccErrors", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                 nv.NVML_AGGREGATE_ECC, key="ecc_corrected")
        r.ecc_uncorrected = d.call("nvmlDeviceGetTotalEccErrors", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                   nv.NVML_AGGREGATE_ECC, key="ecc_uncorrected")
        single = d.call("nvmlDeviceGetRetiredPages", nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                        key="retired_single")
        double = d.call("nvmlDeviceGetRetiredPages", nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
                        key="retired_double")
        r.retired_pages_single_bit = None if single is None else len(single)
        r.retired_pages_double_bit = None if double is None else len(double)
        pending = d.call("nvmlDeviceGetRetiredPagesPendingStatus")
        r.retired_pages_pending = None if pending is None else bool(pending)
        rows = d.call("nvmlDeviceGetRemappedRows")
        r.remapped_rows = None if rows is None else tuple(int(x) for x in rows)  # type: ignore[assignment]
        r.pcie_replay = d.call("nvmlDeviceGetPcieReplayCounter")
        r.pcie_link_max_generation = d.call("nvmlDeviceGetMaxPcieLinkGeneration")
        r.pcie_link_max_width = d.call("nvmlDeviceGetMaxPcieLinkWidth")
        r.nvlinks = self._nvlinks(d)
        if len(r.errors) == errors_before:  # a failed field is asked again next round
            self._health[index] = (time.monotonic(), {name: getattr(r, name) for name in HEALTH_FIELDS})

    def _read_static(self, index: int, d: _DeviceReader) -> None:
        if index not in self.static:
            uuid, name, pci = d.call("nvmlDeviceGetUUID"), d.call("nvmlDeviceGetName"), d.call("nvmlDeviceGetPciInfo")
            if d.reading.errors:
                return  # try again next round rather than cache a half answer
            self.static[index] = (_text(uuid or ""), _text(name or ""), _text(pci.busId) if pci is not None else "")
        d.reading.uuid, d.reading.name, d.reading.pci_bus_id = self.static[index]

    @staticmethod
    def _clock_event_reasons(d: _DeviceReader) -> int | None:
        # The "event" name replaced "throttle" in NVML 12.2; old drivers only know the latter.
        value = d.call("nvmlDeviceGetCurrentClocksEventReasons")
        if value is None and "nvmlDeviceGetCurrentClocksEventReasons" in d.unsupported:
            value = d.call("nvmlDeviceGetCurrentClocksThrottleReasons")
        return value

    @staticmethod
    def _nvlinks(d: _DeviceReader) -> list[NvLinkReading]:
        nv = d.nv
        links = []
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            key = f"nvlink{link}"
            if key in d.unsupported:
                continue
            try:
                state = nv.nvmlDeviceGetNvLinkState(d.handle, link)
            except (nv.NVMLError_NotSupported, nv.NVMLError_InvalidArgument, nv.NVMLError_FunctionNotFound):
                # The board has no such link: asked once per session, never again.
                d.unsupported.add(key)
                continue
            except (nv.NVMLError_GpuIsLost, nv.NVMLError_Unknown) as e:
                raise GpuLost(f"gpu {d.reading.gpu}: nvmlDeviceGetNvLinkState: {e}") from None
            except nv.NVMLError as e:
                d.reading.errors.append(f"nvmlDeviceGetNvLinkState({link}): {e}")
                continue
            reading = NvLinkReading(link, up=state == nv.NVML_FEATURE_ENABLED)
            for counter, code in NVLINK_COUNTERS:
                value = d.call("nvmlDeviceGetNvLinkErrorCounter", link, code, key=f"nvlink{link}_{counter}")
                if value is not None:
                    reading.errors[counter] = int(value)
            links.append(reading)
        return links


def _scaled(value: Any, factor: float) -> float | None:
    return None if value is None else value * factor
