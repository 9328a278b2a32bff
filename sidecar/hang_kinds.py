"""The one table of hang kinds: what a verdict may say held a job up, and what follows from it.

A verdict (sidecar/jobview/judge.py) is the end of a chain of waits (docs/architecture/hang-kinds.md, "Who
waits on whom"): the kind names what that end is. Everything that keys on a verdict reads this
table: who is blamed (a rank, a node, the odd ranks of a desync, or no one), who acts (the
culprit's node, every node of the job on its own ranks, or nobody: report only), the alert that
pages for it and its runbook section, the wire's accepted values, the incident's `hang_kind`, the
metric's label values and help, and the generated table in docs/architecture/hang-kinds.md (`python -m
sidecar.hang_kinds`). A kind registers itself here; the judgement decides when it holds.

An unknown kind (a verdict from a newer node) is carried with its name and treated as OTHER:
blamed as its verdict says, acted on by the culprit's node, counted as "other" in metrics.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,39}")
BLAMES = ("rank", "ranks", "node", "nobody")  # "ranks": the odd ones out of a collective
ACTS = ("culprit_node", "every_node", "nobody")  # "every_node": each node restarts its own ranks


@dataclass(frozen=True)
class HangKind:
    name: str
    description: str  # one line, for the docs' table, the metric's help and `sidecar status`
    evidence: str  # what it rests on, in words
    blames: str  # one of BLAMES
    acts: str  # one of ACTS
    alert: str | None  # the alert that pages for it (alerts/*.rules.yml)
    no_alert: str = ""  # why none pages, where `alert` is None

    @property
    def runbook(self) -> str:
        """Its section of docs/runbook.md (a heading `### <name>`)."""
        return f"docs/runbook.md#{self.name}"

    @property
    def names_a_rank(self) -> bool:
        return self.blames in ("rank", "ranks")

    @property
    def loops(self) -> bool:
        """Met again at the same step after a restart, it is the program's (or that rank's input's),
        and restarts repeat it: a crash loop (job_view.crash_loop_after). A node, the network or a
        pause is not the program's: never counted."""
        return self.names_a_rank


KINDS: dict[str, HangKind] = {}


def register(kind: HangKind) -> HangKind:
    if not NAME_RE.fullmatch(kind.name) or kind.blames not in BLAMES or kind.acts not in ACTS:
        raise ValueError(f"hang kind {kind.name!r}: a name of a-z0-9_, blames in {BLAMES}, acts in {ACTS}")
    if kind.alert is None and not kind.no_alert:
        raise ValueError(f"hang kind {kind.name!r}: an alert, or the reason it has none")
    if kind.name in KINDS:
        raise ValueError(f"hang kind {kind.name!r} registered twice")
    KINDS[kind.name] = kind
    return kind


OTHER = HangKind(
    "other", "a kind this node's version does not know (a newer node's verdict), carried with its name",
    "the verdict of another node", "rank", "culprit_node", None,
    no_alert="its own node's alerts, which know the kind, page for it",
)  # fmt: skip


def of(name: str | None) -> HangKind:
    """The kind of that name; OTHER for a name this version does not know."""
    return KINDS.get(name or "", OTHER)


def metric_label(name: str | None) -> str:
    """The metric label value: a known kind's name, else "other" (bounded label values)."""
    return name if name in KINDS else OTHER.name


# ---------------------------------------------------------------- the kinds

RANK_ALERT = "SidecarJobHungOnRank"

