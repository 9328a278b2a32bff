"""The single source of the Grafana dashboards: `python -m dashboards.build` writes
`dashboards/*.json`; a test fails when the files are not current.

Panels select with the template variables `$cluster` and `$namespace` (kube-prometheus-stack's
conventions), `$job_id`, `$instance` (the node), `$rank`, `$gpu` and `$device`, and query the
`${datasource}` variable (any Prometheus). Every selector names `$cluster` (the label a
multi-cluster setup adds, Thanos/Mimir external labels; its All value also matches series without
it, as on a single cluster). `$namespace` is the training pods' namespace: it narrows the jobs
offered (the ranks' series carry it, docs/operator-guide.md#pod-labels) and the per-rank panels
that read the ranks' own series. Job-level panels read
the recording rules of alerts/recording.rules.yml, so they stay cheap on a thousand nodes;
thresholds drawn on panels come from alerts/build.py's THRESHOLDS, the same numbers the
alerts use.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from alerts.build import counted, number, window
from sidecar.commands import generated

HERE = Path(__file__).resolve().parent
SCHEMA_VERSION = 39
DS = {"type": "prometheus", "uid": "${datasource}"}
TAGS = ["training-sidecar"]

# Selectors used throughout: one place to change how a cluster, job, node, rank or GPU is picked.
CLUSTER = 'cluster=~"$cluster"'
NAMESPACE = 'namespace=~"$namespace"'
JOB = f'{CLUSTER}, job_id="$job_id"'
NODES = 'instance=~"$instance"'
RANKS = f'{JOB}, {NAMESPACE}, {NODES}, rank=~"$rank"'  # the ranks' own series: they carry the namespace
NODE = f'{CLUSTER}, instance="$instance"'
GPUS = f'{NODE}, gpu=~"$gpu"'
RANK = f'{JOB}, rank="$rank"'


# ------------------------------------------------------------------ building blocks


def target(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> dict:
    t = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ref, "range": not instant}
    if instant:
        t["instant"] = True
        t["format"] = "table"
    return t


def _targets(queries: list[tuple[str, str]] | str, instant: bool = False) -> list[dict]:
    if isinstance(queries, str):
        queries = [(queries, "")]
    return [target(q, legend, chr(ord("A") + i), instant) for i, (q, legend) in enumerate(queries)]


def _thresholds(steps: list[tuple[float | None, str]]) -> dict:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


def timeseries(
    title: str,
    queries,
    unit: str = "short",
    description: str = "",
    *,
    w: int = 12,
    h: int = 8,
    min_: float | None = None,
    max_: float | None = None,
    stack: bool = False,
    bars: bool = False,
    threshold: float | None = None,
) -> dict:
    custom: dict[str, Any] = {
        "drawStyle": "bars" if bars else "line",
        "lineWidth": 1,
        "fillOpacity": 10,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
    }
    defaults: dict[str, Any] = {"unit": unit, "custom": custom, "color": {"mode": "palette-classic"}}
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    if threshold is not None:
        custom["thresholdsStyle"] = {"mode": "dashed"}
        defaults["thresholds"] = _thresholds([(None, "transparent"), (threshold, "red")])
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _targets(queries),
        "_size": (w, h),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(
    title: str,
    query: str,
    unit: str = "short",
    description: str = "",
    *,
    w: int = 4,
    h: int = 4,
    steps: list[tuple[float | None, str]] | None = None,
) -> dict:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _targets(query),
        "_size": (w, h),
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "color": {"mode": "thresholds"},
                "thresholds": _thresholds(steps or [(None, "green")]),
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background" if steps else "value",
            "graphMode": "none",
            "textMode": "auto",
            "justifyMode": "auto",
            "orientation": "auto",
        },
    }


def table(title: str, query: str, description: str = "", *, w: int = 12, h: int = 8) -> dict:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _targets(query, instant=True),
        "_size": (w, h),
        "fieldConfig": {"defaults": {}, "overrides": []},
        "transformations": [
            {
                "id": "organize",
                "options": {"excludeByName": {"Time": True, "Value": True, "__name__": True, "job": True}},
            }
        ],
        "options": {"showHeader": True},
    }


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "_size": (24, 1)}


def layout(panels: list[dict]) -> list[dict]:
    """Give every panel an id and a gridPos, filling rows of 24 columns left to right."""
    x = y = row_h = 0
    out = []
    for i, p in enumerate(panels, start=1):
        w, h = p.pop("_size")
        if p["type"] == "row" or x + w > 24:
            x, y, row_h = 0, y + row_h, 0
        p["id"] = i
        p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
        x += w
        row_h = max(row_h, h)
        if p["type"] == "row":
            x, y, row_h = 0, y + h, 0
        out.append(p)
    return out


def query_var(
    name: str, label: str, query: str, *, multi: bool = False, include_all: bool = False, hide: int = 0
) -> dict:
    v = {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DS,
        "hide": hide,
        "definition": query,
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery", "qryType": 1},
        "refresh": 2,
        "sort": 3 if name in ("rank", "gpu") else 1,
        "regex": "",
        "multi": multi,
        "includeAll": include_all,
        "current": {},
        "options": [],
    }
    if include_all:
        v["allValue"] = ".*"
    return v


def cluster_var() -> dict:
    """Every cluster's sidecars by default: All also matches series without a `cluster` label."""
    return query_var("cluster", "Cluster", "label_values(sidecar_build_info, cluster)", include_all=True)


