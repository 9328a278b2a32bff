"""The watchdog's own metric families (machine.py's `Watchdog.families` fills them) and the counts behind
them, which the state machine and each stall's episode (episode.py) add to."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from sidecar import hang_kinds
from sidecar.metric import MetricSpec, spec

METRICS: tuple[MetricSpec, ...] = (
    spec(
        "watchdog",
        "rank_state",
        "gauge",
        "1 for the rank's current watchdog state, 0 for the others "
        "(starting, healthy, suspect, stalled, remediating, gone).",
        ["job_id", "rank", "state"],
    ),
    spec(
        "watchdog",
        "watchdog_timeout_seconds",
        "gauge",
        "The rank's effective progress timeout now (start-up, declared phase or adaptive step timeout).",
        ["job_id", "rank"],
    ),
    spec("watchdog", "watchdog_stalls", "counter", "Stalls detected (one per incident), per job.", ["job_id"]),
    spec(
        "watchdog",
        "watchdog_remediations",
        "counter",
        "Remediations by outcome: killed, unkillable (a process alive after SIGKILL and "
        "remediation.kill_wait_seconds: the node is unfit until it goes), suppressed (storm cap), observe_only, "
        "unverified (registered by unverified callers: never signalled), not_killed_no_restart (nothing would "
        "restart the ranks: no launcher, or torchrun's restarts used up; stacks dumped, no signal to end them; "
        "remediation.kill_without_restart), left_to_launcher (the culprit was on another node: torchrun stopped "
        "this node's waiting ranks), resumed (a rank of the job was busy, not hung: the stall was held and the "
        "job progressed again, nothing killed), failed (no rank could be signalled, or remediation itself failed).",
        ["job_id", "outcome"],
    ),
    spec("watchdog", "watchdog_transitions", "counter", "Rank state transitions.", ["from_state", "to_state"]),
    spec(
        "watchdog",
        "watchdog_last_incident_timestamp_seconds",
        "gauge",
        "Unix time of the latest incident (absent before the first).",
    ),
    spec("watchdog", "watchdog_observe_only", "gauge", "1 when the watchdog only detects and reports, never signals."),
    spec(
        "watchdog",
        "rank_waiting_in_collective",
        "gauge",
        "1 when the rank's latest stack (probed once it turned suspect) shows its main thread waiting for its "
        "peers in a collective, 0 when it runs its own code; absent while the rank is healthy or not probed. "
        "With the rank's step, what names the rank that holds a job up (alerts: SidecarJobHungOnRank).",
        ["job_id", "rank"],
    ),
    spec(
        "watchdog",
        "rank_collective_enqueued_seq",
        "gauge",
        "The sequence number of the last collective the rank enqueued on the process group, from its Flight "
        "Recorder (sent by the hooks at least every flush interval). A member below its group's highest is late to "
        "the collective the others wait in (alerts: SidecarJobHungOnRank).",
        ["job_id", "rank", "pg"],
    ),
    spec(
        "watchdog",
        "rank_collective_completed_seq",
        "gauge",
        "The sequence number of the last collective the rank saw complete on the process group (Flight Recorder). "
        "Below enqueued: the rank waits in a collective.",
        ["job_id", "rank", "pg"],
    ),
    spec(
        "watchdog",
        "rank_collective_record_age_seconds",
        "gauge",
        "Seconds since the rank's collective record last arrived; a live rank's hooks send it at least every "
        "flush interval, so a record that keeps ageing says its process stopped.",
        ["job_id", "rank"],
    ),
    spec(
        "watchdog",
        "stall_verdicts",
        "counter",
        hang_kinds.metric_help() + " and the evidence that judged it (collectives: the Flight "
        "Recorder; stacks: the ranks' Python stacks; progress: steps and exits alone). A collective_mismatch is a "
        "desync in the program that a restart repeats; a job_paused is reported, never killed.",
        ["job_id", "kind", "evidence"],
    ),
    spec(
        "watchdog",
        "watchdog_drills",
        "counter",
        "Kill-and-resume drills (`sidecar drill`: a rank stopped on purpose) by outcome, as remediations count "
        "them. A drill's stall counts here only: not in sidecar_watchdog_stalls_total, "
        "sidecar_watchdog_remediations_total or sidecar_stall_verdicts_total, so no alert on those fires for it.",
        ["job_id", "outcome"],
    ),
)


@dataclass
class Counters:
    transitions: Counter = field(default_factory=Counter)  # (from, to)
    stalls: Counter = field(default_factory=Counter)  # job_id
    remediations: Counter = field(default_factory=Counter)  # (job_id, outcome)
    verdicts: Counter = field(default_factory=Counter)  # (job_id, kind, evidence)
    drills: Counter = field(default_factory=Counter)  # (job_id, outcome): a drill's stall, counted apart
    last_incident: float | None = None

    def stall_outcomes(self) -> dict:
        """For `/v1/status`: the stalls since the sidecar started (drills apart) and how many ended
        in each outcome (a stall still being handled has none yet)."""
        outcomes: Counter = Counter()
        for (_, outcome), n in self.remediations.items():
            outcomes[outcome] += n
        return {"stalls": sum(self.stalls.values()), "outcomes": dict(sorted(outcomes.items()))}
