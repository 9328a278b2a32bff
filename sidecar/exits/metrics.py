"""The exit tracker's metric families (sidecar/exits/tracker.py counts into them)."""

from __future__ import annotations

from sidecar.metric import MetricSpec, spec

METRICS: tuple[MetricSpec, ...] = (
    spec(
        "exits",
        "rank_exits",
        "counter",
        "Rank process exits by reason: finished, watchdog, oom_killed, gpu_error (a hardware XID), gpu_app_fault "
        "(another XID: the application's own fault), exception/cuda_oom, "
        "exception/collective_timeout, exception/communication, exception/nonfinite, exception/other, "
        "signal, nonzero_exit, unknown. `role` is `consequence` when the exit followed a job incident "
        "whose culprit is another rank or a lost node (the job view: a peer's hang or loss made it fail), "
        "else `cause`.",
        ["job_id", "reason", "role"],
    ),
    spec(
        "exits",
        "job_failures",
        "counter",
        "Failures of a job's worker group on this node, by the reason of the first rank to exit (the likely "
        "cause: torchrun stops the other workers, which then exit with `signal`); failures that are the "
        "consequences of another node's job incident are not counted. Reasons as sidecar_rank_exits_total, "
        "without finished.",
        ["job_id", "reason"],
    ),
    spec(
        "exits",
        "rank_last_exit_timestamp_seconds",
        "gauge",
        "Unix time of the job's latest rank exit classified on this node, by its reason.",
        ["job_id", "reason"],
    ),
)
