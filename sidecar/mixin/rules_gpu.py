"""The GPU alerts (gpu.rules.yml), on the `gpu:*` series of either GPU source (gpu_source.py)."""

# ruff: noqa: E501
# (declarative tables: PromQL expressions read, and are copied, whole)

from __future__ import annotations

from sidecar.mixin.config import MixinConfig
from sidecar.mixin.promql import LABELS_GPU, Alert, Group, increased


def group(cfg: MixinConfig) -> Group:
    T, window = cfg.thresholds, cfg.window
    return Group(
        "sidecar-gpu",
        [
            Alert(
                "SidecarGpuXidCritical",
                increased(
                    f'gpu:sidecar_gpu_xid_errors_total{{xid=~"{T["xid_critical"]}"}}',
                    window("xid_window"),
                    "cluster, instance, gpu, xid",
                ),
                "critical",
                f"XID {{{{ $labels.xid }}}} on {LABELS_GPU}",
                "The driver reported an XID whose recovery needs a GPU reset or a node reboot. Drain the node.",
            ),
            Alert(
                "SidecarGpuXid",
                increased(
                    f'gpu:sidecar_gpu_xid_errors_total{{xid!~"{T["xid_critical"]}"}}',
                    "15m",
                    "cluster, instance, gpu, xid",
                ),
                "warning",
                f"XID {{{{ $labels.xid }}}} on {LABELS_GPU}",
                "The driver reported an XID error (often an application fault such as 13, 31 or 43).",
            ),
            Alert(
                "SidecarGpuUncorrectableEcc",
                # Not `increased`: the counters exist from the start (at 0 on a healthy GPU), and a
                # series that looks new after a scrape gap may hold errors from long ago.
                'sum by (cluster, instance, gpu) (increase(gpu:sidecar_gpu_ecc_errors_total{type="uncorrected"}[1h])) > 0',
                "critical",
                f"Uncorrectable ECC error on {LABELS_GPU}",
                "GPU memory returned data it could not correct. The process that used it has likely crashed.",
            ),
            Alert(
                "SidecarGpuRowRemapPending",
                "max by (cluster, instance, gpu) (gpu:sidecar_gpu_remapped_rows_pending) > 0\n"
                "or max by (cluster, instance, gpu) (gpu:sidecar_gpu_retired_pages_pending) > 0",
                "warning",
                f"Memory row remap pending on {LABELS_GPU}",
                "A memory row remap (or page retirement) waits for the next GPU reset to take effect.",
            ),
            Alert(
                "SidecarGpuRowRemapFailed",
                "max by (cluster, instance, gpu) (gpu:sidecar_gpu_remapped_rows_failed) > 0",
                "critical",
                f"Memory row remap failed on {LABELS_GPU}",
                "The GPU ran out of spare rows or failed to remap one: the GPU needs replacing (RMA).",
            ),
            Alert(
                "SidecarGpuThermalSlowdown",
                'max by (cluster, instance, gpu) (gpu:sidecar_gpu_clock_event_active{reason=~"sw_thermal_slowdown|hw_thermal_slowdown"}) == 1\n'
                "or max by (cluster, instance, gpu) (\n"
                f"  gpu:sidecar_gpu_temperature_celsius >= gpu:sidecar_gpu_slowdown_temperature_celsius - {T['thermal_margin_celsius']}\n"
                ")",
                "warning",
                f"Thermal slowdown on {LABELS_GPU}",
                "The GPU slows its clocks for heat, or runs within a few degrees of its slowdown temperature.",
                for_="5m",
            ),
            Alert(
                "SidecarGpuHardwareSlowdown",
                'max by (cluster, instance, gpu) (gpu:sidecar_gpu_clock_event_active{reason=~"hw_slowdown|hw_power_brake_slowdown"}) == 1',
                "warning",
                f"Hardware slowdown on {LABELS_GPU}",
                "The GPU's clocks are cut by a hardware slowdown (power brake, PSU or external signal).",
                for_="2m",
            ),
            Alert(
                "SidecarGpuNvlinkDown",
                "gpu:sidecar_gpu_nvlink_up == 0\nand on (cluster, instance) (max by (cluster, instance) (gpu:sidecar_gpu_nvlink_up) == 1)",
                "critical",
                f"NVLink {{{{ $labels.link }}}} down on {LABELS_GPU}",
                "An NVLink is down while other links on the node are up: collectives fall back or hang.",
                for_="2m",
            ),
            Alert(
                "SidecarGpuNvlinkErrors",
                "sum by (cluster, instance, gpu, link) (rate(gpu:sidecar_gpu_nvlink_errors_total[5m]))"
                f" > {T['nvlink_errors_per_second']}",
                "warning",
                f"NVLink {{{{ $labels.link }}}} errors on {LABELS_GPU}",
                f"The link counts more than {T['nvlink_errors_per_second']} CRC/replay/recovery errors per second.",
                for_="10m",
            ),
            Alert(
                "SidecarGpuPcieReplays",
                f"rate(gpu:sidecar_gpu_pcie_replay_total[5m]) > {T['pcie_replays_per_second']}",
                "warning",
                f"PCIe replays on {LABELS_GPU}",
                "The GPU's PCIe link keeps retransmitting: a marginal riser, slot or cable.",
                for_="10m",
            ),
            Alert(
                "SidecarGpuPcieLinkDegraded",
                "gpu:sidecar_gpu_pcie_link_width < gpu:sidecar_gpu_pcie_link_max_width\n"
                "or (\n"
                "  gpu:sidecar_gpu_pcie_link_generation < gpu:sidecar_gpu_pcie_link_max_generation\n"
                f"  and on (cluster, instance, gpu) gpu:sidecar_gpu_utilization_ratio > {T['pcie_busy_ratio']}\n"
                ")",
                "warning",
                f"PCIe link degraded on {LABELS_GPU}",
                "The GPU's PCIe link trained below its maximum width, or below its maximum generation while busy.",
                for_="10m",
            ),
        ],
    )
