"""GPU metrics from NVML: utilization, memory, temperature, power and energy, clocks and why they
are held down, memory errors (ECC, retired pages, remapped rows), PCIe and NVLink health, XID
events, and the GPU memory each registered rank holds (verified ranks only: an unverified TCP
registration names whatever pid it likes, so it is attributed no GPU memory).

No NVIDIA library or driver means no GPU series and a successful collector: absent hardware is
not a failure. NVML present but broken (nvmlInit fails otherwise) is a failed run, logged once.
A lost GPU (GPU_IS_LOST, or no handle) is skipped (its `sidecar_gpu_lost` is 1) and the run
reports a partial failure while the other GPUs are exported. A field NVML does not give for a
GPU (unsupported, no permission, not ready, ...) only lacks its series, and
`sidecar_gpu_field_unavailable` says which and why. Error counters, link health and slow-moving
fields are refreshed every 10 s (nvml.HEALTH_SECONDS), the rest every collector round."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from sidecar.collectors.base import BuildContext, PartialFailure
from sidecar.collectors.gpu_events import RankGpus, memory_by_pid, owners_of, rank_gpus, start_xid_watcher
from sidecar.collectors.gpu_fitness import GpuFitness
from sidecar.collectors.nvml import CLOCK_EVENT_REASONS, VIOLATION_POLICIES, GpuLost, GpuReading, NvmlSession
from sidecar.collectors.ranktree import RankRef, RanksFn
from sidecar.collectors.xid import XidWatcher
from sidecar.metric import spec

NAME = "gpu"
GPU_LABELS = ("gpu",)

INFO = spec(NAME, "gpu", "info", "GPU identity; value 1.", ["gpu", "uuid", "name", "pci_bus_id"])
LOST = spec(
    NAME,
    "gpu_lost",
    "gauge",
    "1 when NVML reports the GPU lost or in an unknown state (its other series are absent).",
    GPU_LABELS,
)
UTILIZATION = spec(
    NAME,
    "gpu_utilization_ratio",
    "gauge",
    "Share of the last sample period in which a kernel ran on the GPU.",
    GPU_LABELS,
)
MEMORY_UTILIZATION = spec(
    NAME,
    "gpu_memory_utilization_ratio",
    "gauge",
    "Share of the last sample period in which device memory was read or written.",
    GPU_LABELS,
)
MEMORY_USED = spec(NAME, "gpu_memory_used_bytes", "gauge", "Device memory in use.", GPU_LABELS)
MEMORY_TOTAL = spec(NAME, "gpu_memory_total_bytes", "gauge", "Device memory installed.", GPU_LABELS)
MEMORY_FREE = spec(NAME, "gpu_memory_free_bytes", "gauge", "Device memory free (DCGM_FI_DEV_FB_FREE).", GPU_LABELS)
MEMORY_RESERVED = spec(
    NAME,
    "gpu_memory_reserved_bytes",
    "gauge",
    "Device memory the driver reserves for itself (DCGM_FI_DEV_FB_RESERVED; drivers whose "
    "NVML has no nvmlMemory_v2 count it in used).",
    GPU_LABELS,
)
TEMPERATURE = spec(NAME, "gpu_temperature_celsius", "gauge", "GPU core temperature.", GPU_LABELS)
MEMORY_TEMPERATURE = spec(
    NAME,
    "gpu_memory_temperature_celsius",
    "gauge",
    "Device memory (HBM) temperature, refreshed every 10 s.",
    GPU_LABELS,
)
SLOWDOWN_TEMPERATURE = spec(
    NAME, "gpu_slowdown_temperature_celsius", "gauge", "Temperature at which the GPU slows its clocks.", GPU_LABELS
)
SHUTDOWN_TEMPERATURE = spec(
    NAME, "gpu_shutdown_temperature_celsius", "gauge", "Temperature at which the GPU shuts down.", GPU_LABELS
)
POWER = spec(NAME, "gpu_power_watts", "gauge", "Board power draw.", GPU_LABELS)
POWER_LIMIT = spec(NAME, "gpu_power_limit_watts", "gauge", "Enforced board power limit.", GPU_LABELS)
ENERGY = spec(NAME, "gpu_energy_joules", "counter", "Energy used since the driver was loaded.", GPU_LABELS)
SM_CLOCK = spec(NAME, "gpu_sm_clock_hertz", "gauge", "Current SM clock.", GPU_LABELS)
MEMORY_CLOCK = spec(NAME, "gpu_memory_clock_hertz", "gauge", "Current memory clock.", GPU_LABELS)
CLOCK_EVENT = spec(
    NAME,
    "gpu_clock_event_active",
    "gauge",
    "1 while this reason holds the clocks down (NVML clock event reasons; "
    "hw_slowdown, *_thermal_slowdown and hw_power_brake_slowdown cost throughput).",
    ["gpu", "reason"],
)
CLOCK_VIOLATION = spec(
    NAME,
    "gpu_clock_violation_seconds",
    "counter",
    "Time the clocks were held below their target by this policy (NVML violation counters: "
    "power, thermal, sync_boost, board_limit, low_utilization, reliability), refreshed every 10 s.",
    ["gpu", "policy"],
)
ENCODER_UTILIZATION = spec(
    NAME,
    "gpu_encoder_utilization_ratio",
    "gauge",
    "Share of time the video encoder was busy, refreshed every 10 s.",
    GPU_LABELS,
)
DECODER_UTILIZATION = spec(
    NAME,
    "gpu_decoder_utilization_ratio",
    "gauge",
    "Share of time the video decoder was busy, refreshed every 10 s.",
    GPU_LABELS,
)
ECC_ERRORS = spec(
    NAME,
    "gpu_ecc_errors",
    "counter",
    "ECC errors over the GPU's lifetime (aggregate counters), by type.",
    ["gpu", "type"],
)
ECC_VOLATILE_ERRORS = spec(
    NAME,
    "gpu_ecc_volatile_errors",
    "counter",
    "ECC errors since the driver was last loaded (volatile counters), by type.",
    ["gpu", "type"],
)
RETIRED_PAGES = spec(
    NAME, "gpu_retired_pages", "gauge", "Device memory pages retired (pre-Ampere), by cause.", ["gpu", "cause"]
)
RETIRED_PAGES_PENDING = spec(
    NAME, "gpu_retired_pages_pending", "gauge", "1 when a page retirement waits for the next driver reload.", GPU_LABELS
)
REMAPPED_ROWS = spec(
    NAME,
    "gpu_remapped_rows",
    "gauge",
    "Memory rows remapped (Ampere and later), by the error that caused it.",
    ["gpu", "type"],
)
REMAPPED_ROWS_PENDING = spec(
    NAME, "gpu_remapped_rows_pending", "gauge", "1 when a row remap waits for a GPU reset.", GPU_LABELS
)
REMAPPED_ROWS_FAILED = spec(
    NAME, "gpu_remapped_rows_failed", "gauge", "1 when a row remap failed: the GPU needs service.", GPU_LABELS
)
PCIE_REPLAY = spec(NAME, "gpu_pcie_replay", "counter", "PCIe replays (link-level retransmissions).", GPU_LABELS)
PCIE_GEN = spec(
    NAME,
    "gpu_pcie_link_generation",
    "gauge",
    "Current PCIe link generation (lower at idle to save power), refreshed every 10 s.",
    GPU_LABELS,
)
PCIE_MAX_GEN = spec(NAME, "gpu_pcie_link_max_generation", "gauge", "Highest PCIe link generation.", GPU_LABELS)
PCIE_WIDTH = spec(
    NAME, "gpu_pcie_link_width", "gauge", "Current PCIe link width (lanes), refreshed every 10 s.", GPU_LABELS
)
PCIE_MAX_WIDTH = spec(NAME, "gpu_pcie_link_max_width", "gauge", "Widest PCIe link (lanes).", GPU_LABELS)
PCIE_THROUGHPUT = spec(
    NAME,
    "gpu_pcie_throughput_bytes_per_second",
    "gauge",
    "PCIe traffic over a 20 ms NVML sample, by direction (transmit, receive), refreshed every 10 s.",
    ["gpu", "direction"],
)
NVLINK_UP = spec(NAME, "gpu_nvlink_up", "gauge", "1 when the NVLink link is active.", ["gpu", "link"])
NVLINK_ERRORS = spec(
    NAME,
    "gpu_nvlink_errors",
    "counter",
    "NVLink data-link errors, by type (replay, recovery, crc_flit, crc_data).",
    ["gpu", "link", "type"],
)
XID_ERRORS = spec(
    NAME,
    "gpu_xid_errors",
    "counter",
    "XID events reported by the driver since the sidecar started, by XID "
    "(gpu is empty for an event the driver did not attribute to a GPU).",
    ["gpu", "xid"],
)
LAST_XID = spec(NAME, "gpu_last_xid", "gauge", "The most recent XID on this GPU, 0 when none was seen.", GPU_LABELS)
LAST_XID_TIME = spec(
    NAME,
    "gpu_last_xid_timestamp_seconds",
    "gauge",
    "When the most recent XID on this GPU arrived (Unix time).",
    GPU_LABELS,
)
PROCESS_MEMORY = spec(
    NAME,
    "gpu_process_memory_bytes",
    "gauge",
    "Device memory held by a registered rank and its child processes.",
    ["gpu", "job_id", "rank"],
)
FIELD_UNAVAILABLE = spec(
    NAME,
    "gpu_field_unavailable",
    "gauge",
    "1 while NVML does not give this field of this GPU, with the reason (the NVML error in "
    "lower case: not_supported, function_not_found, no_permission, not_ready, unknown, ...). "
    "The field's series are absent meanwhile. It is asked again after 10 minutes "
    "(not supported) or 1 minute (other errors), and after a MIG mode change.",
    ["gpu", "field", "reason"],
)

METRICS = (
    INFO,
    LOST,
    FIELD_UNAVAILABLE,
    UTILIZATION,
    MEMORY_UTILIZATION,
    MEMORY_USED,
    MEMORY_TOTAL,
    MEMORY_FREE,
    MEMORY_RESERVED,
    TEMPERATURE,
    MEMORY_TEMPERATURE,
    SLOWDOWN_TEMPERATURE,
    SHUTDOWN_TEMPERATURE,
    POWER,
    POWER_LIMIT,
    ENERGY,
    SM_CLOCK,
    MEMORY_CLOCK,
    CLOCK_EVENT,
    CLOCK_VIOLATION,
    ENCODER_UTILIZATION,
    DECODER_UTILIZATION,
    ECC_ERRORS,
    ECC_VOLATILE_ERRORS,
    RETIRED_PAGES,
    RETIRED_PAGES_PENDING,
    REMAPPED_ROWS,
    REMAPPED_ROWS_PENDING,
    REMAPPED_ROWS_FAILED,
    PCIE_REPLAY,
    PCIE_GEN,
    PCIE_MAX_GEN,
    PCIE_WIDTH,
    PCIE_MAX_WIDTH,
    PCIE_THROUGHPUT,
    NVLINK_UP,
    NVLINK_ERRORS,
    XID_ERRORS,
    LAST_XID,
    LAST_XID_TIME,
    PROCESS_MEMORY,
)

# Per-GPU families -> the fields (labels of sidecar_gpu_field_unavailable) they come from: a
# family absent for a GPU must have one of these reported unavailable (bench/gpu_check.py checks).
FIELDS_OF: dict[str, tuple[str, ...]] = {
    s.name: fields
    for s, fields in (
        (UTILIZATION, ("utilization",)),
        (MEMORY_UTILIZATION, ("utilization",)),
        (MEMORY_USED, ("memory",)),
        (MEMORY_TOTAL, ("memory",)),
        (MEMORY_FREE, ("memory",)),
        (MEMORY_RESERVED, ("memory", "memory_reserved")),
        (TEMPERATURE, ("temperature",)),
        (MEMORY_TEMPERATURE, ("memory_temperature",)),
        (SLOWDOWN_TEMPERATURE, ("slowdown_temperature",)),
        (SHUTDOWN_TEMPERATURE, ("shutdown_temperature",)),
        (POWER, ("power",)),
        (POWER_LIMIT, ("power_limit",)),
        (ENERGY, ("energy",)),
        (SM_CLOCK, ("sm_clock",)),
        (MEMORY_CLOCK, ("memory_clock",)),
        (CLOCK_EVENT, ("clock_event_reasons",)),
        (CLOCK_VIOLATION, tuple(f"violation_{p}" for p, _ in VIOLATION_POLICIES)),
        (ENCODER_UTILIZATION, ("encoder_utilization",)),
        (DECODER_UTILIZATION, ("decoder_utilization",)),
        (ECC_ERRORS, ("ecc_corrected", "ecc_uncorrected")),
        (ECC_VOLATILE_ERRORS, ("ecc_volatile_corrected", "ecc_volatile_uncorrected")),
        (RETIRED_PAGES, ("retired_pages_single_bit", "retired_pages_double_bit")),
        (RETIRED_PAGES_PENDING, ("retired_pages_pending",)),
        (REMAPPED_ROWS, ("remapped_rows",)),
        (REMAPPED_ROWS_PENDING, ("remapped_rows",)),
        (REMAPPED_ROWS_FAILED, ("remapped_rows",)),
        (PCIE_REPLAY, ("pcie_replay",)),
        (PCIE_GEN, ("pcie_link_generation",)),
        (PCIE_MAX_GEN, ("pcie_link_max_generation",)),
        (PCIE_WIDTH, ("pcie_link_width",)),
        (PCIE_MAX_WIDTH, ("pcie_link_max_width",)),
        (PCIE_THROUGHPUT, ("pcie_tx_throughput", "pcie_rx_throughput")),
    )
}
# Families that exist only in some situations, and which.
CONDITIONAL = {
    NVLINK_UP.name: "GPUs with NVLink",
    NVLINK_ERRORS.name: "GPUs with NVLink",
    XID_ERRORS.name: "after an XID event",
    LAST_XID.name: "GPUs with XID event support",
    LAST_XID_TIME.name: "after an XID event",
    PROCESS_MEMORY.name: "registered ranks using the GPU",
    FIELD_UNAVAILABLE.name: "fields NVML does not give",
}

# Plain one-value-per-GPU families: (spec, GpuReading attribute).
_SCALARS = (
    (UTILIZATION, "utilization_ratio"),
    (MEMORY_UTILIZATION, "memory_utilization_ratio"),
    (MEMORY_USED, "memory_used_bytes"),
    (MEMORY_TOTAL, "memory_total_bytes"),
    (MEMORY_FREE, "memory_free_bytes"),
    (MEMORY_RESERVED, "memory_reserved_bytes"),
    (TEMPERATURE, "temperature_celsius"),
    (MEMORY_TEMPERATURE, "memory_temperature_celsius"),
    (ENCODER_UTILIZATION, "encoder_utilization_ratio"),
    (DECODER_UTILIZATION, "decoder_utilization_ratio"),
    (SLOWDOWN_TEMPERATURE, "slowdown_temperature_celsius"),
    (SHUTDOWN_TEMPERATURE, "shutdown_temperature_celsius"),
    (POWER, "power_watts"),
    (POWER_LIMIT, "power_limit_watts"),
    (ENERGY, "energy_joules"),
    (SM_CLOCK, "sm_clock_hertz"),
    (MEMORY_CLOCK, "memory_clock_hertz"),
    (RETIRED_PAGES_PENDING, "retired_pages_pending"),
    (PCIE_REPLAY, "pcie_replay"),
    (PCIE_GEN, "pcie_link_generation"),
    (PCIE_MAX_GEN, "pcie_link_max_generation"),
    (PCIE_WIDTH, "pcie_link_width"),
    (PCIE_MAX_WIDTH, "pcie_link_max_width"),
)

MAX_PROBLEMS_SHOWN = 5


class GpuCollector:
    name = NAME
    metrics = METRICS

    def __init__(
        self,
        nvml_module: str,
        ranks: RanksFn,
        xid_events: bool = True,
        fitness: GpuFitness | None = None,
        live_ranks: RanksFn | None = None,
    ):
        self.session = NvmlSession(nvml_module)
        self.ranks = ranks  # the ranks /metrics shows (their GPU memory series)
        # Every live verified rank: whose processes are not left over, and the only ranks GPU
        # memory is attributed to (an unverified registration's pid may be anyone's process).
        self.live_ranks = live_ranks or ranks
        self.xid_events = xid_events
        self.xid: XidWatcher | None = None
        self.rank_gpus: RankGpus = {}  # GPUs each rank's processes held, last round
        self.fitness = fitness or GpuFitness()  # GPUs missing or held: the node verdict's GPU part
        self._memory_by_pid: dict[int, dict[str, int]] = {}

    def gpu_memory(self) -> dict[int, dict[str, int]]:
        """pid -> {gpu: bytes} of every compute process NVML listed last round."""
        return self._memory_by_pid

    def last_xids(self) -> dict[str, tuple[int, float]]:
        """gpu -> (latest XID, Unix time) since the sidecar started."""
        return self.xid.snapshot()[1] if self.xid is not None else {}

    def versions(self) -> tuple[str, str]:
        """(driver version, CUDA driver version), "" before NVML answered or without a GPU."""
        return self.session.driver_version, self.session.cuda_version

    def close(self) -> None:
        if self.xid is not None:
            self.xid.stop()
        self.session.close()

    def collect(self) -> Iterable[Metric]:
        if not self.session.start():
            self.fitness.unavailable(self.session.broken or self.session.absent or "not initialized")
            self._memory_by_pid = {}
            if self.session.broken:  # logged once by the session; the run fails until NVML works
                raise PartialFailure(self.session.broken, [])
            return []
        if self.xid_events and self.xid is None:
            self.xid = start_xid_watcher(self.session)
        readings: list[GpuReading] = []
        lost: list[str] = []
        problems: list[str] = []
        for index in range(self.session.count):
            try:
                reading = self.session.read(index)
            except GpuLost as e:
                lost.append(str(index))
                problems.append(str(e))
                continue
            readings.append(reading)
        self.session.log_field_changes()
        families = self._families(readings, lost)
        processes = [(r.gpu, r.processes) for r in readings]
        self._memory_by_pid = memory_by_pid(processes)
        self.fitness.observe(self.session.count, lost, processes, owners_of(processes, self.live_ranks))
        if problems:
            more = len(problems) - MAX_PROBLEMS_SHOWN
            raise PartialFailure(
                "; ".join(problems[:MAX_PROBLEMS_SHOWN]) + (f" (+{more} more)" if more > 0 else ""), families
            )
        return families

    def _families(self, readings: list[GpuReading], lost: list[str]) -> list[Metric]:
        info, lost_family, unavailable = INFO.family(), LOST.family(), FIELD_UNAVAILABLE.family()
        violation, ecc_volatile, pcie_throughput = (
            CLOCK_VIOLATION.family(),
            ECC_VOLATILE_ERRORS.family(),
            PCIE_THROUGHPUT.family(),
        )
        scalars = [(s.family(), attr) for s, attr in _SCALARS]
        clock, ecc, retired = CLOCK_EVENT.family(), ECC_ERRORS.family(), RETIRED_PAGES.family()
        rows, rows_pending, rows_failed = (
            REMAPPED_ROWS.family(),
            REMAPPED_ROWS_PENDING.family(),
            REMAPPED_ROWS_FAILED.family(),
        )
        nvlink_up, nvlink_errors = NVLINK_UP.family(), NVLINK_ERRORS.family()

        for gpu in lost:
            lost_family.add_metric([gpu], 1)
        for r in readings:
            g = r.gpu
            info.add_metric([g, r.uuid, r.name, r.pci_bus_id], {})
            lost_family.add_metric([g], 0)
            for name, reason in sorted(r.unavailable.items()):
                unavailable.add_metric([g, name, reason], 1.0)
            for family, attr in scalars:
                value = getattr(r, attr)
                if value is not None:
                    family.add_metric([g], float(value))
            if r.clock_event_reasons is not None:
                for reason, bit in CLOCK_EVENT_REASONS:
                    clock.add_metric([g, reason], 1.0 if r.clock_event_reasons & bit else 0.0)
            for kind, value in (("corrected", r.ecc_corrected), ("uncorrected", r.ecc_uncorrected)):
                if value is not None:
                    ecc.add_metric([g, kind], value)
            for kind, value in (("corrected", r.ecc_volatile_corrected), ("uncorrected", r.ecc_volatile_uncorrected)):
                if value is not None:
                    ecc_volatile.add_metric([g, kind], value)
            for policy, seconds in r.violation_seconds.items():
                violation.add_metric([g, policy], seconds)
            for direction, value in (("transmit", r.pcie_tx_bytes_per_second), ("receive", r.pcie_rx_bytes_per_second)):
                if value is not None:
                    pcie_throughput.add_metric([g, direction], value)
            for cause, value in (
                ("single_bit", r.retired_pages_single_bit),
                ("double_bit", r.retired_pages_double_bit),
            ):
                if value is not None:
                    retired.add_metric([g, cause], value)
            if r.remapped_rows is not None:
                correctable, uncorrectable, pending, failed = r.remapped_rows
                rows.add_metric([g, "correctable"], correctable)
                rows.add_metric([g, "uncorrectable"], uncorrectable)
                rows_pending.add_metric([g], 1.0 if pending else 0.0)
                rows_failed.add_metric([g], 1.0 if failed else 0.0)
            for link in r.nvlinks:
                if link.up is not None:
                    nvlink_up.add_metric([g, str(link.link)], 1.0 if link.up else 0.0)
                for kind, value in link.errors.items():
                    nvlink_errors.add_metric([g, str(link.link), kind], value)

        families = [
            info,
            lost_family,
            unavailable,
            *(f for f, _ in scalars),
            clock,
            violation,
            ecc,
            ecc_volatile,
            retired,
            rows,
            rows_pending,
            rows_failed,
            pcie_throughput,
            nvlink_up,
            nvlink_errors,
            *self._xid_families(),
            self._process_memory(readings),
        ]
        return [f for f in families if f.samples]

    def _xid_families(self) -> list[Metric]:
        errors, last, last_time = XID_ERRORS.family(), LAST_XID.family(), LAST_XID_TIME.family()
        if self.xid is None:
            return [errors, last, last_time]
        counts, latest = self.xid.snapshot()
        for (gpu, xid), count in sorted(counts.items()):
            errors.add_metric([gpu, xid], count)
        for gpu in self.xid.watched:
            last_xid, when = latest.get(gpu, (0, None))
            last.add_metric([gpu], last_xid)
            if when is not None:
                last_time.add_metric([gpu], when)
        return [errors, last, last_time]

    def _attributed(self) -> list[RankRef]:
        """The ranks /metrics shows that are verified: what GPU memory is attributed to."""
        verified = set(self.live_ranks())
        return [entry for entry in self.ranks() if entry in verified]

    def _process_memory(self, readings: list[GpuReading]) -> Metric:
        family = PROCESS_MEMORY.family()
        processes = [(r.gpu, r.processes) for r in readings]
        owners = owners_of(processes, self._attributed)
        self.rank_gpus = rank_gpus(processes, owners)
        for r in readings:
            per_rank: dict[tuple[str, int], int] = {}
            for pid, used in r.processes:
                owner = owners.get(pid)
                if owner is not None:
                    per_rank[owner] = per_rank.get(owner, 0) + used
            for (job_id, rank), used in sorted(per_rank.items()):
                family.add_metric([r.gpu, job_id, str(rank)], used)
        return family


def build(context: BuildContext) -> GpuCollector | None:
    """None where dcgm-exporter is the cluster's GPU source: no second NVML poller (docs/dcgm.md)."""
    cfg = context.settings.collectors
    if cfg.gpu_source != "sidecar":
        return None
    return GpuCollector(
        cfg.nvml_module,
        context.ranks,
        xid_events=cfg.xid_events,
        fitness=GpuFitness.for_settings(cfg),
        live_ranks=context.live_ranks,
    )
