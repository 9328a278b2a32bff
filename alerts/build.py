"""The single source of the Prometheus rules: thresholds, recording rules and alerts.

`python -m alerts.build` writes `alerts/*.rules.yml` from this file; a test fails when the
files are not current. Edit thresholds in `THRESHOLDS` (and the selectors that depend on how
Prometheus scrapes the sidecars in `SELECTORS`, or pass `--selector`), then regenerate. `sidecar provision`
reads the generated files (with `--alerts grafana` it converts the alerts to Grafana-managed
rules), so Prometheus, Grafana and the dashboards all follow the same numbers.

Every alert carries `labels.severity` (critical pages, warning and info open tickets, see
deploy/alertmanager/alertmanager.yml) and the annotations `summary`, `description` and
`runbook_url` (a section of docs/runbook.md named after the alert).

Label conventions: `job_id` is the training job, `rank` the rank, `gpu` the GPU index,
`device`/`port` a NIC or InfiniBand port; `instance` (from the scrape target) is the node.
Alerts aggregate `by` the labels that name what is broken, so they do not depend on the
scrape job's name or extra target labels.

Tenant and cluster: job ids repeat across namespaces and clusters, so every rule about a job
aggregates and joins by `namespace, cluster, job_id`, and every rule about a node or its
hardware by `cluster, instance` (a node belongs to the platform, not to a tenant).
`by` keeps a label only where the series carry it: `cluster` where a multi-cluster setup adds
it (Thanos/Mimir external labels, a ruler that sees it), `namespace` on the rank series in
Kubernetes (docs/operator-guide.md#pod-labels). The sidecar's job-level series (no `rank`:
`sidecar_training_world_size`, `sidecar_job_failures_total`, ...) carry no `namespace`: a join
of a rank series with one of them matches `on (cluster, job_id)` and keeps the rank side's
labels, and alerts built on them alone carry `cluster` but no `namespace`.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from alerts import gpu_source
from sidecar.collectors.xid import HARDWARE_XIDS
from sidecar.commands import generated

HERE = Path(__file__).resolve().parent

# Where the runbook is published; each alert links to `#<alertname in lower case>`.
# Point it at your own copy with `python -m alerts.build --runbook-base-url URL`.
RUNBOOK_BASE_URL = "https://github.com/training-sidecar/training-sidecar/blob/main/docs/runbook.md"

# Selectors of the series that depend on how Prometheus scrapes the sidecars, not on the sidecars.
# Set them with `python -m alerts.build --selector NAME=SELECTOR`.
SELECTORS: dict[str, str] = {
    # The sidecars' scrape targets, for `up` (SidecarDown). The ServiceMonitor's `jobLabel` keeps
    # job="sidecar" whatever the Service is named (a kustomize namePrefix included), and the bare-metal
    # scrape job is named so (deploy/baremetal/prometheus.yml); a Prometheus that names it otherwise
    # sets its own.
    "sidecar_targets": 'job="sidecar"',
}

THRESHOLDS: dict[str, float | str] = {
    # --- watchdog and progress
    "rank_stalled_for": "2m",  # a stall the watchdog has not cleared within this pages
    "job_hung_for": "1m",
    "goodput_low_ratio": 0.8,  # the job spent less than this share of the last hour on productive steps
    "goodput_low_for": "30m",  # a rank holding its job up this long (the watchdog usually acts within seconds)
    "no_progress_seconds": 1800,  # no rank of the job advanced its step for this long
    "storm_killed_per_hour": 3,  # watchdog kills of one job per hour that count as a storm
    "restarts_per_hour": 3,  # worker-group restarts of one job per hour (any cause)
    "exit_window": "15m",  # a rank exit of a given reason keeps its alert this long
    # --- kills a healthy job did not need (issue 29)
    "false_alarms_per_hour": 3,  # stalls of one job that ended by themselves within the hour: its floor is too low
    "false_alarm_window": "1h",
    "would_kill_window": "10m",  # a stall the observe-only watchdog would have killed keeps its alert this long
    # --- collectives (the ranks' Flight Recorder records, from the recording rules)
    "collective_still_for": "2m",  # no member of a process group enqueued or completed a collective this long: a hang
    "collective_record_stale_seconds": 30,  # a rank's record this old stopped coming (hooks send one every few seconds)
    "verdict_window": "1h",  # a stall verdict (sidecar_stall_verdicts_total) keeps its alert this long
    # --- training signals (job level, from the recording rules)
    "grad_norm_factor": 10,  # grad norm above this multiple of its median over the last hour
    "lr_jump_factor": 2,  # learning rate above this multiple of its maximum over the last hour
    "throughput_drop_ratio": 0.7,  # it/s below this share of its average over the last hour
    # a rank's lateness (sidecar_rank_lateness_seconds: how long after its group's first member it
    # enters its collectives, median over its window) above this floor AND this share of the job's
    # median step time is a straggler
    "straggler_lateness_seconds": 0.05,
    "straggler_lateness_step_ratio": 0.2,
    "straggler_for": "10m",
    "checkpoint_max_age_seconds": 7200,  # newest checkpoint older than this while the job trains
    "progress_recent_seconds": 600,  # "the job trains": some rank advanced within this long
    # --- checkpoint filesystem
    "disk_predict_hours": 4,  # free space predicted to run out within this many hours
    "disk_filling_free_ratio": 0.25,  # ... and less than this share is free now
    "disk_almost_full_free_ratio": 0.05,
    # --- GPU
    # XIDs whose documented recovery is a GPU reset or node reboot (NVIDIA's XID catalogue):
    # 48 double-bit ECC, 61/62 internal micro-controller breakpoint/halt, 64 row remapping
    # failure, 74 NVLink error, 79 fallen off the bus, 94/95 contained/uncontained ECC,
    # 119/120 GSP timeout/error, 140 unrecovered ECC.
    "xid_critical": "|".join(str(x) for x in sorted(HARDWARE_XIDS)),
    "xid_window": "1h",  # an XID keeps its alert this long
    "thermal_margin_celsius": 3,  # temperature within this of the slowdown threshold
    "nvlink_errors_per_second": 1,
    "pcie_replays_per_second": 0.1,
    "pcie_busy_ratio": 0.5,  # link generation is judged only while the GPU is this busy (it downshifts at idle)
    # --- network
    "ib_errors_per_10m": 10,  # symbol + receive errors per InfiniBand port in 10 minutes
    "nic_errors_per_second": 1,
    "nic_carrier_changes_per_15m": 2,
}
T = THRESHOLDS


def window(key: str) -> str:
    """A threshold that is a PromQL duration ("1h")."""
    value = THRESHOLDS[key]
    if not isinstance(value, str):
        raise TypeError(f"threshold {key} is a number, not a duration")
    return value


def number(key: str) -> float:
    """A threshold that is a number (drawn on dashboards as well)."""
    value = THRESHOLDS[key]
    if isinstance(value, str):
        raise TypeError(f"threshold {key} is text, not a number")
    return value


@dataclass
class Alert:
    name: str
    expr: str
    severity: str
    summary: str
    description: str
    for_: str = "0m"

    def rule(self, runbook_base_url: str, for_override: str | None) -> dict:
        assert self.severity in ("critical", "warning", "info"), self.name
        return {
            "alert": self.name,
            "expr": _clean(self.expr),
            "for": for_override if for_override is not None else self.for_,
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook_url": f"{runbook_base_url}#{self.name.lower()}",
            },
        }


@dataclass
class Record:
    record: str
    expr: str
    labels: dict[str, str] = field(default_factory=dict)

    def rule(self, *_: object) -> dict:
        out = {"record": self.record, "expr": _clean(self.expr)}
        return {**out, "labels": self.labels} if self.labels else out


@dataclass
class Group:
    name: str
    rules: list = field(default_factory=list)


def _clean(expr: str) -> str:
    return "\n".join(line.rstrip() for line in expr.strip().splitlines())


def _indent(expr: str, spaces: int) -> str:
    """A multi-line expression inside parentheses: its lines after the first indented."""
    return ("\n" + " " * spaces).join(expr.splitlines())


def increased(selector: str, window: str, by: str) -> str:
    """A counter went up within `window`. `increase` alone misses a series that first appears
    already at 1 (an XID the collector has never seen before), so a series that is new and
    non-zero counts as well."""
    return (
        f"sum by ({by}) (increase({selector}[{window}])) > 0\n"
        f"or sum by ({by}) ({selector} > 0 unless {selector} offset {window})"
    )


def counted(selector: str, window: str) -> str:
    """How much each series of a counter grew within `window`, one result per series: `increase`
    for a series that existed `window` ago, its highest value for one that is newer (a counter
    created at its first event, 1, grew by 1: `increase` alone would miss that first event)."""
    return (
        f"(\n  increase({selector}[{window}]) and {selector} offset {window}\n"
        f"  or max_over_time({selector}[{window}])\n)"
    )


LABELS_RANK = "{{ $labels.job_id }} rank {{ $labels.rank }} on {{ $labels.instance }}"
RESTARTS = (
    "max by (namespace, cluster, job_id) (sidecar_training_restarts)\n"
    f"- min by (namespace, cluster, job_id) (min_over_time(sidecar_training_restarts[1h])) >= {T['restarts_per_hour']}"
)
LABELS_GPU = "GPU {{ $labels.gpu }} on {{ $labels.instance }}"

# The ranks' collective records (PyTorch's Flight Recorder, per rank and process group `pg`).
ENQUEUED = "sidecar_rank_collective_enqueued_seq"
COMPLETED = "sidecar_rank_collective_completed_seq"
# Some member of the (job_id, pg) group enqueued or completed a collective within the window: the
# group moves, whatever a single scrape shows in flight.
GROUP_MOVED = (
    f"changes({ENQUEUED}[{T['collective_still_for']}]) > 0\nor changes({COMPLETED}[{T['collective_still_for']}]) > 0"
)
# Some rank of the job advanced its step within the window.
JOB_STEPPED = f"changes(sidecar_training_step[{T['collective_still_for']}]) > 0"
# Stalls that ended by themselves (a pause the watchdog took for a hang). The counter counts ranks: one
# pause of a job is a false alarm of each of its ranks on every node. Counted instead: the moments a
# node's count for the job rose (the ranks of one pause resume together), on the node that saw the
# most; the job's registered ranks stand for 0 on a node before its first false alarm there.
FALSE_ALARMS = "sidecar_watchdog_false_alarms_total"
FALSE_ALARM_MOMENTS = (
    "max by (namespace, cluster, job_id) (\n"
    "  changes(\n"
    "    (\n"
    f"      sum by (namespace, cluster, job_id, instance) ({FALSE_ALARMS})\n"
    "      or 0 * sum by (namespace, cluster, job_id, instance) (sidecar_training_ranks_registered)\n"
    f"    )[{T['false_alarm_window']}:]\n"
    "  )\n"
    ")"
)
NOT_PROGRESSING = 'sidecar_rank_state{state=~"suspect|stalled|remediating"} == 1'
NODE = "max by (cluster, instance, node) (sidecar_node_info)"

# ------------------------------------------------------------------ recording rules

RECORDING = Group(
    "sidecar-recording",
    [
        Record(
            "job_id_instance:sidecar_training_step:max",
            "max by (namespace, cluster, job_id, instance) (sidecar_training_step)",
        ),
        Record(
            "job_id:sidecar_training_step:max",
            "max by (namespace, cluster, job_id) (job_id_instance:sidecar_training_step:max)",
        ),
        # Throughput and step time from the counters and the histogram (rate() over 5m), not the
        # last-value gauges: nothing between two scrapes is lost. Ranks step together, so the job's
        # steps per second is the mean over its ranks; samples and tokens add up.
        Record(
            "job_id_instance:sidecar_training_steps:rate5m",
            "avg by (namespace, cluster, job_id, instance) (rate(sidecar_training_steps_total[5m]))",
        ),
        Record(
            "job_id:sidecar_training_steps:rate5m",
            "avg by (namespace, cluster, job_id) (rate(sidecar_training_steps_total[5m]))",
        ),
        Record(
            "job_id:sidecar_training_samples:rate5m",
            "sum by (namespace, cluster, job_id) (rate(sidecar_training_samples_total[5m]))",
        ),
        Record(
            "job_id:sidecar_training_tokens:rate5m",
            "sum by (namespace, cluster, job_id) (rate(sidecar_training_tokens_total[5m]))",
        ),
        # Each rank's mean step time over 5m, from the histogram's sum and count.
        Record(
            "job_id_rank:sidecar_training_step_duration_seconds:mean5m",
            "sum by (namespace, cluster, job_id, rank, instance) (rate(sidecar_training_step_duration_seconds_sum[5m]))\n"
            "/ sum by (namespace, cluster, job_id, rank, instance) (rate(sidecar_training_step_duration_seconds_count[5m]))",
        ),
        Record(
            "job_id_instance:sidecar_training_step_duration_seconds:max_mean5m",
            "max by (namespace, cluster, job_id, instance) (job_id_rank:sidecar_training_step_duration_seconds:mean5m)",
        ),
        Record(
            "job_id:sidecar_training_step_duration_seconds:median_mean5m",
            "quantile by (namespace, cluster, job_id) (0.5, job_id_rank:sidecar_training_step_duration_seconds:mean5m)",
        ),
        # The slowest rank relative to the median rank: 1 is perfectly balanced.
        Record(
            "job_id:sidecar_training_step_duration_seconds:max_over_median",
            "max by (namespace, cluster, job_id) (job_id_rank:sidecar_training_step_duration_seconds:mean5m)\n"
            "/ job_id:sidecar_training_step_duration_seconds:median_mean5m",
        ),
        # Step-time quantiles of the whole job from the buckets (spikes a scrape interval would hide).
        Record(
            "job_id:sidecar_training_step_duration_seconds:p50_5m",
            "histogram_quantile(0.5, sum by (namespace, cluster, job_id, le) (rate(sidecar_training_step_duration_seconds_bucket[5m])))",
        ),
        Record(
            "job_id:sidecar_training_step_duration_seconds:p99_5m",
            "histogram_quantile(0.99, sum by (namespace, cluster, job_id, le) (rate(sidecar_training_step_duration_seconds_bucket[5m])))",
        ),
        Record("job_id:sidecar_training_loss:avg", "avg by (namespace, cluster, job_id) (sidecar_training_loss)"),
        Record(
            "job_id:sidecar_training_grad_norm:max", "max by (namespace, cluster, job_id) (sidecar_training_grad_norm)"
        ),
        Record(
            "job_id:sidecar_training_learning_rate:max",
            "max by (namespace, cluster, job_id) (sidecar_training_learning_rate)",
        ),
        Record(
            "job_id_state:sidecar_rank_state:count",
            "count by (namespace, cluster, job_id, state) (sidecar_rank_state == 1)",
        ),
        # The job view without the sidecars (docs/architecture.md): every rank of a hung job soon
        # waits for the culprit in a collective, so the rank holding the job up is the one at the
        # job's lowest step, suspect or stalled, whose latest stack does not wait; `node` names its
        # node (sidecar_node_info).
        Record("job_id:sidecar_training_step:min", "min by (namespace, cluster, job_id) (sidecar_training_step)"),
        # Goodput: the share of the job's wall time spent on productive steps over the last hour
        # (sidecar_job_seconds_total; every node counts the job's time, so the ratio is averaged).
        Record(
            "job_id:sidecar_goodput:ratio1h",
            "avg by (namespace, cluster, job_id) (\n"
            '  sum by (namespace, cluster, job_id, instance) (rate(sidecar_job_seconds_total{state="productive"}[1h]))\n'
            "  / sum by (namespace, cluster, job_id, instance) (rate(sidecar_job_seconds_total[1h]))\n"
            ")",
        ),
        # From the backend's own record first (PyTorch's Flight Recorder, docs/architecture.md): per
        # job and process group, how many collectives a rank's last enqueued one is below the
        # group's highest, kept only while some member waits in one (enqueued > completed). A rank
        # behind while its peers wait is late to the collective they wait in.
        Record(
            "job_id_pg_rank:sidecar_rank_collective_behind:seq",
            "(\n"
            f"  max by (namespace, cluster, job_id, pg) ({ENQUEUED})\n"
            f"  - on (namespace, cluster, job_id, pg) group_right max by (namespace, cluster, job_id, pg, rank, instance) ({ENQUEUED})\n"
            ") > 0\n"
            f"and on (namespace, cluster, job_id, pg) ({ENQUEUED} > {COMPLETED})",
        ),
        # The late rank that holds its job up: behind in a group where nothing moved for the window,
        # waiting in no other group itself (a rank late in one group because it waits in another is
        # a victim; the chain ends at the culprit) unless its record stopped coming (its process no
        # longer runs), not progressing by its watchdog (which knows declared phases: a checkpoint
        # save on one rank while the others wait in a barrier is no hang), and no rank of the job
        # stepped within the window.
        Record(
            "job_id_rank:sidecar_rank_late_to_collective",
            "max by (namespace, cluster, job_id, rank, instance) (\n"
            "  job_id_pg_rank:sidecar_rank_collective_behind:seq\n"
            "  unless on (namespace, cluster, job_id, pg) (\n"
            f"    {_indent(GROUP_MOVED, 4)}\n"
            "  )\n"
            "  unless on (namespace, cluster, job_id, rank, instance) (\n"
            f"    {ENQUEUED} > {COMPLETED}\n"
            "    unless on (namespace, cluster, job_id, rank, instance)\n"
            f"    (sidecar_rank_collective_record_age_seconds > {T['collective_record_stale_seconds']})\n"
            "  )\n"
            f"  and on (namespace, cluster, job_id, rank, instance) ({NOT_PROGRESSING})\n"
            f"  unless on (namespace, cluster, job_id) ({JOB_STEPPED})\n"
            ") * 0 + 1",
        ),
        # A collective every member of a process group entered and none completed: every member
        # waits at one sequence (the value), nothing in the group moved for the window, every rank
        # of the job sends a fresh record (their processes live; none is missing: a gone rank or a
        # lost node is not the backend's fault) and no rank of the job stepped. No rank is to blame.
        Record(
            "job_id_pg:sidecar_collective_stuck:seq",
            f"(max by (namespace, cluster, job_id, pg) ({ENQUEUED}) == min by (namespace, cluster, job_id, pg) ({ENQUEUED}))\n"
            "and on (namespace, cluster, job_id, pg) (\n"
            f"  count by (namespace, cluster, job_id, pg) ({ENQUEUED} > {COMPLETED})\n"
            f"  == count by (namespace, cluster, job_id, pg) ({ENQUEUED})\n"
            ")\n"
            "unless on (namespace, cluster, job_id, pg) (\n"
            f"  {_indent(GROUP_MOVED, 2)}\n"
            ")\n"
            "and on (namespace, cluster, job_id) (\n"
            "  count by (namespace, cluster, job_id) (sidecar_rank_collective_record_age_seconds"
            f" < {T['collective_record_stale_seconds']})\n"
            # world_size is a job-level series (no namespace): matched on (cluster, job_id).
            "  >= on (cluster, job_id) group_left max by (cluster, job_id) (sidecar_training_world_size)\n"
            ")\n"
            f"unless on (namespace, cluster, job_id) ({JOB_STEPPED})",
        ),
        # The rank holding its job up, with the evidence that named it: its collective record
        # first; where the job's ranks name none that way (no record: an older torch, the recorder
        # off), the rank at the job's lowest step, not progressing, whose latest stack does not wait.
        Record(
            "job_id_rank:sidecar_rank_holding_job_up",
            "(\n"
            '  label_replace(job_id_rank:sidecar_rank_late_to_collective, "evidence", "collectives", "", "")\n'
            "  or on (namespace, cluster, job_id)\n"
            "  label_replace(\n"
            "    max by (namespace, cluster, job_id, rank, instance) (\n"
            "      (sidecar_training_step == on (namespace, cluster, job_id) group_left job_id:sidecar_training_step:min)\n"
            "      and on (namespace, cluster, job_id, rank, instance) (sidecar_rank_waiting_in_collective == 0)\n"
            f"      and on (namespace, cluster, job_id, rank, instance) ({NOT_PROGRESSING})\n"
            "    ) * 0 + 1,\n"
            '    "evidence", "stacks", "", ""\n'
            "  )\n"
            ")\n"
            f"* on (cluster, instance) group_left (node) {NODE}",
        ),
        # GPU metrics (gpu:*, from either GPU source, alerts/gpu_source.py) carry no job label: a node belongs to the jobs that have ranks registered on it.
        Record(
            "job_id_instance:sidecar_gpu_utilization_ratio:avg",
            "avg by (cluster, instance) (gpu:sidecar_gpu_utilization_ratio)\n"
            "* on (cluster, instance) group_right\n"
            "group by (namespace, cluster, job_id, instance) (sidecar_training_ranks_registered)",
        ),
        Record(
            "job_id:sidecar_gpu_utilization_ratio:spread",
            "max by (namespace, cluster, job_id) (job_id_instance:sidecar_gpu_utilization_ratio:avg)\n"
            "- min by (namespace, cluster, job_id) (job_id_instance:sidecar_gpu_utilization_ratio:avg)",
        ),
    ],
)

# ------------------------------------------------------------------ alerts

STEP_RATE = "deriv(job_id:sidecar_training_step:max[5m]) > 0"

TRAINING = Group(
    "sidecar-training",
    [
        Alert(
            "JobHungOnRank",
            "max by (namespace, cluster, job_id, rank, node) (job_id_rank:sidecar_rank_holding_job_up) == 1",
            "critical",
            "Job {{ $labels.job_id }} is held up by rank {{ $labels.rank }} on {{ $labels.node }}",
            "Rank {{ $labels.rank }} of job {{ $labels.job_id }} (node {{ $labels.node }}) has not progressed and its "
            "peers wait for it in a collective: by the ranks' Flight Recorders it has not entered the collective they "
            f"wait in and nothing in the group moved for {window('collective_still_for')}, or, where the ranks send no "
            "collective record, it is at the job's lowest step and its stack shows it running its own code. The "
            "sidecars kill its node's worker group unless remediation is off or capped; `sidecar incidents --job "
            "{{ $labels.job_id }}` on any node of the job tells the story.",
            for_=window("job_hung_for"),
        ),
        Alert(
            "SidecarCollectiveStuck",
            "max by (namespace, cluster, job_id, pg, node) (\n"
            f"  ({ENQUEUED} and on (namespace, cluster, job_id, pg) job_id_pg:sidecar_collective_stuck:seq)\n"
            f"  * on (cluster, instance) group_left (node) {NODE}\n"
            ")",
            "critical",
            'Collective #{{ $value | printf "%.0f" }} of process group {{ $labels.pg }} is stuck in job '
            "{{ $labels.job_id }} on {{ $labels.node }}",
            "Every rank of process group {{ $labels.pg }} of job {{ $labels.job_id }} entered collective "
            '#{{ $value | printf "%.0f" }} and none completed it; the ranks live (their Flight Recorder records '
            f"keep coming), nothing in the group moved for {window('collective_still_for')} and the job does not step. "
            "No rank is late: the backend or the network between the nodes (this alert fires once per node of the "
            "group; {{ $labels.node }} is one) holds the job. Check the nodes' NICs and InfiniBand ports and NCCL's "
            "transport; `sidecar incidents --job {{ $labels.job_id }}` shows each rank's record, `sidecar incidents "
            "--full` on a node the incident's Flight Recorder dumps (`.fr`).",
            for_=window("job_hung_for"),
        ),
        Alert(
            "SidecarCollectiveMismatch",
            increased(
                'sidecar_stall_verdicts_total{kind="collective_mismatch"}',
                window("verdict_window"),
                "namespace, cluster, job_id",
            ),
            "critical",
            "Collective desync in job {{ $labels.job_id }}",
            "The ranks of job {{ $labels.job_id }} hung in different collectives at one sequence of a process group "
            "(another op, or other input shapes): a desync, a bug in the program that a restart repeats. No rank "
            "is to blame and restarting does not help: `sidecar incidents --job {{ $labels.job_id }}` names the "
            "group, the sequence and each rank's collective; fix the code path that issues them.",
        ),
        Alert(
            "SidecarJobGoodputLow",
            f"job_id:sidecar_goodput:ratio1h < {T['goodput_low_ratio']}",
            "warning",
            "Job {{ $labels.job_id }} trains only {{ $value | humanizePercentage }} of the time",
            f"Over the last hour job {{{{ $labels.job_id }}}} spent less than {int(number('goodput_low_ratio') * 100)}% "
            "of its wall time on productive steps: the rest went to stalls, recoveries and steps trained again "
            "after resumes (sidecar_job_seconds_total by state; the job dashboard's 'Where recovery time goes').",
            for_=window("goodput_low_for"),
        ),
        Alert(
            "SidecarRankStalled",
            'max by (namespace, cluster, job_id, instance, rank) (sidecar_rank_state{state=~"stalled|remediating"}) == 1',
            "critical",
            f"Rank stalled: {LABELS_RANK}",
            "The watchdog saw no progress from this rank within its timeout and has not recovered it "
            "(remediation failed, was suppressed, or the watchdog is observe-only).",
            for_=window("rank_stalled_for"),
        ),
        Alert(
            "SidecarJobNotProgressing",
            f"time() - max by (namespace, cluster, job_id) (sidecar_training_last_progress_timestamp_seconds) > {T['no_progress_seconds']}\n"
            "and max by (namespace, cluster, job_id) (sidecar_training_last_progress_timestamp_seconds) > 0",
            "critical",
            "Job {{ $labels.job_id }} is not progressing",
            f"No rank of job {{{{ $labels.job_id }}}} advanced its step for {int(T['no_progress_seconds']) // 60} minutes, "
            "on any node.",
            for_="5m",
        ),
        Alert(
            "SidecarRemediationStorm",
            'sum by (namespace, cluster, job_id, instance) (increase(sidecar_watchdog_remediations_total{outcome="suppressed"}[15m])) > 0\n'
            'or sum by (namespace, cluster, job_id) (increase(sidecar_watchdog_remediations_total{outcome="killed"}[1h]))'
            f" >= {T['storm_killed_per_hour']}",
            "critical",
            "Remediation storm in job {{ $labels.job_id }}",
            "The watchdog keeps killing this job's workers, or its storm cap suppressed a remediation: "
            "restarting does not fix the cause.",
        ),
        Alert(
            "SidecarJobFalseAlarms",
            "histogram_quantile(\n"
            "  1,\n"
            "  sum by (namespace, cluster, job_id, le) "
            f"{_indent(counted('sidecar_watchdog_false_alarm_duration_seconds_bucket', window('false_alarm_window')), 2)}\n"
            ")\n"
            "* on (namespace, cluster, job_id) group_left (phase) (\n"
            "  0 * topk by (namespace, cluster, job_id) (\n"
            f"    1, sum by (namespace, cluster, job_id, phase) {_indent(counted(FALSE_ALARMS, window('false_alarm_window')), 4)}\n"
            "  ) + 1\n"
            ")\n"
            f"and on (namespace, cluster, job_id) (\n  {_indent(FALSE_ALARM_MOMENTS, 2)} >= {T['false_alarms_per_hour']}\n)",
            "warning",
            "The watchdog keeps taking pauses of job {{ $labels.job_id }} for hangs ({{ $labels.phase }})",
            f"Stalls of job {{{{ $labels.job_id }}}} ended by themselves at {T['false_alarms_per_hour']} or more moments "
            f"within {window('false_alarm_window')} (sidecar_watchdog_false_alarms_total; the ranks of one pause count "
            "once; most in phase {{ $labels.phase }}): the job pauses longer than its watchdog timeout and resumes on "
            "its own. The longest lasted up to {{ $value | humanizeDuration }} (the upper bound of its bucket of "
            "sidecar_watchdog_false_alarm_duration_seconds). Where the watchdog kills, such a pause is a kill the job "
            'did not need: raise watchdog.floor_seconds above it, or declare the phase (`with mon.phase("eval"): '
            "...`, the integrations' callbacks) so that its own budget (watchdog.phase_timeouts) judges it.",
        ),
        Alert(
            "SidecarWouldHaveKilled",
            increased("sidecar_watchdog_would_kill_total", window("would_kill_window"), "namespace, cluster, job_id"),
            "warning",
            "The observe-only watchdog would have killed job {{ $labels.job_id }}",
            "The watchdog in observe-only (shadow) mode held a stall of job {{ $labels.job_id }} long enough to kill "
            f"its worker group within the last {window('would_kill_window')} (sidecar_watchdog_would_kill_total), and "
            "signalled nothing. Either the job hung (SidecarRankStalled follows while it stays so) or it paused and "
            "resumes by itself (then SidecarJobFalseAlarms counts it): a kill it did not need. `sidecar incidents "
            "--job {{ $labels.job_id }}` has the stall's stacks and phase; decide which before turning kills on.",
        ),
        Alert(
            "SidecarJobRestartLoop",
            # sidecar_job_failures_total is job-level (no namespace): its reason joins on (cluster, job_id).
            f"({RESTARTS}) * on (cluster, job_id) group_left (reason) (\n"
            "  0 * topk by (cluster, job_id) (1, sum by (cluster, job_id, reason) (increase(sidecar_job_failures_total[1h])) > 0) + 1\n"
            ")\n"
            f'or on (namespace, cluster, job_id) label_replace({RESTARTS}, "reason", "not recorded", "", "")',
            "warning",
            "Job {{ $labels.job_id }} restarted repeatedly ({{ $labels.reason }})",
            f"torchrun restarted the worker group of job {{{{ $labels.job_id }}}} at least {T['restarts_per_hour']} "
            "times in the last hour. The most frequent cause (the first rank to exit each time, "
            "sidecar_job_failures_total): {{ $labels.reason }}. `sidecar incidents` on the job's nodes has the "
            "evidence; the runbook section of that reason says what to do.",
        ),
        Alert(
            "SidecarRankCudaOutOfMemory",
            increased(
                'sidecar_rank_exits_total{reason="exception/cuda_oom"}',
                window("exit_window"),
                "namespace, cluster, job_id, instance",
            ),
            "warning",
            "CUDA out of memory in job {{ $labels.job_id }} on {{ $labels.instance }}",
            "A rank of job {{ $labels.job_id }} died of torch.OutOfMemoryError. Lower the micro-batch size (keep the "
            "global batch with more accumulation steps), enable activation checkpointing, or set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation.",
        ),
        Alert(
            "SidecarRankKernelOOMKilled",
            increased(
                'sidecar_rank_exits_total{reason="oom_killed"}',
                window("exit_window"),
                "namespace, cluster, job_id, instance",
            ),
            "warning",
            "Kernel OOM killer killed a rank of job {{ $labels.job_id }} on {{ $labels.instance }}",
            "A rank ran out of host memory (its memory cgroup or the node) and the kernel killed it. Lower DataLoader "
            "workers and prefetching, pinned-memory buffers and CPU-side copies, or raise the container's memory "
            "limit; `sidecar incidents` names the cgroup.",
        ),
        Alert(
            "SidecarCollectiveTimeout",
            increased(
                'sidecar_rank_exits_total{reason="exception/collective_timeout"}',
                window("exit_window"),
                "namespace, cluster, job_id, instance",
            ),
            "warning",
            "Collective timeout in job {{ $labels.job_id }} on {{ $labels.instance }}",
            "A rank of job {{ $labels.job_id }} died waiting for its peers in a collective (gloo or NCCL timeout). "
            "The rank that timed out is usually not the culprit: find the straggler (a rank that is stalled, slow "
            "or gone on another node: SidecarStragglerRank, stall incidents, NIC and InfiniBand errors) before "
            "raising the process-group timeout.",
        ),
        Alert(
            "SidecarRankGpuError",
            increased(
                'sidecar_rank_exits_total{reason="gpu_error"}',
                window("exit_window"),
                "namespace, cluster, job_id, instance",
            ),
            "critical",
            "A rank of job {{ $labels.job_id }} died after an XID on {{ $labels.instance }}",
            "A rank died right after its GPU reported an XID: the GPU, not the job, failed. Drain the node, check "
            "SidecarGpuXidCritical and nvidia-smi -q, reset or replace the GPU before scheduling on it again.",
        ),
        Alert(
            "SidecarTrainingLossNonFinite",
            increased(
                'sidecar_training_nonfinite_total{metric="loss"}', "5m", "namespace, cluster, job_id, instance, rank"
            )
            + "\n"
            "or max by (namespace, cluster, job_id, instance, rank) (\n"
            "  sidecar_training_loss != sidecar_training_loss or abs(sidecar_training_loss) == +Inf\n"
            ")",
            "critical",
            "Loss is NaN or infinite in job {{ $labels.job_id }}",
            f"{LABELS_RANK} reported a NaN or infinite loss. Training is diverging or reading bad data; "
            "checkpoints saved from now on may be poisoned.",
        ),
        Alert(
            "SidecarGradNormExplosion",
            f"job_id:sidecar_training_grad_norm:max\n"
            f"> {T['grad_norm_factor']} * quantile_over_time(0.5, job_id:sidecar_training_grad_norm:max[1h] offset 5m)",
            "warning",
            "Gradient norm exploded in job {{ $labels.job_id }}",
            f"The gradient norm of job {{{{ $labels.job_id }}}} is more than {T['grad_norm_factor']}x its median "
            "over the previous hour.",
            for_="2m",
        ),
        Alert(
            "SidecarLearningRateZero",
            f"job_id:sidecar_training_learning_rate:max == 0\nand on (namespace, cluster, job_id) {STEP_RATE}",
            "warning",
            "Learning rate is zero in job {{ $labels.job_id }}",
            "Job {{ $labels.job_id }} keeps stepping with a learning rate of 0: it computes but does not learn.",
            for_="10m",
        ),
        Alert(
            "SidecarLearningRateJump",
            f"job_id:sidecar_training_learning_rate:max\n"
            f"> {T['lr_jump_factor']} * max_over_time(job_id:sidecar_training_learning_rate:max[1h] offset 5m)\n"
            "and on (namespace, cluster, job_id) (\n"
            "  job_id:sidecar_training_learning_rate:max offset 5m\n"
            "  <= job_id:sidecar_training_learning_rate:max offset 65m\n"
            ")",
            "warning",
            "Learning rate jumped in job {{ $labels.job_id }}",
            f"The learning rate of job {{{{ $labels.job_id }}}} is more than {T['lr_jump_factor']}x its maximum over "
            "the previous hour, although it was not rising (not a warmup): a resume that lost the scheduler state?",
        ),
        Alert(
            "SidecarThroughputDrop",
            "job_id:sidecar_training_steps:rate5m\n"
            f"< {T['throughput_drop_ratio']} * avg_over_time(job_id:sidecar_training_steps:rate5m[1h] offset 15m)",
            "warning",
            "Throughput dropped in job {{ $labels.job_id }}",
            f"Job {{{{ $labels.job_id }}}} runs below {int(float(T['throughput_drop_ratio']) * 100)}% of its iterations "
            "per second of the previous hour.",
            for_="15m",
        ),
        Alert(
            "SidecarStragglerRank",
            # The lateness is the rank's own (its collectives entered late, every peer waits for it):
            # the absolute floor keeps out noise, the share of the job's step time keeps out a
            # lateness that costs a long step little. Step times alone cannot name it: in a
            # data-parallel job every rank's step time is the same.
            "max by (namespace, cluster, job_id, rank, instance) (sidecar_rank_lateness_seconds)"
            f" > {T['straggler_lateness_seconds']}\n"
            "> on (namespace, cluster, job_id) group_left ()\n"
            f"  ({T['straggler_lateness_step_ratio']} * job_id:sidecar_training_step_duration_seconds:median_mean5m)",
            "warning",
            f"Straggler: {LABELS_RANK}",
            "Rank {{ $labels.rank }} of job {{ $labels.job_id }} (node {{ $labels.instance }}) enters its collectives "
            "{{ $value | humanizeDuration }} after its peers, more than "
            f"{int(number('straggler_lateness_step_ratio') * 100)}% of the job's median step time, for "
            f"{window('straggler_for')}: every rank waits for it at every step, so the whole job runs at its pace. "
            "It is never killed. Look at `sidecar status` (Stragglers) or /v1/status `stragglers` on its node, then at "
            "that rank's CPU throttling, its GPU's clocks and temperature, its data loading, and its node's links.",
            for_=window("straggler_for"),
        ),
        Alert(
            "SidecarCheckpointStale",
            f"time() - max by (namespace, cluster, job_id) (sidecar_training_last_checkpoint_timestamp_seconds) > {T['checkpoint_max_age_seconds']}\n"
            "and on (namespace, cluster, job_id) max by (namespace, cluster, job_id) (sidecar_training_last_checkpoint_timestamp_seconds) > 0\n"
            f"and on (namespace, cluster, job_id) time() - max by (namespace, cluster, job_id) (sidecar_training_last_progress_timestamp_seconds) < {T['progress_recent_seconds']}",
            "warning",
            "Checkpoint stale in job {{ $labels.job_id }}",
            f"Job {{{{ $labels.job_id }}}} trains but its newest checkpoint is older than "
            f"{int(T['checkpoint_max_age_seconds']) // 60} minutes: a failure now loses that much work.",
            for_="10m",
        ),
        Alert(
            "SidecarHooksDroppingRecords",
            "sum by (namespace, cluster, job_id, instance, rank) (increase(sidecar_hooks_dropped_records_total[10m])) > 0",
            "info",
            f"Hooks dropped records: {LABELS_RANK}",
            "The trainer hooks could not deliver some records to the sidecar (it was down or too slow); "
            "training metrics have gaps.",
        ),
    ],
)

GPU = Group(
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
                f'gpu:sidecar_gpu_xid_errors_total{{xid!~"{T["xid_critical"]}"}}', "15m", "cluster, instance, gpu, xid"
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

NETWORK = Group(
    "sidecar-network",
    [
        Alert(
            "SidecarInfinibandPortDown",
            "sidecar_infiniband_port_up == 0\n"
            "unless on (cluster, instance, device, port) sidecar_infiniband_port_physical_state_id == 3",
            "critical",
            "InfiniBand {{ $labels.device }} port {{ $labels.port }} down on {{ $labels.instance }}",
            "The port is not ACTIVE and was not disabled on purpose (physical state 3, Disabled, is ignored).",
            for_="2m",
        ),
        Alert(
            "SidecarInfinibandPortErrors",
            "sum by (cluster, instance, device, port) (\n"
            "  increase(sidecar_infiniband_symbol_error_total[10m])\n"
            "  + increase(sidecar_infiniband_port_receive_errors_total[10m])\n"
            f") > {T['ib_errors_per_10m']}\n"
            "or sum by (cluster, instance, device, port) (increase(sidecar_infiniband_link_downed_total[10m])) > 0",
            "warning",
            "InfiniBand {{ $labels.device }} port {{ $labels.port }} errors on {{ $labels.instance }}",
            "The port counts symbol or receive errors, or its link went down and came back (flapping).",
        ),
    ],
)

SELF = Group(
    "sidecar-self",
    [
        Alert(
            "SidecarCollectorFailing",
            "sidecar_scrape_collector_success == 0",
            "warning",
            "Collector {{ $labels.collector }} failing on {{ $labels.instance }}",
            "The collector's last runs failed; its metrics are missing or partial. `sidecar status` shows the error.",
            for_="10m",
        ),
        Alert(
            "SidecarVersionSkew",
            "\nor ".join(
                f"label_replace(count by (namespace, cluster, job_id) (count by (namespace, cluster, job_id, {c}_version) (sidecar_versions_info)) > 1,"
                f' "component", "{c}", "", "")'
                for c in ("driver", "cuda", "torch", "nccl")
            ),
            "warning",
            "{{ $labels.component }} versions differ across the nodes of job {{ $labels.job_id }}",
            "The nodes of this job run different {{ $labels.component }} versions: a classic cause of hangs "
            "and numerical drift.",
            for_="10m",
        ),
        Alert(
            "SidecarNodeUnfit",
            "max by (cluster, instance, reason) (sidecar_node_unfit_reason) == 1",
            "critical",
            "Node {{ $labels.instance }} cannot run a job ({{ $labels.reason }})",
            "Something on this node outlives its jobs ({{ $labels.reason }}: processes alive after SIGKILL, GPU "
            "memory held by processes of gone ranks, GPUs missing, or no usable NVML): a job or restart placed here "
            "would fail or hang. Drain the node (kubectl cordon/drain, or scontrol update state=drain) and see "
            "`sidecar status` on it.",
            for_="1m",
        ),
        Alert(
            "SidecarWatchdogObserveOnly",
            "sidecar_watchdog_observe_only == 1",
            "info",
            "Watchdog observe-only on {{ $labels.instance }}",
            "The watchdog on this node reports stalls but never remediates them.",
            for_="1h",
        ),
    ],
)


def overlap_group(selectors: Mapping[str, str] = SELECTORS) -> Group:
    """Alerts that kube-prometheus-stack's own rules repeat: node_exporter's NodeNetworkReceiveErrs and
    NodeNetworkTransmitErrs (SidecarNicErrors), NodeFilesystemSpaceFillingUp and
    NodeFilesystemAlmostOutOfSpace (the checkpoint disk, a filesystem of the node), and TargetDown
    (SidecarDown). A file of their own (overlap.rules.yml, the PrometheusRule `sidecar-overlap`), so that
    the kube-prometheus-stack overlays leave them out and a Prometheus without those rules (bare
    metal, the Kubernetes base) keeps them (docs/operator-guide.md#alerts-kube-prometheus-stack-already-has)."""
    return Group(
        "sidecar-overlap",
        [
            Alert(
                "SidecarDown",
                f"up{{{selectors['sidecar_targets']}}} == 0",
                "warning",
                "Sidecar on {{ $labels.instance }} is down",
                "Prometheus cannot scrape the sidecar: this node has no metrics and no stall watchdog.",
                for_="3m",
            ),
            Alert(
                "SidecarNicErrors",
                "sum by (cluster, instance, device) (\n"
                "  rate(sidecar_network_receive_errs_total[5m]) + rate(sidecar_network_transmit_errs_total[5m])\n"
                f") > {T['nic_errors_per_second']}\n"
                "or sum by (cluster, instance, device) (increase(sidecar_network_carrier_changes_total[15m]))"
                f" > {T['nic_carrier_changes_per_15m']}",
                "warning",
                "NIC {{ $labels.device }} errors on {{ $labels.instance }}",
                "The interface counts receive/transmit errors, or its carrier keeps flapping.",
                for_="5m",
            ),
            Alert(
                "SidecarCheckpointDiskFillingUp",
                f"predict_linear(sidecar_checkpoint_filesystem_avail_bytes[6h], {T['disk_predict_hours']} * 3600) < 0\n"
                f"and sidecar_checkpoint_filesystem_avail_bytes / sidecar_checkpoint_filesystem_size_bytes < {T['disk_filling_free_ratio']}",
                "warning",
                "Checkpoint disk on {{ $labels.instance }} fills up",
                f"At the current rate the checkpoint filesystem on {{{{ $labels.instance }}}} runs out of space within "
                f"{T['disk_predict_hours']} hours.",
                for_="30m",
            ),
            Alert(
                "SidecarCheckpointDiskAlmostFull",
                "sidecar_checkpoint_filesystem_avail_bytes / sidecar_checkpoint_filesystem_size_bytes"
                f" < {T['disk_almost_full_free_ratio']}",
                "critical",
                "Checkpoint disk on {{ $labels.instance }} almost full",
                f"Less than {int(float(T['disk_almost_full_free_ratio']) * 100)}% of the checkpoint filesystem on "
                "{{ $labels.instance }} is free: the next checkpoint save may fail.",
                for_="5m",
            ),
        ],
    )


OVERLAP = overlap_group()

FILES: dict[str, list[Group]] = {
    "recording": [RECORDING],
    "training": [TRAINING],
    "gpu": [GPU],
    "network": [NETWORK],
    "self": [SELF],
    "overlap": [OVERLAP],
}


# The GPU source a cluster loads, one of the two (docs/dcgm.md): alerts/gpu-source/<source>.rules.yml.
SOURCES: dict[str, Group] = {
    "sidecar": Group("sidecar-gpu-source-sidecar", [Record(r, e) for r, e in gpu_source.sidecar_source()]),
    "dcgm": Group("sidecar-gpu-source-dcgm", [Record(r, e, labels) for r, e, labels in gpu_source.dcgm_source()]),
}


def all_alerts() -> list[Alert]:
    return [r for groups in FILES.values() for g in groups for r in g.rules if isinstance(r, Alert)]


def all_records() -> list[Record]:
    return [r for groups in FILES.values() for g in groups for r in g.rules if isinstance(r, Record)]


# ------------------------------------------------------------------ rendering


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)

