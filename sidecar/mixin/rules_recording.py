"""The recording rules (recording.rules.yml): the job-level series the alerts and the
dashboards read, so that they stay cheap on a thousand nodes, and the job view without the
sidecars (the rank holding its job up, a collective stuck in the backend)."""

# ruff: noqa: E501
# (declarative tables: PromQL expressions read, and are copied, whole)

from __future__ import annotations

from sidecar.mixin.config import MixinConfig
from sidecar.mixin.promql import COMPLETED, ENQUEUED, NODE, NOT_PROGRESSING, Group, Record, indent


def group(cfg: MixinConfig) -> Group:
    T = cfg.thresholds
    # Some member of the (job_id, pg) group enqueued or completed a collective within the window: the
    # group moves, whatever a single scrape shows in flight.
    GROUP_MOVED = f"changes({ENQUEUED}[{T['collective_still_for']}]) > 0\nor changes({COMPLETED}[{T['collective_still_for']}]) > 0"
    # Some rank of the job advanced its step within the window.
    JOB_STEPPED = f"changes(sidecar_training_step[{T['collective_still_for']}]) > 0"
    JOB_STEPPED_5M = "sum by (namespace, cluster, job_id) (rate(sidecar_training_step_duration_seconds_count[5m])) > 0"
    return Group(
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
            # Each rank's mean step time over 5m, from the histogram's sum and count; a rank without a step
            # in 5m has none (not NaN: MetricsQL drops NaN results, PromQL keeps them, so both leave it out).
            Record(
                "job_id_rank:sidecar_training_step_duration_seconds:mean5m",
                "sum by (namespace, cluster, job_id, rank, instance) (rate(sidecar_training_step_duration_seconds_sum[5m]))\n"
                "/ (sum by (namespace, cluster, job_id, rank, instance) (rate(sidecar_training_step_duration_seconds_count[5m])) > 0)",
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
            # Step-time quantiles of the whole job from the buckets (spikes a scrape interval would hide); a
            # job without a step in 5m has none (as for mean5m: no NaN, which MetricsQL would drop).
            Record(
                "job_id:sidecar_training_step_duration_seconds:p50_5m",
                "histogram_quantile(0.5, sum by (namespace, cluster, job_id, le) (rate(sidecar_training_step_duration_seconds_bucket[5m])))\n"
                f"and on (namespace, cluster, job_id) ({JOB_STEPPED_5M})",
            ),
            Record(
                "job_id:sidecar_training_step_duration_seconds:p99_5m",
                "histogram_quantile(0.99, sum by (namespace, cluster, job_id, le) (rate(sidecar_training_step_duration_seconds_bucket[5m])))\n"
                f"and on (namespace, cluster, job_id) ({JOB_STEPPED_5M})",
            ),
            Record("job_id:sidecar_training_loss:avg", "avg by (namespace, cluster, job_id) (sidecar_training_loss)"),
            Record(
                "job_id:sidecar_training_grad_norm:max",
                "max by (namespace, cluster, job_id) (sidecar_training_grad_norm)",
            ),
            Record(
                "job_id:sidecar_training_learning_rate:max",
                "max by (namespace, cluster, job_id) (sidecar_training_learning_rate)",
            ),
            Record(
                "job_id_state:sidecar_rank_state:count",
                "count by (namespace, cluster, job_id, state) (sidecar_rank_state == 1)",
            ),
            # The job view without the sidecars (docs/architecture/job-view.md): every rank of a hung job soon
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
            # From the backend's own record first (PyTorch's Flight Recorder, docs/architecture/hang-kinds.md): per
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
                f"    {indent(GROUP_MOVED, 4)}\n"
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
                f"  {indent(GROUP_MOVED, 2)}\n"
                ")\n"
                "and on (namespace, cluster, job_id) (\n"
                "  count by (namespace, cluster, job_id) (sidecar_rank_collective_record_age_seconds"
                f" < {T['collective_record_stale_seconds']})\n"
                # world_size is a job-level series with the job's namespace (podlabels.py)
                "  >= on (namespace, cluster, job_id) group_left max by (namespace, cluster, job_id) "
                "(sidecar_training_world_size)\n"
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