def namespace_var() -> dict:
    """The training pods' namespaces (the ranks' pod labels); All also matches ranks outside Kubernetes."""
    return query_var(
        "namespace", "Namespace", f"label_values(sidecar_rank_state{{{CLUSTER}}}, namespace)", include_all=True
    )


def job_var(include_all: bool = False) -> dict:
    """The jobs with ranks in the chosen cluster and namespace."""
    return query_var(
        "job_id",
        "Job",
        f"label_values(sidecar_rank_state{{{CLUSTER}, {NAMESPACE}}}, job_id)",
        include_all=include_all,
    )


DATASOURCE_VAR = {
    "type": "datasource",
    "name": "datasource",
    "label": "Data source",
    "query": "prometheus",
    "hide": 0,
    "refresh": 1,
    "regex": "",
    "current": {},
    "options": [],
}

BUILTIN_ANNOTATIONS = {
    "builtIn": 1,
    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
    "enable": True,
    "hide": True,
    "iconColor": "rgba(0, 211, 255, 1)",
    "name": "Annotations & Alerts",
    "type": "dashboard",
}


def annotation(name: str, expr: str, color: str, title: str, text: str) -> dict:
    return {
        "name": name,
        "datasource": DS,
        "enable": True,
        "hide": False,
        "iconColor": color,
        "expr": expr,
        "step": "30s",
        "titleFormat": title,
        "textFormat": text,
        "tagKeys": "instance",
        "useValueForTime": False,
    }


