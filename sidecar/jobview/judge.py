"""Who holds a job up, from every node's report: the rule of DESIGN.md's job view.

When a rank hangs, every other rank of the job soon waits for it in a collective. The culprit is
therefore the rank that is *not* waiting for its peers at the job's lowest step; a rank that waits
in a collective is never blamed. When every rank that still reports waits, the rank holding the
job up is on a node that stopped reporting (its sidecar and ranks gone, or cut off): that node is
named. Until the stacks of the ranks at the lowest step are known the judgement waits, unless it
is forced (the nodes cannot wait longer): then the rank with the oldest progress at the lowest
step is named, and the reason says the stacks were not known.

The backend's own record comes first (collectives.py): where the ranks' Flight Recorder summaries
decide it, the late rank, a stuck collective or a desync is the verdict, whatever the stacks
show; the stack rule above judges only where they do not (no record: an older torch, the recorder
off). Every culprit says which evidence judged it (`evidence`: collectives, stacks, progress).

Who waits on whom (docs/architecture/hang-kinds.md, "Who waits on whom"): a rank waits on its peers when its
stack shows it in a collective or its record holds one in flight. A rank that is not waiting is
the end of the chain; what its node reads of its process (`RankView.activity`) names the kind
(hang_kinds.CONDITION_KINDS: stopped, in D, on its DataLoader, spinning, deadlocked). No one
waiting, no hang: when no rank waits and every troubled rank's CPU time grows, the job is paused
(`job_paused`, report only; every node holds, none kills).

When ranks exit instead (a crash, a lost peer), the first to exit on its own clock (brought to the
coordinator's by its node's offset, stragglers.ClockOffset) is the cause and the others' exits its
consequences (`rank_crashed`), unless a node went silent: its loss is what made the others fail.

Each report is summarised once, when it arrives (`summarize`, linear in its ranks); a judgement
reads the summaries (`judge_summaries`, linear in the nodes), so a coordinator of 1,000 nodes
judges in well under a millisecond.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace

from sidecar import hang_kinds
from sidecar.jobview import collectives
from sidecar.jobview.report import PEER_FAILURES, Culprit, NodeReport, RankView

NO_STEP = -1


@dataclass
class Summary:
    """What judging needs of one node's report."""

    node: str
    lowest: int | None = None  # the lowest step of its live ranks (NO_STEP: one has none yet)
    behind: list[RankView] = field(default_factory=list)  # its live ranks at that step
    waiting: int = 0  # its live ranks that wait in a collective
    stalled: bool = False  # a live rank is suspect or stalled
    first_exit: RankView | None = None  # its rank that exited first, recently
    recorded: list[RankView] = field(default_factory=list)  # its live ranks with a collective record
    received: float | None = None  # the judge's clock when the report arrived (records' ages are as of then)
    busy: list[int] = field(default_factory=list)  # its ranks busy, not hung (RankView.busy)
    seen: int = 0  # its ranks the report accounts for (listed, or counted healthy)
    world: int = 0  # the job's world size, as the report says
    troubled: int = 0  # its live troubled ranks
    working: int = 0  # of them, those whose CPU time grows (busy, or activity "cpu")
    unread: int = 0  # of them, those whose activity its node cannot tell now (a stack being read: state t)


def _step(r: RankView) -> int:
    return NO_STEP if r.step is None else r.step


def in_flight(r: RankView) -> bool:
    """Its record holds a collective it entered and has not completed: it waits on its peers."""
    return r.collectives is not None and r.collectives.waiting


# A peer failure (a communication error, a collective timeout) counts as this much later among a
# job's exits: it usually follows another rank's, and a loaded node may hear the cause's last.
PEER_FAILURE_SECONDS = 5.0


def exit_order(r: RankView) -> float:
    """Its place among the job's exits, on its own node's clock (`exited_at`)."""
    return (r.exited_at or 0.0) + (PEER_FAILURE_SECONDS if r.exit_kind in PEER_FAILURES else 0.0)