RANK_LATE = register(HangKind(
    "rank_late", "its peers wait in a collective it never entered, and it is neither stopped nor in a known wait",
    "the ranks' Flight Recorder records", "rank", "culprit_node", RANK_ALERT,
))  # fmt: skip
RANK_STOPPED = register(HangKind(
    "rank_stopped", "its process is stopped (state T/t: SIGSTOP, a tracer) while its peers wait",
    "the process's state; the records or stacks for who waits", "rank", "culprit_node", RANK_ALERT,
))  # fmt: skip
RANK_DEADLOCKED = register(HangKind(
    "rank_deadlocked", "no CPU, its stack still, outside any collective (a lock, a queue, a sleep)",
    "its stack and CPU time", "rank", "culprit_node", RANK_ALERT,
))  # fmt: skip
RANK_SPINNING = register(HangKind(
    "rank_spinning", "CPU time growing, its stack still, outside any collective, while its peers wait on it",
    "its stack and CPU time; the peers' records or stacks", "rank", "culprit_node", RANK_ALERT,
))  # fmt: skip
RANK_UNKNOWN = register(HangKind(
    "rank_not_waiting", "not waiting for its peers, what it does unknown (its process could not be read)",
    "its stack", "rank", "culprit_node", RANK_ALERT,
))  # fmt: skip
DATALOADER_STUCK = register(HangKind(
    "dataloader_stuck", "waits on its DataLoader's workers (no CPU, a DataLoader frame in its stack)",
    "its stack and CPU time", "rank", "culprit_node", RANK_ALERT,
))  # fmt: skip
IO_STUCK = register(HangKind(
    "io_stuck", "in uninterruptible sleep (state D: storage, a driver, a frozen cgroup) past the floor",
    "the process's state", "rank", "culprit_node", RANK_ALERT,
))  # fmt: skip
OLDEST_PROGRESS = register(HangKind(
    "oldest_progress", "no better evidence in time: the rank with the oldest progress at the job's lowest step",
    "steps alone", "rank", "culprit_node", RANK_ALERT,
))  # fmt: skip
COLLECTIVE_STUCK = register(HangKind(
    "collective_stuck", "every member entered one collective and none finished: the network's or the backend's",
    "the ranks' Flight Recorder records", "nobody", "every_node", "SidecarCollectiveStuck",
))  # fmt: skip
COLLECTIVE_MISMATCH = register(HangKind(
    "collective_mismatch", "members at one sequence called different collectives or sizes (a desync: a program bug); "
    "the odd ranks out are named", "the ranks' Flight Recorder records", "ranks", "every_node",
    "SidecarCollectiveMismatch",
))  # fmt: skip
NODE_LOST = register(HangKind(
    "node_lost", "a node of the job stopped reporting and its sidecar does not answer, while the others wait or exit",
    "the nodes' reports and a probe of its sidecar", "node", "every_node", "SidecarDown",
))  # fmt: skip
RANK_CRASHED = register(HangKind(
    "rank_crashed", "a rank exited first (an exception, a signal, the OOM killer); the others' exits follow from it",
    "the ranks' exits, ordered on their own clocks", "rank", "nobody", "SidecarJobRestartLoop",
))  # fmt: skip
JOB_PAUSED = register(HangKind(
    "job_paused", "no rank waits on another and every rank is busy (CPU time growing): a pause, not a hang",
    "the ranks' stacks, records and CPU time", "nobody", "nobody", "SidecarJobNotProgressing",
))  # fmt: skip

RANK_KINDS = frozenset(k.name for k in KINDS.values() if k.names_a_rank)
NO_RANK_KINDS = frozenset(k.name for k in KINDS.values() if not k.names_a_rank)
EVERY_NODE_ACTS = frozenset(k.name for k in KINDS.values() if k.acts == "every_node")
REPORT_ONLY = frozenset(k.name for k in KINDS.values() if k.acts == "nobody")

# A rank's condition (RankView.activity, read by its node) -> the kind of a hang it ends.
CONDITION_KINDS = {
    "stopped": RANK_STOPPED.name,
    "io": IO_STUCK.name,
    "dataloader": DATALOADER_STUCK.name,
    "cpu": RANK_SPINNING.name,
    "idle": RANK_DEADLOCKED.name,
}
CONDITIONS = tuple(CONDITION_KINDS)


def metric_help() -> str:
    return "Stalls by what held the job up (kind: " + ", ".join(KINDS) + ", other: a newer node's kind)"


def table() -> str:
    """The kinds as a Markdown table (docs/architecture/hang-kinds.md carries it; a test keeps it current)."""
    rows = [
        "| kind | what it is | rests on | blames | acts | a crash loop when repeated | alert |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in KINDS.values():
        alert = f"`{k.alert}`" if k.alert else f"none: {k.no_alert}"
        acts = {"culprit_node": "the culprit's node", "every_node": "every node", "nobody": "nobody (report)"}[k.acts]
        loops = "yes" if k.loops else "no"
        rows.append(f"| [`{k.name}`](../runbook.md#{k.name}) | {k.description} | {k.evidence} | {k.blames} | {acts} | "
                    f"{loops} | {alert} |")  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
