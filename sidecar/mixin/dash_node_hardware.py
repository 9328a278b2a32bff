"""The node hardware dashboard (node-hardware.json): one node's GPUs, NVLink, PCIe, NICs,
InfiniBand, CPU, memory and checkpoint disk."""

from __future__ import annotations

from sidecar.mixin.config import MixinConfig
from sidecar.mixin.panels import (
    CLUSTER,
    GPUS,
    NAMESPACE,
    NODE,
    cluster_var,
    dashboard,
    job_var,
    namespace_var,
    query_var,
    row,
    table,
    timeseries,
)


def gpu_parity_panels(cfg: MixinConfig) -> list[dict]:
    """The counters dcgm-exporter exports by default that NVML also gives (docs/dcgm.md)."""
    return [
        timeseries(
            "GPU memory free and reserved",
            [
                (f"gpu:sidecar_gpu_memory_free_bytes{{{GPUS}}}", "GPU {{gpu}} free"),
                (f"gpu:sidecar_gpu_memory_reserved_bytes{{{GPUS}}}", "GPU {{gpu}} reserved by the driver"),
            ],
            "bytes",
            min_=0,
            w=8,
        ),
        timeseries("Memory (HBM) temperature", f"gpu:sidecar_gpu_memory_temperature_celsius{{{GPUS}}}", "celsius", w=8),
        timeseries(
            "PCIe throughput",
            f"gpu:sidecar_gpu_pcie_throughput_bytes_per_second{{{GPUS}}}",
            "Bps",
            "NVML's 20 ms samples, every 10 s, by direction.",
            min_=0,
            w=8,
        ),
        timeseries(
            "Encoder and decoder utilization",
            [
                (f"gpu:sidecar_gpu_encoder_utilization_ratio{{{GPUS}}}", "GPU {{gpu}} encoder"),
                (f"gpu:sidecar_gpu_decoder_utilization_ratio{{{GPUS}}}", "GPU {{gpu}} decoder"),
            ],
            "percentunit",
            min_=0,
            max_=1,
            w=8,
        ),
        timeseries(
            "Time clocks were held down, by policy",
            f"sum by (gpu, policy) (rate(gpu:sidecar_gpu_clock_violation_seconds_total{{{GPUS}}}[$__rate_interval]))",
            "percentunit",
            "Share of time each policy (power, thermal, ...) kept the clocks below target: "
            "the durations behind the clock event reasons.",
            min_=0,
            w=8,
        ),
        timeseries(
            "ECC errors since the driver was loaded",
            f"gpu:sidecar_gpu_ecc_volatile_errors_total{{{GPUS}}}",
            "short",
            "Volatile counters; the ECC errors panel shows the lifetime (aggregate) ones.",
            min_=0,
            w=8,
        ),
        table(
            "GPU fields NVML does not give",
            f"gpu:sidecar_gpu_field_unavailable{{{GPUS}}} == 1",
            "Fields left out for a GPU, with NVML's reason (not_supported, no_permission, not_ready, ...).",
            w=8,
        ),
    ]