def summarize(report: NodeReport, received: float | None = None) -> Summary:
    s = Summary(report.node, received=received, seen=len(report.ranks) + report.healthy, world=report.world_size)
    for r in report.ranks:
        if r.exited_at is not None and (s.first_exit is None or exit_order(r) < exit_order(s.first_exit)):
            s.first_exit = r
        if r.state == "gone":
            continue
        step = _step(r)
        if s.lowest is None or step < s.lowest:
            s.lowest, s.behind = step, [r]
        elif step == s.lowest:
            s.behind.append(r)
        s.waiting += bool(r.waiting) or in_flight(r)
        s.stalled = s.stalled or r.troubled
        if r.troubled:
            s.troubled += 1
            s.working += r.busy or r.activity == "cpu"
            s.unread += not r.busy and r.activity is None
        if r.busy:
            s.busy.append(r.rank)
        if r.collectives is not None:
            s.recorded.append(r)
    return s


def judge(
    reports: Iterable[NodeReport], lost: Collection[str] = (), force: bool = False, silent: Collection[str] = (),
    stale_after: float = collectives.STALE_AFTER_SECONDS,
) -> Culprit | None:  # fmt: skip
    """The culprit of a troubled job, or None while it cannot be told (or nothing is wrong).
    `lost`: nodes that stopped reporting (or whose sidecar no longer answers); `silent`: nodes
    that have not reported since the incident opened (they may yet turn out lost); `stale_after`:
    a collective record older than this says its rank's process stopped."""
    return judge_summaries([summarize(r) for r in reports], lost, force, silent, stale_after)


def judge_summaries(
    summaries: Iterable[Summary], lost: Collection[str] = (), force: bool = False, silent: Collection[str] = (),
    stale_after: float = collectives.STALE_AFTER_SECONDS, now: float | None = None,
    offsets: dict[str, float] | None = None,
) -> Culprit | None:  # fmt: skip
    """`now`: the clock the summaries' `received` times are on; each record's age is brought to it
    (nodes report at different moments: their ages must be compared as of one instant). `offsets`:
    each node's clock minus the coordinator's, to order exits on one clock."""
    summaries = list(summaries)
    live = [s for s in summaries if s.lowest is not None]
    exits = [s for s in summaries if s.first_exit is not None]
    if not any(s.stalled for s in live) and not exits and not lost:
        return None
    if any(s.stalled for s in live):
        records = _records_now(live, now)
        finding = collectives.judge(records, stale_after, force)
        if finding is not None:
            return _refined(finding.to_culprit(), live)
        nobody = _nobody_waits(summaries, records, stale_after)
        paused = _paused(live, nobody)
        if paused is not None:
            return paused
        if not force and _pausing(live, nobody):
            return None  # working ranks no one waits on, the rest still stepping or unheard: not yet anything
        # Records that do not decide it yet (a fresh one is on its way): the stacks only when forced.
        undecided = not force and not lost and any(s.recorded for s in live)
        unheard = [s.node for s in summaries if s.lowest is None and s.first_exit is None] + list(silent)
        if sum(s.seen for s in summaries) < max(s.world for s in summaries):
            unheard.append("?")  # ranks of the job's world no report accounts for (a node not yet reporting)
        found = None if undecided else _hang(live, lost, force, unheard)
        if found is not None or not exits:
            return found
    if lost:
        return _lost(lost, "ranks of the job exit or wait")
    if silent and not force:
        return None  # a silent node may be the lost one: wait for it (or for its probe)
    if not force and sum(s.seen for s in summaries) < max(s.world for s in summaries):
        return None  # ranks of the job not heard of yet (their node has not reported): one may have exited first
    shift = offsets or {}

    def exited(s: Summary) -> float:
        assert s.first_exit is not None
        return (s.first_exit.exited_at or 0.0) - shift.get(s.node, 0.0)

    ordered = sorted(exits, key=lambda s: exit_order(s.first_exit) - shift.get(s.node, 0.0))  # type: ignore[arg-type]
    first = ordered[0]
    assert first.first_exit is not None
    then = ", ".join(
        f"rank {s.first_exit.rank} on {s.node} +{exited(s) - exited(first):.3f}s" for s in ordered[1:4] if s.first_exit
    )
    why = "the first rank of the job to exit, on its node's clock brought to the coordinator's" + (
        f" (then {then})" if then else ""
    )
    return _culprit(first.node, first.first_exit, why, hang_kinds.RANK_CRASHED.name, "progress")


