"""Reading NVIDIA GPUs through NVML: the library session (imported by name, initialized once,
handles cached) and a reader that turns one device into a typed `GpuReading`.

The NVML module is nvidia-ml-py's `pynvml` or a module with its API (tests run the real pynvml
over `sidecar.testing.fake_nvml_lib`, a fake libnvidia-ml). What each outcome means:
- library or driver absent: no GPUs here, which is not a failure;
- nvmlInit failing otherwise (a driver/library mismatch after an upgrade): NVML is broken; it is
  logged once and reported as `broken` until an attempt succeeds (every RETRY_ABSENT_SECONDS);
- a field's error removes that field for that GPU (see nvml_fields), and a GPU is lost only on
  GPU_IS_LOST or when its handle cannot be had.

Utilization, memory, temperature, power, energy, clocks and processes are read every round
(10 NVML calls per GPU, 11 with a non-empty process list); error counters, thresholds, NVLink
and PCIe link health and the slow-moving rest (encoder/decoder load, PCIe throughput, memory
temperature, clock violation times) every HEALTH_SECONDS.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from sidecar.collectors.nvml_fields import DeviceReader, FieldStates, GpuLost, compute_processes_v1, reason_of

__all__ = ["GpuLost", "GpuReading", "NvmlSession", "NvLinkReading", "CLOCK_EVENT_REASONS", "VIOLATION_POLICIES"]

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

# nvmlPerfPolicyType_t: the violation-time counters of nvmlDeviceGetViolationStatus, which
# dcgm-exporter exports as DCGM_FI_DEV_<POLICY>_VIOLATION.
VIOLATION_POLICIES: tuple[tuple[str, int], ...] = (
    ("power", 0),
    ("thermal", 1),
    ("sync_boost", 2),
    ("board_limit", 3),
    ("low_utilization", 4),
    ("reliability", 5),
)

NVLINK_COUNTERS = (("replay", 0), ("recovery", 1), ("crc_flit", 2), ("crc_data", 3))  # NVML_NVLINK_ERROR_DL_*
MEMORY_V2 = 0x02000028  # nvmlMemory_v2: NVML_STRUCT_VERSION(Memory, 2)
FI_DEV_MEMORY_TEMP = 82  # NVML_FI_DEV_MEMORY_TEMP

RETRY_ABSENT_SECONDS = 60.0  # a driver may be loaded after the sidecar starts
HEALTH_SECONDS = 10.0  # error counters, link health and slow-moving fields are re-read this often at most

# GpuReading fields read by `_read_health`, kept between its reads.
HEALTH_FIELDS = (
    "slowdown_temperature_celsius",
    "shutdown_temperature_celsius",
    "ecc_corrected",
    "ecc_uncorrected",
    "ecc_volatile_corrected",
    "ecc_volatile_uncorrected",
    "retired_pages_single_bit",
    "retired_pages_double_bit",
    "retired_pages_pending",
    "remapped_rows",
    "pcie_replay",
    "pcie_link_generation",
    "pcie_link_width",
    "pcie_link_max_generation",
    "pcie_link_max_width",
    "nvlinks",
    "memory_temperature_celsius",
    "pcie_tx_bytes_per_second",
    "pcie_rx_bytes_per_second",
    "encoder_utilization_ratio",
    "decoder_utilization_ratio",
    "violation_seconds",
    "mig_mode",
)


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
    """One device's sample; None where a field is unavailable (why: `unavailable`)."""

    gpu: str
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    temperature_celsius: float | None = None
    memory_temperature_celsius: float | None = None
    slowdown_temperature_celsius: float | None = None
    shutdown_temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules: float | None = None
    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    clock_event_reasons: int | None = None  # bitmask, see CLOCK_EVENT_REASONS
    violation_seconds: dict[str, float] = field(default_factory=dict)  # policy -> time clocks were held down
    encoder_utilization_ratio: float | None = None
    decoder_utilization_ratio: float | None = None
    ecc_corrected: int | None = None  # aggregate: over the GPU's life
    ecc_uncorrected: int | None = None
    ecc_volatile_corrected: int | None = None  # volatile: since the driver was loaded
    ecc_volatile_uncorrected: int | None = None
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows: tuple[int, int, int, int] | None = None  # correctable, uncorrectable, pending, failed
    pcie_replay: int | None = None
    pcie_link_generation: int | None = None
    pcie_link_max_generation: int | None = None
    pcie_link_width: int | None = None
    pcie_link_max_width: int | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    mig_mode: int | None = None
    nvlinks: list[NvLinkReading] = field(default_factory=list)
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, used GPU memory bytes)
    unavailable: dict[str, str] = field(default_factory=dict)  # field -> reason (an NVML error, lower case)


