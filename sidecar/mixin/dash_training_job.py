"""The training job dashboard (training-job.json): one job across its nodes, its progress,
health and load balance. Job-level panels read the recording rules (recording.rules.yml), so they
stay cheap on a thousand nodes; thresholds drawn on panels are the alerts' (the config's)."""

from __future__ import annotations

from sidecar.mixin.config import MixinConfig
from sidecar.mixin.panels import (
    CLUSTER,
    JOB,
    NODES,
    RANKS,
    annotation,
    cluster_var,
    dashboard,
    job_var,
    namespace_var,
    query_var,
    row,
    stat,
    table,
    timeseries,
)
from sidecar.mixin.promql import counted


def unneeded_kills_panel(cfg: MixinConfig) -> dict:
    """Stalls of the job that were (or would have been) kills it did not need: would-have-killed
    counts of the observe-only watchdog, stalls that ended by themselves by phase, and the longest
    of those over the last hour (seconds, right axis)."""
    hour = cfg.window("false_alarm_window")
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
        f"upper bound of its histogram bucket. False alarms at {int(cfg.number('false_alarms_per_hour'))} or more "
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


def training_job(cfg: MixinConfig) -> dict:
    ckpt_age = cfg.number("checkpoint_max_age_seconds")
    late = cfg.number("straggler_lateness_seconds")
    late_share = int(cfg.number("straggler_lateness_step_ratio") * 100)
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
        unneeded_kills_panel(cfg),
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
                    "/ sum by (stage) "
                    f"(increase(sidecar_recovery_stage_seconds_count{{{CLUSTER}, {NODES}}}[$__range]))",
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
            "collective, with its node (the SidecarJobHungOnRank rule: from every rank's Flight Recorder sequences "
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
            "How long after its group's other members (their median) each rank enters its collectives (median over its"
            " newest collectives, from the ranks' Flight Recorders, judged on its node or across the job by the job "
            "view's coordinator). Every rank waits for the late one at every step. SidecarStragglerRank fires "
            f"above the dashed line when the lateness is also more than {late_share}% of the job's median step "
            f"time, for {cfg.window('straggler_for')}.",
            threshold=late,
            min_=0,
        ),
        timeseries(
            "Go-live checks",
            [(f"sidecar_job_golive_check{{{JOB}, {NODES}}}", "{{instance}} {{check}}")],
            "short",
            "A new job's go-live checks on each node (the operations guide's): every rank joined, its first "
            "batch loaded, GPU memory and throughput balanced across the node's ranks, the loss falling over "
            "the first steps. 1 ok, 0 warning, -1 pending; `sidecar status` on the node says what differs.",
            min_=-1,
            max_=1,
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
        cfg,
        "sidecar-training-job",
        "Training job overview",
        "One training job across its nodes: progress, health, load balance.",
        variables,
        panels,
        annotations,
    )