def _records_now(live: list[Summary], now: float | None) -> list[tuple[str, RankView]]:
    out = []
    for s in live:
        shift = max(0.0, now - s.received) if now is not None and s.received is not None else 0.0
        for r in s.recorded:
            if shift and r.collectives_age is not None:
                r = replace(r, collectives_age=r.collectives_age + shift)
            out.append((s.node, r))
    return out


def _nobody_waits(summaries: list[Summary], records: list[tuple[str, RankView]], stale_after: float) -> bool:
    """The records prove that no rank waits: every rank of the job's world (two or more) has a fresh
    one with nothing in flight. A rank its node cannot read for a moment then counts as working."""
    world = max(s.world for s in summaries)
    if world < 2 or len(records) < world or sum(s.seen for s in summaries) < world:
        return False
    return not any(in_flight(r) or collectives.stale(r, stale_after) or r.activity == "stopped" for _, r in records)


def _paused(live: list[Summary], unread_work: bool = False) -> Culprit | None:
    """No one waits on anyone (no stack in a collective, no record with one in flight) and every
    rank of the job's world is troubled and its CPU time grows: a pause (an evaluation, a long
    op), not a hang. `unread_work`: the records prove no rank waits (`_nobody_waits`); a rank
    whose activity is unread counts as working (make test: a healthy evaluation, one rank's stack
    being read, was named `rank_not_waiting` and killed)."""
    troubled = sum(s.troubled for s in live)
    if not _pausing(live, unread_work) or troubled < max(s.world for s in live):
        return None  # a job pauses on every rank
    lowest = min(s.lowest for s in live if s.lowest is not None)
    where = "no step yet" if lowest < 0 else f"step {lowest}"
    node = next(s.node for s in live if s.lowest == lowest)
    return Culprit(
        None, node, reason=f"no rank waits on another and all {troubled} troubled rank(s) use CPU (at {where}): "
        "a pause, not a hang; reported, nothing killed", kind=hang_kinds.JOB_PAUSED.name, evidence="stacks",
    )  # fmt: skip


def _pausing(live: list[Summary], unread_work: bool = False) -> bool:
    """Every troubled rank works and none waits, but not every rank of the world is troubled (yet):
    the start of a pause on every rank, or one rank working late while its peers still step (a
    spinning rank, before they wait on it). Neither a pause nor a hang can be told; forced, the
    stacks judge (bench_recovery --faults mixed: a lone spinning rank was called a pause)."""
    troubled, working = sum(s.troubled for s in live), sum(s.working for s in live)
    working += sum(s.unread for s in live) if unread_work else 0
    return bool(troubled) and working >= troubled and not any(s.waiting for s in live)


def _chain_end(running: list[tuple[str, RankView]], waiting: int) -> tuple[str, RankView]:
    """Which of the ranks not waiting holds the others up: a stopped one or one in D first; where no
    rank is seen waiting (a CUDA job's waiting rank sits in its own code, its record unknown), the
    odd one out of working (CPU) and not working; else the oldest progress."""
    halted = [nr for nr in running if nr[1].activity in ("stopped", "io")]
    if halted:
        return max(halted, key=lambda nr: nr[1].progress_age_seconds)
    if not waiting:
        working = [nr for nr in running if nr[1].activity == "cpu"]
        idle = [nr for nr in running if nr[1].activity not in (None, "cpu")]
        if working and idle and len(working) != len(idle):
            running = min(working, idle, key=len)
    return max(running, key=lambda nr: nr[1].progress_age_seconds)


