"""The GPU source: recording rules that put one cluster's GPU series under the names the
dashboards and GPU alerts read, `gpu:<our metric name>`, labelled by `instance` (the node) and
`gpu` (the index), plus `xid`, `type`, `reason`, `link`, `cause` where the metric has them.

Two sources, one of which a cluster loads (docs/dcgm.md):
- `sidecar`: the sidecar's own NVML collector (`sidecar_gpu_*`), renamed as is;
- `dcgm`: NVIDIA dcgm-exporter's `DCGM_FI_*` series (the GPU Operator runs it), converted to base
  units (percent to ratio, MiB to bytes, MHz to Hz, mJ to J), `instance` taken from its
  `Hostname` (3.x/4.x) or `hostname` (newer) label, which is the node name where dcgm-exporter
  has NODE_NAME set, as the GPU Operator and its Helm chart do.

`DCGM` below is also the table in docs/dcgm.md (a test keeps them the same). Counters that
dcgm-exporter ships commented out in etc/default-counters.csv map "where present": enable them
in its counters file to get the panels and alerts that read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.collectors.nvml import CLOCK_EVENT_REASONS

MIB = 1048576
# `cluster` where the series carry it (a multi-cluster setup), as every rule keeps it (promql.py).
BY = "cluster, instance, gpu"


def recorded(metric: str) -> str:
    """The name the dashboards and alerts read for one of our GPU metrics."""
    return f"gpu:{metric}"


@dataclass(frozen=True)
class Mapping:
    ours: str  # our exposed metric name (docs/metrics.md)
    unit: str
    dcgm: tuple[str, ...]  # the dcgm-exporter fields read
    expr: str  # PromQL over those fields, already by (instance, gpu[, extra])
    default: bool  # in dcgm-exporter's etc/default-counters.csv (uncommented)
    note: str = ""
    extra: str = ""  # labels besides instance and gpu
    labels: tuple[tuple[str, str], ...] = ()  # constant labels the recording rule sets


def node(selector: str) -> str:
    """The dcgm series with `instance` set to dcgm-exporter's host name label (either spelling)."""
    return (
        f'label_replace(label_replace({selector}, "instance", "$1", "Hostname", "(.+)"),'
        f' "instance", "$1", "hostname", "(.+)")'
    )


def per_gpu(selector: str, scale: str = "") -> str:
    return f"max by ({BY}) ({node(selector)}){scale}"


# NVML clock event reasons by bit of DCGM_FI_DEV_CLOCKS_EVENT_REASONS: the collector's own table.
CLOCK_REASONS = CLOCK_EVENT_REASONS


def _simple(ours: str, unit: str, field: str, scale: str, default: bool, note: str = "") -> Mapping:
    return Mapping(ours, unit, (field,), per_gpu(field, scale), default, note)


def _labelled(
    ours: str, unit: str, label: str, pairs: tuple[tuple[str, str], ...], default: bool, note: str = "", scale: str = ""
) -> list[Mapping]:
    return [
        Mapping(
            ours,
            unit,
            (field,),
            per_gpu(field, scale),
            default,
            note or f'`{label}="{value}"`',
            extra=label,
            labels=((label, value),),
        )
        for field, value in pairs
    ]


_INFO_SOURCE = (
    'label_replace(label_replace(DCGM_FI_DEV_FB_USED, "uuid", "$1", "UUID", "(.+)"), "name", "$1", "modelName", "(.+)")'
)
# A rank's GPU in dcgm mode: the GPU that dcgm-exporter's pod mapping attributes to the rank's
# container (namespace, pod, container), when that container holds exactly one GPU. Where
# dcgm-exporter's scrape did not honour its labels they arrive as exported_*; both are read.
_POD = "namespace, pod, container"


def _pod_labels(expr: str) -> str:
    for label in ("namespace", "pod", "container"):
        expr = f'label_replace({expr}, "{label}", "$1", "exported_{label}", "(.+)")'
    return expr