HEADER = "# Generated by alerts/build.py: edit that file, then run `python -m alerts.build`.\n"


def render(groups: list[Group], runbook_base_url: str = RUNBOOK_BASE_URL, for_override: str | None = None) -> str:
    doc = {
        "groups": [{"name": g.name, "rules": [r.rule(runbook_base_url, for_override) for r in g.rules]} for g in groups]
    }
    return HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


def files(selectors: Mapping[str, str] | None = None) -> dict[str, list[Group]]:
    """FILES, with `selectors` (names of SELECTORS -> PromQL label matchers) instead of the defaults."""
    if not selectors:
        return FILES
    unknown = sorted(set(selectors) - set(SELECTORS))
    if unknown:
        raise ValueError(f"unknown selector {', '.join(unknown)} (known: {', '.join(sorted(SELECTORS))})")
    return {**FILES, "overlap": [overlap_group({**SELECTORS, **selectors})]}


def rendered_files(
    runbook_base_url: str = RUNBOOK_BASE_URL,
    for_override: str | None = None,
    selectors: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """File name -> content of every rule file."""
    return {
        f"{stem}.rules.yml": render(groups, runbook_base_url, for_override) for stem, groups in files(selectors).items()
    }


def source_files() -> dict[str, str]:
    """Name under alerts/ -> content of each GPU source's recording rules."""
    return {f"gpu-source/{name}.rules.yml": render([group]) for name, group in SOURCES.items()}


def write(
    out_dir: Path,
    runbook_base_url: str = RUNBOOK_BASE_URL,
    for_override: str | None = None,
    selectors: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write the rule files that differ into out_dir (the GPU sources into out_dir/gpu-source/);
    the paths written."""
    return generated.write(out_dir, rendered_files(runbook_base_url, for_override, selectors)) + generated.write(
        out_dir, source_files()
    )


def _selector(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or name not in SELECTORS or not value.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=SELECTOR with NAME one of {', '.join(sorted(SELECTORS))}")
    return name, value.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m alerts.build", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE, help="directory for the rule files (default: alerts/)")
    p.add_argument("--runbook-base-url", default=RUNBOOK_BASE_URL, help="URL of docs/runbook.md as published")
    p.add_argument(
        "--for",
        dest="for_override",
        metavar="DURATION",
        help="replace every alert's `for` (tests use a short one; never in production)",
    )
    p.add_argument(
        "--selector",
        action="append",
        type=_selector,
        default=[],
        metavar="NAME=SELECTOR",
        help="PromQL label matchers instead of a default of SELECTORS, e.g. "
        f"sidecar_targets='{SELECTORS['sidecar_targets']}' (the scrape job of the sidecars)",
    )
    args = p.parse_args(argv)
    if args.for_override is not None and not re.fullmatch(r"\d+(ms|s|m|h)", args.for_override):
        p.error(f"--for: expected a Prometheus duration like 5s, got {args.for_override!r}")
    for path in write(args.out, args.runbook_base_url, args.for_override, dict(args.selector)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
