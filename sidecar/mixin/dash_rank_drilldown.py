"""The rank drill-down dashboard (rank-drilldown.json): one rank's training metrics next to its
process and its GPUs."""

from __future__ import annotations

from sidecar.mixin.config import MixinConfig
from sidecar.mixin.panels import (
    GPUS,
    JOB,
    RANK,
    cluster_var,
    dashboard,
    job_var,
    namespace_var,
    query_var,
    row,
    timeseries,
)


def rank_drilldown(cfg: MixinConfig) -> dict:
    panels = [
        row("Training"),
        timeseries("Loss", f"sidecar_training_loss{{{RANK}}}", w=8),
        timeseries("Gradient norm", f"sidecar_training_grad_norm{{{RANK}}}", w=8),
        timeseries("Learning rate", f"sidecar_training_learning_rate{{{RANK}}}", w=8),
        timeseries(
            "Step time and watchdog timeout",
            [
                (f"sidecar_training_step_time_seconds{{{RANK}}}", "last step time"),
                (
                    "histogram_quantile(0.99, sum by (le) "
                    f"(rate(sidecar_training_step_duration_seconds_bucket{{{RANK}}}[$__rate_interval])))",
                    "p99 step time",
                ),
                (f"sidecar_watchdog_timeout_seconds{{{RANK}}}", "watchdog timeout"),
            ],
            "s",
            min_=0,
            w=8,
        ),
        timeseries(
            "Iterations per second",
            f"rate(sidecar_training_steps_total{{{RANK}}}[$__rate_interval])",
            "short",
            "Rate of the steps counter (sidecar_training_steps_total).",
            min_=0,
            w=8,
        ),
        timeseries("Step", f"sidecar_training_step{{{RANK}}}", w=8),
        timeseries(
            "Watchdog state",
            f"sidecar_rank_state{{{RANK}}} == 1",
            "short",
            "The rank's watchdog state over time.",
            bars=True,
            w=12,
        ),
        timeseries(
            "Phase",
            f"sidecar_training_phase{{{RANK}}} == 1",
            "short",
            "The phase the rank declared (checkpoint save, eval ...).",
            bars=True,
            w=12,
        ),
        row("Process"),
        timeseries(
            "CPU",
            f"rate(sidecar_process_cpu_seconds_total{{{RANK}}}[$__rate_interval])",
            "short",
            "Cores used by the rank and its children.",
            min_=0,
            w=8,
        ),
        timeseries("Resident memory", f"sidecar_process_resident_memory_bytes{{{RANK}}}", "bytes", min_=0, w=8),
        timeseries(
            "Threads, open files, children",
            [
                (f"sidecar_process_threads{{{RANK}}}", "threads"),
                (f"sidecar_process_open_fds{{{RANK}}}", "open fds"),
                (f"sidecar_process_children{{{RANK}}}", "children"),
            ],
            min_=0,
            w=8,
        ),
        timeseries(
            "Process state",
            f"sidecar_process_state{{{RANK}}} == 1",
            "short",
            "disk_sleep for long means blocked on I/O (a filesystem or a driver).",
            bars=True,
            w=12,
        ),
        timeseries(
            "Hook records dropped",
            f"increase(sidecar_hooks_dropped_records_total{{{RANK}}}[$__rate_interval])",
            "short",
            bars=True,
            min_=0,
            w=12,
        ),
        row("GPU"),
        timeseries("GPU memory of this rank", f"gpu:sidecar_gpu_process_memory_bytes{{{RANK}}}", "bytes", min_=0, w=8),
        timeseries(
            "Utilization of its GPUs",
            f"gpu:sidecar_gpu_utilization_ratio{{{GPUS}}}",
            "percentunit",
            min_=0,
            max_=1,
            w=8,
        ),
        timeseries("Temperature of its GPUs", f"gpu:sidecar_gpu_temperature_celsius{{{GPUS}}}", "celsius", w=8),
        timeseries("Power of its GPUs", f"gpu:sidecar_gpu_power_watts{{{GPUS}}}", "watt", min_=0, w=12),
        timeseries(
            "Clock event reasons of its GPUs",
            f'gpu:sidecar_gpu_clock_event_active{{{GPUS}, reason!="gpu_idle"}} == 1',
            "short",
            bars=True,
            stack=True,
            w=12,
        ),
    ]
    variables = [
        cluster_var(),
        namespace_var(),
        job_var(),
        query_var("rank", "Rank", f"label_values(sidecar_training_step{{{JOB}}}, rank)"),
        query_var("instance", "Node", f"label_values(sidecar_training_step{{{RANK}}}, instance)"),
        # The rank's GPUs, from the memory its processes hold; all of the node's when unknown.
        query_var(
            "gpu",
            "GPU",
            f"label_values(gpu:sidecar_gpu_process_memory_bytes{{{RANK}}}, gpu)",
            multi=True,
            include_all=True,
        ),
    ]
    return dashboard(
        cfg,
        "sidecar-rank-drilldown",
        "Rank drill-down",
        "One rank: its training metrics next to its process and its GPUs.",
        variables,
        panels,
    )