_GPU_OF_POD = f"max by ({BY}, {_POD}) ({_pod_labels(node('DCGM_FI_DEV_FB_USED'))})"
_PROCESS_MEMORY = (
    f"max by ({BY}, namespace, job_id, rank) (\n"
    f"  group by (cluster, job_id, rank, {_POD}) (sidecar_training_restarts)\n"
    f"  * on (cluster, {_POD}) group_left (instance, gpu)\n"
    f"  ({_GPU_OF_POD} and on (cluster, {_POD}) (count by (cluster, {_POD}) ({_GPU_OF_POD}) == 1))\n"
    f") * {MIB}"
)

DCGM: list[Mapping] = [
    Mapping(
        "sidecar_gpu_info",
        "info",
        ("DCGM_FI_DEV_FB_USED",),
        f"group by ({BY}, uuid, name, pci_bus_id) ({node(_INFO_SOURCE)})",
        True,
        "labels from `UUID`, `modelName`, `pci_bus_id`",
        extra="uuid, name, pci_bus_id",
    ),
    _simple("sidecar_gpu_utilization_ratio", "ratio", "DCGM_FI_DEV_GPU_UTIL", " / 100", True, "percent / 100"),
    _simple(
        "sidecar_gpu_memory_utilization_ratio", "ratio", "DCGM_FI_DEV_MEM_COPY_UTIL", " / 100", True, "percent / 100"
    ),
    _simple("sidecar_gpu_memory_used_bytes", "bytes", "DCGM_FI_DEV_FB_USED", f" * {MIB}", True, "MiB × 1048576"),
    _simple("sidecar_gpu_memory_free_bytes", "bytes", "DCGM_FI_DEV_FB_FREE", f" * {MIB}", True, "MiB × 1048576"),
    _simple(
        "sidecar_gpu_memory_reserved_bytes", "bytes", "DCGM_FI_DEV_FB_RESERVED", f" * {MIB}", True, "MiB × 1048576"
    ),
    Mapping(
        "sidecar_gpu_memory_total_bytes",
        "bytes",
        ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_RESERVED"),
        f"(\n  {per_gpu('DCGM_FI_DEV_FB_USED')}\n  + {per_gpu('DCGM_FI_DEV_FB_FREE')}\n"
        f"  + ({per_gpu('DCGM_FI_DEV_FB_RESERVED')} or {per_gpu('DCGM_FI_DEV_FB_USED')} * 0)\n) * {MIB}",
        True,
        "(used + free + reserved) MiB × 1048576",
    ),
    _simple("sidecar_gpu_temperature_celsius", "celsius", "DCGM_FI_DEV_GPU_TEMP", "", True),
    _simple("sidecar_gpu_memory_temperature_celsius", "celsius", "DCGM_FI_DEV_MEMORY_TEMP", "", True),
    _simple("sidecar_gpu_slowdown_temperature_celsius", "celsius", "DCGM_FI_DEV_SLOWDOWN_TEMP", "", False),
    _simple("sidecar_gpu_shutdown_temperature_celsius", "celsius", "DCGM_FI_DEV_SHUTDOWN_TEMP", "", False),
    _simple("sidecar_gpu_power_watts", "watts", "DCGM_FI_DEV_POWER_USAGE", "", True),
    _simple("sidecar_gpu_power_limit_watts", "watts", "DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "", False),
    _simple(
        "sidecar_gpu_energy_joules_total",
        "joules",
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        " / 1000",
        True,
        "mJ / 1000",
    ),
    _simple("sidecar_gpu_sm_clock_hertz", "hertz", "DCGM_FI_DEV_SM_CLOCK", " * 1e6", True, "MHz × 10⁶"),
    _simple("sidecar_gpu_memory_clock_hertz", "hertz", "DCGM_FI_DEV_MEM_CLOCK", " * 1e6", True, "MHz × 10⁶"),
    *[
        Mapping(
            "sidecar_gpu_clock_event_active",
            "boolean",
            ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS",),
            f"floor({per_gpu('DCGM_FI_DEV_CLOCKS_EVENT_REASONS')} / {bit}) % 2",
            False,
            f'bit {bit:#x} of the bitmask → `reason="{name}"`',
            extra="reason",
            labels=(("reason", name),),
        )
        for name, bit in CLOCK_REASONS
    ],
    *_labelled(
        "sidecar_gpu_clock_violation_seconds_total",
        "seconds",
        "policy",
        tuple(
            (f"DCGM_FI_DEV_{field}_VIOLATION", policy)
            for field, policy in (
                ("POWER", "power"),
                ("THERMAL", "thermal"),
                ("SYNC_BOOST", "sync_boost"),
                ("BOARD_LIMIT", "board_limit"),
                ("LOW_UTIL", "low_utilization"),
                ("RELIABILITY", "reliability"),
            )
        ),
        False,
        scale=" / 1e9",
    ),
    _simple("sidecar_gpu_encoder_utilization_ratio", "ratio", "DCGM_FI_DEV_ENC_UTIL", " / 100", True, "percent / 100"),
    _simple("sidecar_gpu_decoder_utilization_ratio", "ratio", "DCGM_FI_DEV_DEC_UTIL", " / 100", True, "percent / 100"),
    *_labelled(
        "sidecar_gpu_ecc_volatile_errors_total",
        "errors",
        "type",
        (("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "corrected"), ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "uncorrected")),
        False,
    ),
    *_labelled(
        "sidecar_gpu_ecc_errors_total",
        "errors",
        "type",
        (("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "corrected"), ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "uncorrected")),
        False,
    ),
    *_labelled(
        "sidecar_gpu_retired_pages",
        "pages",
        "cause",
        (("DCGM_FI_DEV_RETIRED_SBE", "single_bit"), ("DCGM_FI_DEV_RETIRED_DBE", "double_bit")),
        False,
    ),
    Mapping(
        "sidecar_gpu_retired_pages_pending",
        "boolean",
        ("DCGM_FI_DEV_RETIRED_PENDING",),
        f"{per_gpu('DCGM_FI_DEV_RETIRED_PENDING')} > bool 0",
        False,
        "pages pending > 0",
    ),
    *_labelled(
        "sidecar_gpu_remapped_rows",
        "rows",
        "type",
        (
            ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "correctable"),
            ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "uncorrectable"),
        ),
        True,
    ),
    _simple("sidecar_gpu_remapped_rows_pending", "boolean", "DCGM_FI_DEV_ROW_REMAP_PENDING", "", False),
    _simple("sidecar_gpu_remapped_rows_failed", "boolean", "DCGM_FI_DEV_ROW_REMAP_FAILURE", "", True),
    _simple("sidecar_gpu_pcie_replay_total", "replays", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "", True),
    *_labelled(
        "sidecar_gpu_pcie_throughput_bytes_per_second",
        "bytes per second",
        "direction",
        (("DCGM_FI_PROF_PCIE_TX_BYTES", "transmit"), ("DCGM_FI_PROF_PCIE_RX_BYTES", "receive")),
        True,
        note="DCGM's profiling rate (the sidecar samples NVML's 20 ms throughput)",
    ),
    _simple("sidecar_gpu_pcie_link_generation", "generation", "DCGM_FI_DEV_PCIE_LINK_GEN", "", False),
    _simple("sidecar_gpu_pcie_link_max_generation", "generation", "DCGM_FI_DEV_PCIE_MAX_LINK_GEN", "", False),
    _simple("sidecar_gpu_pcie_link_width", "lanes", "DCGM_FI_DEV_PCIE_LINK_WIDTH", "", False),
    _simple("sidecar_gpu_pcie_link_max_width", "lanes", "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", "", False),
    *[
        Mapping(
            "sidecar_gpu_nvlink_errors_total",
            "errors",
            (field,),
            per_gpu(field),
            False,
            f'all links summed: `link="all"`, `type="{kind}"`',
            extra="link, type",
            labels=(("link", "all"), ("type", kind)),
        )
        for field, kind in (
            ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "replay"),
            ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "recovery"),
            ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "crc_flit"),
            ("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "crc_data"),
        )
    ],
    # The last XID as a series per (GPU, XID) at 1: a different XID shows up as a new series,
    # which the XID alerts count as an occurrence (a repeat of the same XID does not).
    Mapping(
        "sidecar_gpu_xid_errors_total",
        "1 per distinct last XID",
        ("DCGM_FI_DEV_XID_ERRORS",),
        f'count_values by ({BY}) ("xid", {per_gpu("DCGM_FI_DEV_XID_ERRORS")} > 0)',
        True,
        "the last XID's value as the `xid` label; a repeat of the same XID is not seen",
        extra="xid",
    ),
    _simple("sidecar_gpu_last_xid", "xid", "DCGM_FI_DEV_XID_ERRORS", "", True),
    Mapping(
        "sidecar_gpu_process_memory_bytes",
        "bytes",
        ("DCGM_FI_DEV_FB_USED",),
        _PROCESS_MEMORY,
        True,
        "the GPU's used memory, for a rank whose container holds exactly one GPU (dcgm-exporter's "
        "pod mapping joined with the rank's `namespace`, `pod`, `container`)",
        extra="namespace, job_id, rank",
    ),
]

# The uncommented lines of dcgm-exporter's etc/default-counters.csv (main, 2026), each mapped
# above or listed here with why not (a test checks the table covers them all).
DEFAULT_COUNTERS = (
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_MEM_CLOCK",
    "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_ENC_UTIL",
    "DCGM_FI_DEV_DEC_UTIL",
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_RESERVED",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "DCGM_FI_DRIVER_VERSION",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
    "DCGM_FI_PROF_DRAM_ACTIVE",
    "DCGM_FI_PROF_PCIE_TX_BYTES",
    "DCGM_FI_PROF_PCIE_RX_BYTES",
)
NOT_MAPPED = {
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": (
        "counter",
        "no counterpart (NVML's NVLink utilization counters are deprecated)",
    ),
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": ("status", "no counterpart (vGPU only)"),
    "DCGM_FI_DRIVER_VERSION": (
        "label",
        "a label on every series; `sidecar_versions_info{driver_version}` has the sidecar's",
    ),
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": ("ratio", "no counterpart (DCGM profiling, no NVML equivalent)"),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("ratio", "no counterpart (DCGM profiling, no NVML equivalent)"),
    "DCGM_FI_PROF_DRAM_ACTIVE": ("ratio", "no counterpart (DCGM profiling, no NVML equivalent)"),
}