def _hang(live: list[Summary], lost: Collection[str], force: bool, unheard: Collection[str] = ()) -> Culprit | None:
    """The stack rule. `unheard`: nodes of the job whose ranks the judge has not seen during the
    incident (heartbeats only, or silent): when every rank seen waits, they are whom it waits on, and
    no waiting rank is named in their place, forced or not."""
    lowest = min(s.lowest for s in live if s.lowest is not None)
    where = "no step yet" if lowest < 0 else f"step {lowest}"
    behind = [(s.node, r) for s in live if s.lowest == lowest for r in s.behind]
    waiting = sum(s.waiting for s in live)
    running = [(node, r) for node, r in behind if r.waiting is False and r.troubled and not in_flight(r)]
    if running:
        node, r = _chain_end(running, waiting)
        others = f"{waiting} rank{'s' if waiting != 1 else ''} wait" if waiting else "no rank waits"
        kind = hang_kinds.CONDITION_KINDS.get(r.activity or "", hang_kinds.RANK_UNKNOWN.name)
        doing = f"; its process: {r.activity}" if r.activity else ""
        why = f"not waiting for its peers at the job's lowest step ({where}), while {others} in a collective{doing}"
        return _culprit(node, r, why, kind, "stacks")
    unknown = [(node, r) for node, r in behind if r.waiting is None]
    if lost and not unknown:
        return _lost(lost, "every rank that reports waits in a collective")
    if force and behind and (unknown or not unheard):
        node, r = max(unknown or behind, key=lambda nr: nr[1].progress_age_seconds)
        known = "its stack was not known" if r.waiting is None else "every rank waits in a collective"
        return _culprit(node, r, f"oldest progress at the job's lowest step ({where}); {known}",
                        hang_kinds.OLDEST_PROGRESS.name, "progress")  # fmt: skip
    return None


# The record says who is late; what the late rank's process does names the kind where it is specific.
# A late rank's kind from its process: stopped, in D, on its DataLoader's queue, or without CPU (a
# lock, a queue, a sleep: deadlocked). One whose CPU time grows stays rank_late (a slow step and a
# spin look alike by CPU; its node's busy check holds it while it works).
_REFINES = {"stopped": hang_kinds.RANK_STOPPED.name, "io": hang_kinds.IO_STUCK.name,
            "dataloader": hang_kinds.DATALOADER_STUCK.name, "idle": hang_kinds.RANK_DEADLOCKED.name}  # fmt: skip


def _refined(c: Culprit, live: list[Summary]) -> Culprit:
    """A late rank's kind from its process's condition, as its node reads it (the reason says so)."""
    s = next((s for s in live if s.node == c.node), None)
    if s is not None:
        refine(c, s)
    return c


def refine(c: Culprit, s: Summary) -> bool:
    """A named rank's kind made specific by what its node now reads of its process (the rank and
    node stay: what nodes act on does not change). True when it changed."""
    if c.rank is None or s.node != c.node:
        return False
    table = _REFINES if c.kind == hang_kinds.RANK_LATE.name else {}
    if c.kind == hang_kinds.RANK_UNKNOWN.name:
        table = hang_kinds.CONDITION_KINDS
    view = next((r for r in s.behind + s.recorded if r.rank == c.rank), None)
    kind = table.get(view.activity or "") if view is not None else None
    if kind is None or kind == c.kind:
        return False
    assert view is not None
    c.kind, c.reason = kind, f"{c.reason}; its process: {view.activity}"
    return True


def _lost(lost: Collection[str], what: str) -> Culprit:
    names = ", ".join(sorted(lost))
    plural = "s" if len(lost) > 1 else ""
    return Culprit(
        None, sorted(lost)[0], reason=f"{what}; node{plural} {names} stopped reporting (sidecar unreachable)",
        kind="node_lost", evidence="progress",
    )  # fmt: skip


def _culprit(node: str, r: RankView, reason: str, kind: str, evidence: str) -> Culprit:
    return Culprit(r.rank, node, r.step, r.phase, r.stack_top, reason, kind, evidence)


def records_said(summaries: list[Summary], now: float) -> str:
    """Each rank's record in a line's worth, for the log when the records did not decide a verdict."""
    said = []
    for s in summaries:
        shift = max(0.0, now - s.received) if s.received is not None else 0.0
        for r in s.recorded[:8]:
            assert r.collectives is not None
            groups = ", ".join(
                f"pg {g.pg} enq {g.enqueued} done {g.completed}"
                + (f" in #{g.pending[0].seq} {r.collectives.time - g.pending[0].created:.1f}s" if g.pending else "")
                for g in r.collectives.groups[:4]
            )
            said.append(f"{s.node} rank {r.rank} ({(r.collectives_age or 0.0) + shift:.1f}s old): {groups}")
    return "; ".join(said[:32])