def dashboard(
    uid: str, title: str, description: str, variables: list[dict], panels: list[dict], annotations: Sequence[dict] = ()
) -> dict:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": TAGS,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "timepicker": {},
        "links": [
            {
                "type": "dashboards",
                "tags": TAGS,
                "asDropdown": True,
                "title": "Sidecar",
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "templating": {"list": [DATASOURCE_VAR, *variables]},
        "annotations": {"list": [BUILTIN_ANNOTATIONS, *annotations]},
        "panels": layout(panels),
    }


# ------------------------------------------------------------------ the dashboards


def unneeded_kills_panel() -> dict:
    """Stalls of the job that were (or would have been) kills it did not need: would-have-killed
    counts of the observe-only watchdog, stalls that ended by themselves by phase, and the longest
    of those over the last hour (seconds, right axis)."""
    hour = window("false_alarm_window")
    panel = timeseries(
        "Kills a healthy job did not need",
        [
            (f"sum(increase(sidecar_watchdog_would_kill_total{{{JOB}}}[$__rate_interval]))", "would have killed"),
            (
                f"sum by (phase) (increase(sidecar_watchdog_false_alarms_total{{{JOB}}}[$__rate_interval]))",
                "false alarm: {{phase}}",
            ),
            (
                "histogram_quantile(1, sum by (le) "
                f"{counted(f'sidecar_watchdog_false_alarm_duration_seconds_bucket{{{JOB}}}', hour)})",
                f"longest false alarm ({hour})",
            ),
        ],
        "short",
        "Would have killed: stalls the watchdog held long enough to kill the worker group while observe-only "
        "(shadow mode) kept it from signalling (SidecarWouldHaveKilled). False alarm: ranks whose stall ended by "
        "itself, by the phase the rank was in (steps: none declared; one pause of the job counts each of its "
        "ranks); the job paused longer than its timeout and was healthy (evaluation, a slow checkpoint, a data "
        f"wait, one rank alone at work). Longest (right axis): the longest false alarm of the last {hour}, the "
        f"upper bound of its histogram bucket. False alarms at {int(number('false_alarms_per_hour'))} or more "
        f"moments within {hour} fire SidecarJobFalseAlarms: declare the phase or raise watchdog.floor_seconds "
        "above the longest (docs/runbook.md).",
        bars=True,
        min_=0,
    )
    panel["fieldConfig"]["overrides"].append(
        {
            "matcher": {"id": "byFrameRefID", "options": "C"},
            "properties": [
                {"id": "unit", "value": "s"},
                {"id": "custom.axisPlacement", "value": "right"},
                {"id": "custom.drawStyle", "value": "line"},
            ],
        }
    )
    return panel


def training_job() -> dict:
    ckpt_age = number("checkpoint_max_age_seconds")
    late = number("straggler_lateness_seconds")
    late_share = int(number("straggler_lateness_step_ratio") * 100)
    panels = [
        row("Progress"),
        stat("Step", f"job_id:sidecar_training_step:max{{{JOB}}}", description="Highest step of any rank."),
        stat("Ranks registered", f"sum(sidecar_training_ranks_registered{{{JOB}}})"),
        stat("World size", f"max(sidecar_training_world_size{{{JOB}}})"),
        stat(
            "Restarts",
            f"max(sidecar_training_restarts{{{JOB}}})",
            steps=[(None, "green"), (1, "orange")],
            description="torchrun restarts of the worker group (TORCHELASTIC_RESTART_COUNT).",
        ),
        stat(
            "Last checkpoint age",
            f"time() - max(sidecar_training_last_checkpoint_timestamp_seconds{{{JOB}}})",
            "s",
            steps=[(None, "green"), (ckpt_age, "red")],
            description="Work a failure would lose now (SidecarCheckpointStale fires past the red line).",
        ),
        stat("Last checkpoint step", f"max(sidecar_training_last_checkpoint_step{{{JOB}}})"),
        timeseries(
            "Loss",
            [
                (f"job_id:sidecar_training_loss:avg{{{JOB}}}", "job mean"),
                (f"sidecar_training_loss{{{RANKS}}}", "rank {{rank}}"),
            ],
        ),
        timeseries(
            "Gradient norm",
            [
                (f"job_id:sidecar_training_grad_norm:max{{{JOB}}}", "job max"),
                (f"sidecar_training_grad_norm{{{RANKS}}}", "rank {{rank}}"),
            ],
        ),
        timeseries(
            "Learning rate",
            [
                (f"job_id:sidecar_training_learning_rate:max{{{JOB}}}", "job max"),
                (f"sidecar_training_learning_rate{{{RANKS}}}", "rank {{rank}}"),
            ],
        ),
        timeseries(
            "Iterations per second",
            [
                (f"job_id:sidecar_training_steps:rate5m{{{JOB}}}", "job mean (5m)"),
                (f"rate(sidecar_training_steps_total{{{RANKS}}}[$__rate_interval])", "rank {{rank}}"),
            ],
            "short",
            "Rate of the steps counter (sidecar_training_steps_total).",
            min_=0,
        ),
        timeseries(
            "Tokens per second",
            [
                (f"job_id:sidecar_training_tokens:rate5m{{{JOB}}}", "job total (5m)"),
                (f"rate(sidecar_training_tokens_total{{{RANKS}}}[$__rate_interval])", "rank {{rank}}"),
            ],
            "short",
            "Rate of the tokens counter: ranks that send `tokens` per step.",
            min_=0,
        ),
        timeseries(
            "Samples per second",
            f"sum by (instance) (rate(sidecar_training_samples_total{{{JOB}, {NODES}}}[$__rate_interval]))",
            "short",
            "Rate of the samples counter, per node.",
            min_=0,
        ),
        row("Health"),
        timeseries(
            "Ranks by state",
            f"job_id_state:sidecar_rank_state:count{{{JOB}}}",
            "short",
            "Ranks per watchdog state; anything but healthy deserves a look.",
            stack=True,
            min_=0,
        ),
        timeseries(
            "Stalls and remediations",
            [
                (f"sum(increase(sidecar_watchdog_stalls_total{{{JOB}}}[$__rate_interval]))", "stalls"),
                (
                    f"sum by (outcome) (increase(sidecar_watchdog_remediations_total{{{JOB}}}[$__rate_interval]))",
                    "remediation {{outcome}}",
                ),
            ],
            "short",
            bars=True,
            min_=0,
        ),
        unneeded_kills_panel(),
        timeseries(
            "Goodput",
            [(f"job_id:sidecar_goodput:ratio1h{{{JOB}}}", "productive share, 1h")],
            "percentunit",
            "The share of the job's wall time spent on productive steps over the last hour (stalls, recoveries and "
            "steps redone after a resume are not). SidecarJobGoodputLow fires below the threshold.",
            min_=0,
        ),
        timeseries(
            "Where recovery time goes",
            [
                (
                    f"sum by (stage) (increase(sidecar_recovery_stage_seconds_sum{{{CLUSTER}, {NODES}}}[$__range]))\n"
                    f"/ sum by (stage) (increase(sidecar_recovery_stage_seconds_count{{{CLUSTER}, {NODES}}}[$__range]))",
                    "{{stage}}",
                )
            ],
            "s",
            "Mean seconds of each stage of a recovery over the dashboard's range: detect, dump, decide (the job "
            "view's verdict and the other nodes' dumps), kill, restart, rendezvous, load, first_step, redo "
            "(steps trained again). `sidecar incidents` has each incident's own.",
            bars=True,
            min_=0,
        ),
        table(
            "Rank holding the job up",
            f"job_id_rank:sidecar_rank_holding_job_up{{{JOB}}}",
            "The rank at the job's lowest step that does not wait for its peers while they wait for it in a "
            "collective, with its node (the JobHungOnRank rule: from every rank's Flight Recorder sequences "
            "where they decide it, else from its step and stack; see the evidence column).",
        ),
        table(
            "Ranks not healthy",
            f'sidecar_rank_state{{{JOB}, state!="healthy"}} == 1',
            "Ranks in any state but healthy, with their node.",
        ),
        timeseries(
            "Rank exits by reason",
            [
                (
                    f'sum by (reason) (increase(sidecar_rank_exits_total{{{JOB}, {NODES}, reason!="finished"}}'
                    f"[$__rate_interval]))",
                    "{{reason}}",
                )
            ],
            "short",
            "Why rank processes died (sidecar_rank_exits_total): exception/cuda_oom, oom_killed (kernel), "
            "exception/collective_timeout, gpu_error, watchdog, signal, ... `sidecar incidents` on the node has "
            "the evidence of each.",
            bars=True,
            min_=0,
        ),
        table(
            "Failures by cause (24h)",
            f"sum by (instance, reason) (increase(sidecar_job_failures_total{{{JOB}, {NODES}}}[24h])) > 0",
            "Worker-group failures per node over the last day, by the reason of the first rank to exit "
            "(the likely cause); SidecarJobRestartLoop names the most frequent.",
        ),
        timeseries(
            "Seconds since last progress",
            f"time() - sidecar_training_last_progress_timestamp_seconds{{{RANKS}}}",
            "s",
            "Age of each rank's last step (the watchdog acts on its own per-rank timeout).",
            min_=0,
        ),
        row("Load balance"),
        timeseries(
            "Step time per node (slowest rank)",
            [
                (
                    f"job_id_instance:sidecar_training_step_duration_seconds:max_mean5m{{{JOB}, {NODES}}}",
                    "{{instance}}",
                ),
                (f"job_id:sidecar_training_step_duration_seconds:median_mean5m{{{JOB}}}", "job median"),
                (f"job_id:sidecar_training_step_duration_seconds:p99_5m{{{JOB}}}", "job p99"),
            ],
            "s",
            "Each rank's mean step time over 5m, from the step-time histogram "
            "(sidecar_training_step_duration_seconds); spikes between scrapes show in the p99.",
            min_=0,
        ),
        timeseries(
            "Step time: slowest rank / median",
            f"job_id:sidecar_training_step_duration_seconds:max_over_median{{{JOB}}}",
            "short",
            "Mean step times over 5m; 1 is perfectly balanced. A rank with more work of its own shows here; "
            "a straggler in a data-parallel job does not (every rank waits for it, so every step time is the "
            "same): see the lateness per rank.",
            min_=1,
        ),
        timeseries(
            "Lateness per rank",
            f"sidecar_rank_lateness_seconds{{{RANKS}}}",
            "s",
            "How long after its group's first member each rank enters its collectives (median over its newest "
            "collectives, from the ranks' Flight Recorders, judged on its node or across the job by the job "
            "view's coordinator). Every rank waits for the late one at every step. SidecarStragglerRank fires "
            f"above the dashed line when the lateness is also more than {late_share}% of the job's median step "
            f"time, for {window('straggler_for')}.",
            threshold=late,
            min_=0,
        ),
        timeseries(
            "GPU utilization per node",
            f"job_id_instance:sidecar_gpu_utilization_ratio:avg{{{JOB}, {NODES}}}",
            "percentunit",
            min_=0,
            max_=1,
        ),
        timeseries(
            "GPU utilization spread across nodes",
            f"job_id:sidecar_gpu_utilization_ratio:spread{{{JOB}}}",
            "percentunit",
            "Busiest node minus idlest node.",
            min_=0,
            max_=1,
        ),
    ]
    annotations = [
        annotation(
            "Stalls",
            f"sum by (instance) (increase(sidecar_watchdog_stalls_total{{{JOB}}}[1m])) > 0",
            "red",
            "Stall",
            "watchdog stall on {{instance}}",
        ),
        annotation(
            "Remediations",
            f"sum by (instance, outcome) (increase(sidecar_watchdog_remediations_total{{{JOB}}}[1m])) > 0",
            "orange",
            "Remediation",
            "{{outcome}} on {{instance}}",
        ),
        annotation(
            "Restarts",
            f"max by (instance) (changes(sidecar_training_restarts{{{JOB}}}[1m])) > 0",
            "purple",
            "Restart",
            "worker group restarted on {{instance}}",
        ),
        annotation(
            "Failures",
            f"sum by (instance, reason) (increase(sidecar_job_failures_total{{{JOB}}}[1m])) > 0",
            "red",
            "Failure",
            "{{reason}} on {{instance}}",
        ),
    ]
    variables = [
        cluster_var(),
        namespace_var(),
        job_var(),
        query_var(
            "instance",
            "Node",
            f"label_values(sidecar_training_ranks_registered{{{JOB}}}, instance)",
            multi=True,
            include_all=True,
        ),
        query_var(
            "rank", "Rank", f"label_values(sidecar_training_step{{{JOB}, {NODES}}}, rank)", multi=True, include_all=True
        ),
    ]
    return dashboard(
        "sidecar-training-job",
        "Training job overview",
        "One training job across its nodes: progress, health, load balance.",
        variables,
        panels,
        annotations,
    )


def gpu_parity_panels() -> list[dict]:
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


def node_hardware() -> dict:
    margin = number("thermal_margin_celsius")
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
            threshold=number("pcie_replays_per_second"),
        ),
        timeseries(
            "GPU memory per rank",
            f"gpu:sidecar_gpu_process_memory_bytes{{{GPUS}}}",
            "bytes",
            "Memory each rank's processes hold on each GPU.",
            min_=0,
            w=8,
        ),
        *gpu_parity_panels(),
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
        # Every node when Job is All (job_id=~".*" also matches build_info's missing job_id),
        # else the nodes where the job has ranks.
        query_var(
            "instance",
            "Node",
            'label_values({__name__=~"sidecar_build_info|sidecar_training_ranks_registered", '
            f'{CLUSTER}, job_id=~"$job_id"}}, instance)',
        ),
        query_var("gpu", "GPU", f"label_values(gpu:sidecar_gpu_info{{{NODE}}}, gpu)", multi=True, include_all=True),
        query_var("device", "NIC", f"label_values(sidecar_network_up{{{NODE}}}, device)", multi=True, include_all=True),
    ]
    return dashboard(
        "sidecar-node-hardware",
        "Node hardware",
        "One node's GPUs, NVLink, PCIe, NICs, InfiniBand, CPU, memory and checkpoint disk.",
        variables,
        panels,
    )


def rank_drilldown() -> dict:
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
                    f"histogram_quantile(0.99, sum by (le) (rate(sidecar_training_step_duration_seconds_bucket{{{RANK}}}"
                    f"[$__rate_interval])))",
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
        query_var("rank", "Rank", f"label_values(sidecar_training_step{{{JOB}, {NAMESPACE}}}, rank)"),
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
        "sidecar-rank-drilldown",
        "Rank drill-down",
        "One rank: its training metrics next to its process and its GPUs.",
        variables,
        panels,
    )


DASHBOARDS = {
    "training-job.json": training_job,
    "node-hardware.json": node_hardware,
    "rank-drilldown.json": rank_drilldown,
}


def rendered_files() -> dict[str, str]:
    return {name: json.dumps(make(), indent=2) + "\n" for name, make in DASHBOARDS.items()}


def write(out_dir: Path = HERE) -> list[Path]:
    """Write the dashboards that differ into out_dir; the paths written."""
    return generated.write(out_dir, rendered_files())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dashboards.build", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE, help="directory for the JSON files (default: dashboards/)")
    args = p.parse_args(argv)
    for path in write(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