def node_hardware(cfg: MixinConfig) -> dict:
    margin = cfg.number("thermal_margin_celsius")
    panels = [
        row("GPU"),
        timeseries(
            "GPU utilization", f"gpu:sidecar_gpu_utilization_ratio{{{GPUS}}}", "percentunit", min_=0, max_=1, w=8
        ),
        timeseries(
            "GPU memory used",
            [
                (f"gpu:sidecar_gpu_memory_used_bytes{{{GPUS}}}", "GPU {{gpu}} used"),
                (f"gpu:sidecar_gpu_memory_total_bytes{{{GPUS}}}", "GPU {{gpu}} total"),
            ],
            "bytes",
            min_=0,
            w=8,
        ),
        timeseries(
            "GPU memory bandwidth utilization",
            f"gpu:sidecar_gpu_memory_utilization_ratio{{{GPUS}}}",
            "percentunit",
            min_=0,
            max_=1,
            w=8,
        ),
        timeseries(
            "Temperature against slowdown threshold",
            [
                (f"gpu:sidecar_gpu_temperature_celsius{{{GPUS}}}", "GPU {{gpu}}"),
                (f"gpu:sidecar_gpu_slowdown_temperature_celsius{{{GPUS}}}", "GPU {{gpu}} slowdown"),
                (f"gpu:sidecar_gpu_slowdown_temperature_celsius{{{GPUS}}} - {margin}", "GPU {{gpu}} alert"),
            ],
            "celsius",
            f"SidecarGpuThermalSlowdown fires within {margin} degrees of the slowdown temperature.",
            w=8,
        ),
        timeseries(
            "Power",
            [
                (f"gpu:sidecar_gpu_power_watts{{{GPUS}}}", "GPU {{gpu}}"),
                (f"gpu:sidecar_gpu_power_limit_watts{{{GPUS}}}", "GPU {{gpu}} limit"),
            ],
            "watt",
            min_=0,
            w=8,
        ),
        timeseries(
            "Clocks",
            [
                (f"gpu:sidecar_gpu_sm_clock_hertz{{{GPUS}}}", "GPU {{gpu}} SM"),
                (f"gpu:sidecar_gpu_memory_clock_hertz{{{GPUS}}}", "GPU {{gpu}} memory"),
            ],
            "hertz",
            min_=0,
            w=8,
        ),
        timeseries(
            "Clock event reasons (throttling)",
            f'gpu:sidecar_gpu_clock_event_active{{{GPUS}, reason!="gpu_idle"}} == 1',
            "short",
            "Active reasons the GPU runs below its maximum clock (idle is left out).",
            bars=True,
            stack=True,
            w=8,
        ),
        timeseries(
            "ECC errors",
            f"sum by (gpu, type) (increase(gpu:sidecar_gpu_ecc_errors_total{{{GPUS}}}[$__rate_interval]))",
            "short",
            bars=True,
            min_=0,
            w=8,
        ),
        timeseries(
            "XID errors",
            f"sum by (gpu, xid) (increase(gpu:sidecar_gpu_xid_errors_total{{{GPUS}}}[$__rate_interval]))",
            "short",
            "Driver XID events by code (48, 79, 94, 95 ... need a reset).",
            bars=True,
            min_=0,
            w=8,
        ),
        table(
            "Memory repair",
            f"gpu:sidecar_gpu_remapped_rows_pending{{{GPUS}}} + on (instance, gpu) "
            f"gpu:sidecar_gpu_remapped_rows_failed{{{GPUS}}} > 0",
            "GPUs with row remaps pending (reset needed) or failed (replace the GPU).",
            w=8,
        ),
        timeseries("NVLink links up", f"sum by (gpu) (gpu:sidecar_gpu_nvlink_up{{{GPUS}}})", "short", min_=0, w=8),
        timeseries(
            "NVLink errors per second",
            f"sum by (gpu, type) (rate(gpu:sidecar_gpu_nvlink_errors_total{{{GPUS}}}[$__rate_interval]))",
            "short",
            min_=0,
            w=8,
        ),
        timeseries(
            "PCIe link",
            [
                (f"gpu:sidecar_gpu_pcie_link_generation{{{GPUS}}}", "GPU {{gpu}} gen"),
                (f"gpu:sidecar_gpu_pcie_link_max_generation{{{GPUS}}}", "GPU {{gpu}} max gen"),
                (f"gpu:sidecar_gpu_pcie_link_width{{{GPUS}}}", "GPU {{gpu}} width"),
                (f"gpu:sidecar_gpu_pcie_link_max_width{{{GPUS}}}", "GPU {{gpu}} max width"),
            ],
            "short",
            min_=0,
            w=8,
        ),
        timeseries(
            "PCIe replays per second",
            f"rate(gpu:sidecar_gpu_pcie_replay_total{{{GPUS}}}[$__rate_interval])",
            "short",
            min_=0,
            w=8,
            threshold=cfg.number("pcie_replays_per_second"),
        ),
        timeseries(
            "GPU memory per rank",
            f"gpu:sidecar_gpu_process_memory_bytes{{{GPUS}}}",
            "bytes",
            "Memory each rank's processes hold on each GPU.",
            min_=0,
            w=8,
        ),
        *gpu_parity_panels(cfg),
        row("Network"),
        timeseries(
            "NIC throughput",
            [
                (
                    f'rate(sidecar_network_receive_bytes_total{{{NODE}, device=~"$device"}}[$__rate_interval])',
                    "{{device}} rx",
                ),
                (
                    f'rate(sidecar_network_transmit_bytes_total{{{NODE}, device=~"$device"}}[$__rate_interval])',
                    "{{device}} tx",
                ),
            ],
            "Bps",
            min_=0,
            w=8,
        ),
        timeseries(
            "NIC errors and drops per second",
            [
                (
                    f'rate(sidecar_network_receive_errs_total{{{NODE}, device=~"$device"}}[$__rate_interval])',
                    "{{device}} rx errs",
                ),
                (
                    f'rate(sidecar_network_transmit_errs_total{{{NODE}, device=~"$device"}}[$__rate_interval])',
                    "{{device}} tx errs",
                ),
                (
                    f'rate(sidecar_network_receive_drop_total{{{NODE}, device=~"$device"}}[$__rate_interval])',
                    "{{device}} rx drop",
                ),
                (
                    f'rate(sidecar_network_transmit_drop_total{{{NODE}, device=~"$device"}}[$__rate_interval])',
                    "{{device}} tx drop",
                ),
            ],
            "short",
            min_=0,
            w=8,
        ),
        timeseries("NIC link up", f'sidecar_network_up{{{NODE}, device=~"$device"}}', "short", min_=0, max_=1, w=8),
        timeseries(
            "InfiniBand throughput",
            [
                (
                    f"rate(sidecar_infiniband_port_data_received_bytes_total{{{NODE}}}[$__rate_interval])",
                    "{{device}}/{{port}} rx",
                ),
                (
                    f"rate(sidecar_infiniband_port_data_transmitted_bytes_total{{{NODE}}}[$__rate_interval])",
                    "{{device}}/{{port}} tx",
                ),
            ],
            "Bps",
            min_=0,
            w=8,
        ),
        timeseries(
            "InfiniBand errors",
            [
                (
                    f"increase(sidecar_infiniband_symbol_error_total{{{NODE}}}[$__rate_interval])",
                    "{{device}}/{{port}} symbol",
                ),
                (
                    f"increase(sidecar_infiniband_port_receive_errors_total{{{NODE}}}[$__rate_interval])",
                    "{{device}}/{{port}} receive",
                ),
                (
                    f"increase(sidecar_infiniband_link_downed_total{{{NODE}}}[$__rate_interval])",
                    "{{device}}/{{port}} link downed",
                ),
            ],
            "short",
            bars=True,
            min_=0,
            w=8,
        ),
        timeseries("InfiniBand ports up", f"sidecar_infiniband_port_up{{{NODE}}}", "short", min_=0, max_=1, w=8),
        row("Node"),
        timeseries(
            "CPU utilization", f"sidecar_node_cpu_utilization_ratio{{{NODE}}}", "percentunit", min_=0, max_=1, w=6
        ),
        timeseries(
            "Memory",
            [
                (f"sidecar_node_memory_total_bytes{{{NODE}}} - sidecar_node_memory_available_bytes{{{NODE}}}", "used"),
                (f"sidecar_node_memory_total_bytes{{{NODE}}}", "total"),
            ],
            "bytes",
            min_=0,
            w=6,
        ),
        timeseries("Load (1m)", f"sidecar_node_load1{{{NODE}}}", "short", min_=0, w=6),
        timeseries(
            "Checkpoint filesystem free",
            [
                (f"sidecar_checkpoint_filesystem_avail_bytes{{{NODE}}}", "available"),
                (f"sidecar_checkpoint_filesystem_size_bytes{{{NODE}}}", "size"),
            ],
            "bytes",
            min_=0,
            w=6,
        ),
        timeseries(
            "Collector success",
            f"sidecar_scrape_collector_success{{{NODE}}}",
            "short",
            "1 when the collector's last run succeeded.",
            min_=0,
            max_=1,
            w=12,
        ),
        timeseries("Collector duration", f"sidecar_scrape_collector_duration_seconds{{{NODE}}}", "s", min_=0, w=12),
    ]
    variables = [
        cluster_var(),
        namespace_var(),
        job_var(include_all=True),
        # Every node when Namespace and Job are All (".*" also matches build_info's missing
        # namespace and job_id), else the nodes where the namespace's jobs (or the job) have ranks.
        query_var(
            "instance",
            "Node",
            'label_values({__name__=~"sidecar_build_info|sidecar_training_ranks_registered", '
            f'{CLUSTER}, {NAMESPACE}, job_id=~"$job_id"}}, instance)',
        ),
        query_var("gpu", "GPU", f"label_values(gpu:sidecar_gpu_info{{{NODE}}}, gpu)", multi=True, include_all=True),
        query_var("device", "NIC", f"label_values(sidecar_network_up{{{NODE}}}, device)", multi=True, include_all=True),
    ]
    return dashboard(
        cfg,
        "sidecar-node-hardware",
        "Node hardware",
        "One node's GPUs, NVLink, PCIe, NICs, InfiniBand, CPU, memory and checkpoint disk.",
        variables,
        panels,
    )
