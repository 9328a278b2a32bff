"""The training alerts (training.rules.yml): hangs and the job view, goodput, stalls, kills a
healthy job did not need, restarts and rank exits by reason, training signals (loss, gradient
norm, learning rate, throughput, stragglers) and checkpoints."""

# ruff: noqa: E501
# (declarative tables: PromQL expressions read, and are copied, whole)

from __future__ import annotations

from sidecar.mixin.config import MixinConfig
from sidecar.mixin.promql import ENQUEUED, FALSE_ALARMS, LABELS_RANK, NODE, Alert, Group, counted, increased, indent

STEP_RATE = "deriv(job_id:sidecar_training_step:max[5m]) > 0"


def group(cfg: MixinConfig) -> Group:
    T, window, number = cfg.thresholds, cfg.window, cfg.number
    RESTARTS = (
        "max by (namespace, cluster, job_id) (sidecar_training_restarts)\n"
        f"- min by (namespace, cluster, job_id) (min_over_time(sidecar_training_restarts[1h])) >= {T['restarts_per_hour']}"
    )
    # Stalls that ended by themselves (a pause the watchdog took for a hang). The counter counts ranks: one
    # pause of a job is a false alarm of each of its ranks on every node. Counted instead: the moments a
    # node's count for the job rose (the ranks of one pause resume together), on the node that saw the
    # most; the job's registered ranks stand for 0 on a node before its first false alarm there.
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
    return Group(
        "sidecar-training",
        [
            Alert(
                "SidecarJobHungOnRank",
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
                "SidecarJobCrashLoop",
                "max by (namespace, cluster, job_id) (sidecar_job_crash_loop) > 0",
                "critical",
                "Job {{ $labels.job_id }} ended for a crash loop",
                "Job {{ $labels.job_id }} met the same verdict at the same step after its restarts (the same rank "
                "hung or crashed there, or the same desync), so the sidecar ended it: its ranks exit 93 and "
                "`python -m trainer_hooks.launch` exits 93, which the scheduler should not requeue. Restarting it "
                "unchanged meets it again: `sidecar incidents --job {{ $labels.job_id }}` has the verdict, the rank "
                "and the step; fix the program or its data, then launch it afresh.",
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
                f"{indent(counted('sidecar_watchdog_false_alarm_duration_seconds_bucket', window('false_alarm_window')), 2)}\n"
                ")\n"
                "* on (namespace, cluster, job_id) group_left (phase) (\n"
                "  0 * topk by (namespace, cluster, job_id) (\n"
                f"    1, sum by (namespace, cluster, job_id, phase) {indent(counted(FALSE_ALARMS, window('false_alarm_window')), 4)}\n"
                "  ) + 1\n"
                ")\n"
                f"and on (namespace, cluster, job_id) (\n  {indent(FALSE_ALARM_MOMENTS, 2)} >= {T['false_alarms_per_hour']}\n)",
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
                increased(
                    "sidecar_watchdog_would_kill_total", window("would_kill_window"), "namespace, cluster, job_id"
                ),
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
                # sidecar_job_failures_total is job-level: it carries the job's namespace (podlabels.py) where its
                # ranks name one, so two tenants' jobs of one id stay apart.
                f"({RESTARTS}) * on (namespace, cluster, job_id) group_left (reason) (\n"
                "  0 * topk by (namespace, cluster, job_id) (1, sum by (namespace, cluster, job_id, reason) "
                "(increase(sidecar_job_failures_total[1h])) > 0) + 1\n"
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
                    'sidecar_training_nonfinite_total{metric="loss"}',
                    "5m",
                    "namespace, cluster, job_id, instance, rank",
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
