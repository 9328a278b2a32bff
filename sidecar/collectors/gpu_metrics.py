"""The GPU collector's metric families (sidecar/collectors/gpu.py reads NVML into them): each
family's spec, which NVML fields feed it (`FIELDS_OF`, for `sidecar_gpu_field_unavailable` and
`bench/gpu_check.py`), and the families shown only on some GPUs (`CONDITIONAL`)."""

from __future__ import annotations

from sidecar.collectors.nvml import VIOLATION_POLICIES
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