# Our metrics with no dcgm-exporter counterpart (their panels and alerts need the sidecar source),
# with their labels besides instance and gpu.
SIDECAR_ONLY = {
    "sidecar_gpu_lost": "",
    "sidecar_gpu_nvlink_up": "link",
    "sidecar_gpu_last_xid_timestamp_seconds": "",
    "sidecar_gpu_field_unavailable": "field, reason",
}


def sidecar_source() -> list[tuple[str, str]]:
    """(record, expr) renaming our own series, one per metric the dcgm source maps or that only we have."""
    seen: dict[str, str] = {}
    for m in DCGM:
        seen.setdefault(m.ours, m.extra)
    for ours, extra in SIDECAR_ONLY.items():
        seen.setdefault(ours, extra)
    out = []
    for ours, extra in seen.items():
        labels = ", ".join(x for x in (BY, extra) if x)
        op = "group" if ours.endswith("_info") else "max"
        out.append((recorded(ours), f"{op} by ({labels}) ({ours})"))
    return out


def dcgm_source() -> list[tuple[str, str, dict[str, str]]]:
    return [(recorded(m.ours), m.expr, dict(m.labels)) for m in DCGM]


def markdown_table() -> str:
    """docs/dcgm.md's mapping table: one row per dcgm-exporter field."""
    rows = [
        "| dcgm-exporter field | in default-counters.csv | our name (recorded as `gpu:<name>`) | unit | conversion |",
        "| --- | --- | --- | --- | --- |",
    ]
    for m in DCGM:
        fields = ", ".join(f"`{f}`" for f in m.dcgm)
        rows.append(
            f"| {fields} | {'yes' if m.default else 'no (enable it)'} | `{m.ours}` | {m.unit} | {m.note or 'as is'} |"
        )
    for field, (unit, why) in NOT_MAPPED.items():
        rows.append(f"| `{field}` | yes | not mapped | {unit} | {why} |")
    return "\n".join(rows) + "\n"