class NvmlSession:
    """The NVML library for this process: imported and initialized on first use (in the
    collector's executor thread), retried when absent or broken, with device handles and the
    facts that never change (name, UUID, PCI bus id) cached."""

    def __init__(self, module_name: str = "pynvml", health_seconds: float = HEALTH_SECONDS):
        self.module_name = module_name
        self.health_seconds = health_seconds
        self._health: dict[int, tuple[float, dict[str, Any]]] = {}  # index -> (monotonic time, fields)
        self.nv: ModuleType | None = None
        self.handles: list[Any] = []
        self.static: dict[int, tuple[str, str, str]] = {}  # index -> (uuid, name, pci_bus_id)
        self.fields: dict[int, FieldStates] = {}
        self.generations: dict[str, list[tuple[str, Any]]] = {}
        self.driver_version = ""
        self.cuda_version = ""
        self.broken: str | None = None  # why NVML is present but unusable, until an attempt succeeds
        self.absent: str | None = None  # why there is no NVML (no library or driver), until an attempt succeeds
        self._next_attempt = 0.0
        self._absent_logged = False
        self._lock = threading.Lock()

    # -------------------------------------------------------------- session

    def start(self) -> bool:
        """True when NVML is initialized. False when the library or driver is absent, or when
        it is present but broken (`broken` says why); either is logged once, not every round."""
        with self._lock:
            if self.nv is not None:
                return True
            if time.monotonic() < self._next_attempt:
                return False
            self._next_attempt = time.monotonic() + RETRY_ABSENT_SECONDS
            try:
                nv = importlib.import_module(self.module_name)
            except ImportError as e:
                return self._absent(f"cannot import {self.module_name}: {e}")
            try:
                nv.nvmlInit()
            except (nv.NVMLError_LibraryNotFound, nv.NVMLError_DriverNotLoaded) as e:
                return self._absent(str(e))
            except Exception as e:  # NVMLError or pynvml's own (a library it cannot use)
                return self._broken(f"nvmlInit: {e}")
            try:
                count = nv.nvmlDeviceGetCount()
                self.driver_version = _text(nv.nvmlSystemGetDriverVersion())
                self.cuda_version = cuda_version_string(int(nv.nvmlSystemGetCudaDriverVersion()))
            except Exception as e:
                try:
                    nv.nvmlShutdown()
                except Exception:
                    pass
                return self._broken(f"NVML initialized but cannot list GPUs: {e}")
            if self.broken:
                log.info("NVML works again")
            self.broken = self.absent = None
            self.handles = [None] * count
            self.generations = call_generations(nv)
            self.nv = nv
            log.info("NVML: %d GPU(s), driver %s, CUDA %s", count, self.driver_version, self.cuda_version)
            return True

    def _absent(self, why: str) -> bool:
        self.absent = why
        if not self._absent_logged:
            log.info("no NVIDIA GPUs: %s (GPU metrics off; retried every %.0fs)", why, RETRY_ABSENT_SECONDS)
            self._absent_logged = True
        return False

    def _broken(self, why: str) -> bool:
        if why != self.broken:
            log.warning(
                "NVML is present but unusable: %s (GPU metrics off; retried every %.0fs)", why, RETRY_ABSENT_SECONDS
            )
        self.broken = why
        return False

    def close(self) -> None:
        with self._lock:
            if self.nv is not None:
                try:
                    self.nv.nvmlShutdown()
                except Exception:
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
            except Exception as e:
                raise GpuLost(f"gpu {index}: nvmlDeviceGetHandleByIndex: {e}") from None
        return self.handles[index]

    # -------------------------------------------------------------- reading

    def read(self, index: int) -> GpuReading:
        """Sample one device. Raises GpuLost when the device is unusable."""
        nv = self.nv
        assert nv is not None
        handle = self.handle(index)
        r = GpuReading(gpu=str(index))
        states = self.fields.setdefault(index, FieldStates())
        d = DeviceReader(nv, handle, r.gpu, states)
        try:
            self._read_static(index, d, r)
            self._read_fast(d, r)
            self._read_health(index, d, r)
        except GpuLost:
            self._health.pop(index, None)
            self.handles[index] = None  # a GPU that comes back after a reset gets a new handle
            raise
        r.unavailable = states.reported()
        return r

    def log_field_changes(self) -> None:
        """One log line for the fields that became unavailable (or readable again) since the last
        call, across all GPUs: a field failing on 8 GPUs is one line, not 8, and not one a round."""
        gone: dict[tuple[str, str], list[str]] = {}
        back: dict[str, list[str]] = {}
        for index, states in sorted(self.fields.items()):
            for key, u in states.newly_unavailable:
                gone.setdefault((key, u.reason), []).append(str(index))
            for key in states.recovered:
                back.setdefault(key, []).append(str(index))
            states.newly_unavailable.clear()
            states.recovered.clear()
        if gone:
            level = logging.INFO if all(reason == "not_supported" for _, reason in gone) else logging.WARNING
            log.log(
                level,
                "NVML does not give %s; asked again later (see sidecar_gpu_field_unavailable)",
                "; ".join(f"{key} ({reason}) on gpu {','.join(gpus)}" for (key, reason), gpus in gone.items()),
            )
        if back:
            log.info("NVML gives again %s", "; ".join(f"{key} on gpu {','.join(gpus)}" for key, gpus in back.items()))

    def _read_fast(self, d: DeviceReader, r: GpuReading) -> None:
        """What changes from one second to the next."""
        nv = d.nv
        util = d.call("utilization", "nvmlDeviceGetUtilizationRates")
        if util is not None:
            r.utilization_ratio, r.memory_utilization_ratio = util.gpu / 100.0, util.memory / 100.0
        g = self.generations
        mem = d.first("memory", g["memory"])
        if mem is not None:
            r.memory_used_bytes, r.memory_total_bytes = int(mem.used), int(mem.total)
            r.memory_free_bytes = int(mem.free)
            reserved = getattr(mem, "reserved", None)
            r.memory_reserved_bytes = None if reserved is None else int(reserved)
            if reserved is None:  # nvmlMemory_v1: the driver's reservation is counted in used
                d.states.failed("memory_reserved", "function_not_found", "no nvmlDeviceGetMemoryInfo_v2", d.now)
            else:
                d.states.succeeded("memory_reserved")
        r.temperature_celsius = d.first("temperature", g["temperature"], nv.NVML_TEMPERATURE_GPU)
        r.power_watts = _scaled(d.call("power", "nvmlDeviceGetPowerUsage"), 1e-3)
        r.power_limit_watts = _scaled(d.call("power_limit", "nvmlDeviceGetEnforcedPowerLimit"), 1e-3)
        r.energy_joules = _scaled(d.call("energy", "nvmlDeviceGetTotalEnergyConsumption"), 1e-3)
        r.sm_clock_hertz = _scaled(d.call("sm_clock", "nvmlDeviceGetClockInfo", nv.NVML_CLOCK_SM), 1e6)
        r.memory_clock_hertz = _scaled(d.call("memory_clock", "nvmlDeviceGetClockInfo", nv.NVML_CLOCK_MEM), 1e6)
        r.clock_event_reasons = d.first("clock_event_reasons", g["clock_event_reasons"])
        r.processes = self._processes(d)

    def processes(self, index: int) -> list[tuple[int, int]]:
        """Only the compute processes of one device, (pid, used GPU memory bytes): what the XID
        source reads where dcgm-exporter exports the GPU metrics. Raises GpuLost."""
        nv = self.nv
        assert nv is not None
        try:
            return self._processes(
                DeviceReader(nv, self.handle(index), str(index), self.fields.setdefault(index, FieldStates()))
            )
        except GpuLost:
            self.handles[index] = None
            raise

    def _processes(self, d: DeviceReader) -> list[tuple[int, int]]:
        procs = d.first("processes", self.generations["processes"]) or []
        return [
            (int(p.pid), int(p.usedGpuMemory))
            for p in procs
            if p.usedGpuMemory is not None and p.usedGpuMemory != NOT_AVAILABLE_ULL
        ]

    def _read_health(self, index: int, d: DeviceReader, r: GpuReading) -> None:
        """Error counters, thresholds, link health and the slow-moving fields: read at most every
        `health_seconds` (about 120 NVML calls per GPU with NVLink); reused in between."""
        cached = self._health.get(index)
        if cached is not None and d.now - cached[0] < self.health_seconds:
            for name, value in cached[1].items():
                setattr(r, name, value)
            return
        nv = d.nv
        self._check_mig_mode(d, r)
        r.slowdown_temperature_celsius = d.call(
            "slowdown_temperature", "nvmlDeviceGetTemperatureThreshold", nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        )
        r.shutdown_temperature_celsius = d.call(
            "shutdown_temperature", "nvmlDeviceGetTemperatureThreshold", nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
        )
        r.memory_temperature_celsius = self._memory_temperature(d)
        for attr, kind, counter in (
            ("ecc_corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC),
            ("ecc_uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC),
            ("ecc_volatile_corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
            ("ecc_volatile_uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
        ):
            setattr(r, attr, d.call(attr, "nvmlDeviceGetTotalEccErrors", kind, counter))
        single = d.call(
            "retired_pages_single_bit",
            "nvmlDeviceGetRetiredPages",
            nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
        )
        double = d.call(
            "retired_pages_double_bit", "nvmlDeviceGetRetiredPages", nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
        )
        r.retired_pages_single_bit = None if single is None else len(single)
        r.retired_pages_double_bit = None if double is None else len(double)
        pending = d.call("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus")
        r.retired_pages_pending = None if pending is None else bool(pending)
        rows = d.call("remapped_rows", "nvmlDeviceGetRemappedRows")
        r.remapped_rows = None if rows is None else tuple(int(x) for x in rows)  # type: ignore[assignment]
        r.pcie_replay = d.call("pcie_replay", "nvmlDeviceGetPcieReplayCounter")
        # The current link drops its generation at idle to save power; a degraded link lasts minutes.
        r.pcie_link_generation = d.call("pcie_link_generation", "nvmlDeviceGetCurrPcieLinkGeneration")
        r.pcie_link_width = d.call("pcie_link_width", "nvmlDeviceGetCurrPcieLinkWidth")
        r.pcie_link_max_generation = d.call("pcie_link_max_generation", "nvmlDeviceGetMaxPcieLinkGeneration")
        r.pcie_link_max_width = d.call("pcie_link_max_width", "nvmlDeviceGetMaxPcieLinkWidth")
        # Each throughput call samples the link for about 20 ms: slow-moving, not every round.
        r.pcie_tx_bytes_per_second = _scaled(
            d.call("pcie_tx_throughput", "nvmlDeviceGetPcieThroughput", nv.NVML_PCIE_UTIL_TX_BYTES), 1024.0
        )
        r.pcie_rx_bytes_per_second = _scaled(
            d.call("pcie_rx_throughput", "nvmlDeviceGetPcieThroughput", nv.NVML_PCIE_UTIL_RX_BYTES), 1024.0
        )
        encoder = d.call("encoder_utilization", "nvmlDeviceGetEncoderUtilization")
        r.encoder_utilization_ratio = None if encoder is None else encoder[0] / 100.0
        decoder = d.call("decoder_utilization", "nvmlDeviceGetDecoderUtilization")
        r.decoder_utilization_ratio = None if decoder is None else decoder[0] / 100.0
        r.violation_seconds = {}
        for policy, code in VIOLATION_POLICIES:
            v = d.call(f"violation_{policy}", "nvmlDeviceGetViolationStatus", code)
            if v is not None:
                r.violation_seconds[policy] = int(v.violationTime) * 1e-9
        r.nvlinks = self._nvlinks(d)
        self._health[index] = (d.now, {name: getattr(r, name) for name in HEALTH_FIELDS})

    @staticmethod
    def _check_mig_mode(d: DeviceReader, r: GpuReading) -> None:
        """What a GPU supports changes with its MIG mode: on a change, every field is asked again."""
        mode = d.call("mig_mode", "nvmlDeviceGetMigMode", reported=False)  # no MIG on this board: no news
        r.mig_mode = None if mode is None else int(mode[0])
        states = d.states
        if r.mig_mode is not None and states.mig_mode is not None and r.mig_mode != states.mig_mode:
            log.info(
                "gpu %s: MIG mode is now %s; asking NVML again for every field", r.gpu, "on" if r.mig_mode else "off"
            )
            states.reset()
        if r.mig_mode is not None:
            states.mig_mode = r.mig_mode

    @staticmethod
    def _memory_temperature(d: DeviceReader) -> float | None:
        values = d.call("memory_temperature", "nvmlDeviceGetFieldValues", [FI_DEV_MEMORY_TEMP])
        if values is None:
            return None
        entry = values[0]
        if entry.nvmlReturn != d.nv.NVML_SUCCESS:  # the field's own answer, e.g. NOT_SUPPORTED on GDDR boards
            d.states.failed(
                "memory_temperature",
                _field_reason(d.nv, entry.nvmlReturn),
                f"NVML_FI_DEV_MEMORY_TEMP: {entry.nvmlReturn}",
                d.now,
            )
            return None
        return float(_field_number(entry))

    def _read_static(self, index: int, d: DeviceReader, r: GpuReading) -> None:
        if index not in self.static:
            uuid, name, pci = (
                d.call("uuid", "nvmlDeviceGetUUID"),
                d.call("name", "nvmlDeviceGetName"),
                d.call("pci_bus_id", "nvmlDeviceGetPciInfo"),
            )
            facts = (_text(uuid or ""), _text(name or ""), _text(pci.busId) if pci is not None else "")
            if uuid is None or name is None or pci is None:
                r.uuid, r.name, r.pci_bus_id = facts  # asked again when its retry is due
                return
            self.static[index] = facts
        r.uuid, r.name, r.pci_bus_id = self.static[index]

    @staticmethod
    def _nvlinks(d: DeviceReader) -> list[NvLinkReading]:
        nv = d.nv
        links = []
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            # A link the board does not have answers NOT_SUPPORTED: not worth a report.
            state = d.call(f"nvlink{link}", "nvmlDeviceGetNvLinkState", link, reported=False)
            if state is None:
                continue
            reading = NvLinkReading(link, up=state == nv.NVML_FEATURE_ENABLED)
            for counter, code in NVLINK_COUNTERS:
                value = d.call(f"nvlink_{counter}_errors", "nvmlDeviceGetNvLinkErrorCounter", link, code)
                if value is not None:
                    reading.errors[counter] = int(value)
            links.append(reading)
        return links


NOT_AVAILABLE_ULL = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE for unsigned long long fields


def call_generations(nv: ModuleType) -> dict[str, list[tuple[str, Any]]]:
    """The fields read through more than one generation of an NVML call, newest first (the
    reader keeps, per GPU, the first generation the driver has)."""

    def the(name: str) -> tuple[str, Any]:
        return name, getattr(nv, name, None)

    memory_info = getattr(nv, "nvmlDeviceGetMemoryInfo", None)
    memory_v2 = None if memory_info is None else (lambda handle: memory_info(handle, version=MEMORY_V2))
    return {
        "memory": [("nvmlDeviceGetMemoryInfo_v2", memory_v2), the("nvmlDeviceGetMemoryInfo")],
        "temperature": [
            the("nvmlDeviceGetTemperature"),
            ("nvmlDeviceGetTemperatureV", getattr(nv, "nvmlDeviceGetTemperatureV1", None)),
        ],
        # The "event" name replaced "throttle" in NVML 12.2; old drivers only know the latter.
        "clock_event_reasons": [
            the("nvmlDeviceGetCurrentClocksEventReasons"),
            the("nvmlDeviceGetCurrentClocksThrottleReasons"),
        ],
        # pynvml's unversioned wrapper calls _v3; drivers before R510 have _v2 or only the unversioned symbol.
        "processes": [
            the("nvmlDeviceGetComputeRunningProcesses_v3"),
            the("nvmlDeviceGetComputeRunningProcesses_v2"),
            ("nvmlDeviceGetComputeRunningProcesses", compute_processes_v1(nv)),
        ],
    }


def _field_reason(nv: ModuleType, code: int) -> str:
    return reason_of(nv, nv.NVMLError(code))


def _field_number(entry: Any) -> float:
    """An nvmlFieldValue_t's value by its valueType (NVML_VALUE_TYPE_*)."""
    member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
    return getattr(entry.value, member.get(int(entry.valueType), "uiVal"))


def _scaled(value: Any, factor: float) -> float | None:
    return None if value is None else value * factor
