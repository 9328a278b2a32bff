"""Who holds a job up, from the backend's own record: every rank's collective record (PyTorch's
Flight Recorder, summarised by the hooks; sidecar/ranks/collectives.py). The first evidence the
judge reads (judge.py); the ranks' Python stacks come second, progress alone last.

Per process group, across every node of the job, the collective in flight is the highest
sequence any member enqueued that not every member completed. Then:

- `collective_mismatch`: members hold different collectives (op or input shapes) at one
  sequence: a desync, a program bug that a restart repeats. No single rank is named.
- `rank_late`: members never entered the collective the others wait in. The culprit is the late
  rank that does not itself wait in another group (with several groups, data x tensor parallel,
  a rank late in one group because it waits in another is a victim, and the chain ends at the one
  rank that holds everyone up), or whose record stopped coming (its process no longer runs: the
  hooks' thread reads the record at least every few seconds while it lives). Its Python stack
  does not matter: a CUDA job's waiting rank sits at its next sync point, not in a collective.
- `collective_stuck`: every member entered and none completed, every member's record fresh (their
  processes live and still wait): the backend's or the network's; no rank is to blame. Also when
  some members completed it and wait in the next one while the others still wait inside it (a
  link cut in the middle of a ring: some got every chunk they needed, the others never will).

Nothing is claimed while a member whose record would decide it is unknown (a node not heard
from, a group's members not all seen): the judge then waits, or falls back to the stacks.
Linear in the ranks' groups; a job is judged at most every JUDGE_EVERY_SECONDS (coordinator.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from sidecar.jobview.report import MAX_COLLECTIVE_NAMES, Culprit, RankView
from sidecar.ranks.collectives import Group, Pending
from trainer_hooks.wire import COLLECTIVES_EVERY_SECONDS

STALE_AFTER_SECONDS = 5.0  # a record older than this (hooks flush every 2 s by default) has stopped


def stale_after(flush_interval: float) -> float:
    """How old a rank's record may be while its process lives: its hooks send one at least every
    max(flush interval, COLLECTIVES_EVERY_SECONDS), alone when they have nothing else to send;
    twice that and a second more."""
    return 2 * max(flush_interval, COLLECTIVES_EVERY_SECONDS) + 1.0


WAIT_SECONDS = 1.0  # inside a collective this long when the record was read: the rank waits in it
# Collectives whose members must all pass the same input shapes; others (all_to_all with uneven
# splits, gather, scatter, all_gather of uneven tensors) are compared by op alone.
SAME_SHAPES = frozenset(
    {"all_reduce", "allreduce", "all_reduce_coalesced", "allreduce_coalesced", "broadcast", "reduce", "barrier"}
)


def _signature(p: Pending) -> str:
    return p.signature if p.op in SAME_SHAPES else p.op


@dataclass
class _Member:
    node: str
    view: RankView
    group: Group

    @property
    def rank(self) -> int:
        return self.view.rank


@dataclass
class Finding:
    kind: str  # rank_late | collective_stuck | collective_mismatch
    pg: str
    desc: str
    seq: int
    op: str | None
    culprit: tuple[str, RankView] | None = None
    late: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    waiting: int = 0
    ops: dict[str, list[int]] = field(default_factory=dict)
    reason: str = ""
    odd: dict[int, str] = field(default_factory=dict)  # a desync's odd ranks out -> their nodes

    def collective(self) -> dict:
        return {
            "pg": self.pg, "desc": self.desc or None, "seq": self.seq, "op": self.op, "nodes": self.nodes,
            "late": self.late, "waiting": self.waiting, "ops": self.ops, "repeat": False,
            **({"odd": {str(r): n for r, n in self.odd.items()}} if self.odd else {}),
        }  # fmt: skip

    def to_culprit(self) -> Culprit:
        collective = self.collective()
        if self.culprit is not None:
            node, r = self.culprit
            return Culprit(r.rank, node, r.step, r.phase, r.stack_top, self.reason, self.kind, "collectives",
                           collective)  # fmt: skip
        return Culprit(None, self.nodes[0] if self.nodes else "", None, None, None, self.reason, self.kind,
                       "collectives", collective)  # fmt: skip


def stale(view: RankView, stale_after: float) -> bool:
    return view.collectives_age is not None and view.collectives_age > stale_after


def _label(g: Group) -> str:
    return f"process group {g.pg}" + (f" ({g.desc})" if g.desc else "")


def _inside_for(m: _Member, seq: int) -> float | None:
    """How long the member had been inside collective `seq` when it read its record."""
    assert m.view.collectives is not None
    p = next((p for p in m.group.pending if p.seq == seq), None)
    return None if p is None else max(0.0, m.view.collectives.time - p.created)


def _waits(m: _Member) -> bool:
    """The member waits in its group's collective: in flight for WAIT_SECONDS when it read its
    record (a healthy collective passes in milliseconds; a record read during one says nothing)."""
    if not m.group.waiting:
        return False
    if not m.group.pending:
        return True
    inside = _inside_for(m, m.group.pending[0].seq)
    return inside is None or inside >= WAIT_SECONDS


def _entered_ago(m: _Member, seq: int) -> float | None:
    """Seconds since the member entered collective `seq`, at its report's time (its own clock)."""
    assert m.view.collectives is not None
    for p in m.group.pending:
        if p.seq == seq:
            return max(0.0, m.view.collectives.time - p.created) + (m.view.collectives_age or 0.0)
    return None


def _established(m: _Member, members: list[_Member], stale_after: float) -> bool:
    """Whether the member's lateness is a fact, not an old record: its record stopped coming, or it
    was read WAIT_SECONDS or more after a peer had entered the collective it has not entered (a
    rank that has its own work between two collectives enters a little after its peers)."""
    if stale(m.view, stale_after):
        return True
    missed = max(m.group.enqueued, max(p.group.completed for p in members)) + 1
    ago = [a for p in members if p is not m and (a := _entered_ago(p, missed)) is not None]
    return bool(ago) and (m.view.collectives_age or 0.0) + WAIT_SECONDS <= max(ago)


def judge(
    ranks: Iterable[tuple[str, RankView]], stale_after: float = STALE_AFTER_SECONDS, force: bool = False
) -> Finding | None:
    """The finding from every live rank's record (`(node, view)` pairs), or None when the records
    do not decide it (none in flight, a member unknown, no record at all, a late rank's record older
    than its peers' entry into the collective and not yet stale). `force`: the nodes cannot wait
    longer; a late rank whose lateness is not yet established is named all the same."""
    groups: dict[str, list[_Member]] = defaultdict(list)
    waits: dict[int, bool] = {}  # rank -> waits in some group's collective, with a fresh record
    stopped: set[int] = set()
    for node, view in ranks:
        if view.collectives is None or view.state == "gone":
            continue
        if stale(view, stale_after) or view.activity == "stopped":  # a stopped process's record is old for that
            stopped.add(view.rank)
        for g in view.collectives.groups:
            member = _Member(node, view, g)
            groups[g.pg].append(member)
            if _waits(member):
                waits[view.rank] = True
    late_findings: list[tuple[Finding, list[_Member]]] = []
    stuck: list[Finding] = []
    for pg in sorted(groups, key=_pg_order):
        members = groups[pg]
        top = max(m.group.enqueued for m in members)
        if all(m.group.completed >= top for m in members):
            continue  # nothing in flight in this group
        mismatch = _mismatch(members, force)
        if mismatch is _UNDECIDED:
            return None  # a desync with no minority yet among the records heard: wait for the rest
        if mismatch is not None:
            return mismatch
        # A collective a member completed, every member entered: a record below that is old, not late.
        floor = max(m.group.completed for m in members)
        entered = [m for m in members if m.group.enqueued >= top and m.group.completed < top]
        if not entered:
            continue  # whoever enqueued the newest completed it: only old records lag behind
        late = [m for m in members if max(m.group.enqueued, floor) < top]
        desc = members[0].group.desc
        op = _op_at(entered, top)
        size = max((m.group.size or 0) for m in members)
        nodes = sorted({m.node for m in members})[:MAX_COLLECTIVE_NAMES]
        base = Finding("rank_late", pg, desc, top, op, nodes=nodes, waiting=len(entered))
        # Members behind `top` that are inside the collective a peer completed (a link cut in its
        # middle: some members got every chunk they needed and went on, the others wait for chunks
        # that never come) arrived; they are not late.
        inside_done = [m for m in late if m.group.completed < m.group.enqueued >= floor and m.rank not in stopped]
        if late and len(inside_done) == len(late):
            if len(members) >= size and _partly_stuck(base, members, entered, late, top, force, stale_after):
                stuck.append(base)
            continue  # stuck, or not yet inside long enough to tell
        if late:
            base.late = sorted(m.rank for m in late)[:MAX_COLLECTIVE_NAMES]
            known = [m for m in late if force or _established(m, members, stale_after)]
            if known:
                late_findings.append((base, known))
            continue
        if len(members) < size:
            continue  # members not heard from may be the late ones
        halted = [m for m in members if m.rank in stopped]
        if halted:  # in the collective, but the process stopped answering
            base.late = sorted(m.rank for m in halted)[:MAX_COLLECTIVE_NAMES]
            late_findings.append((base, halted))
            continue
        inside = [_inside_for(m, top) for m in members]
        need = WAIT_SECONDS if force else stale_after  # forced: every member waits in it, fresh
        if not all(t is not None and t >= need for t in inside):
            continue  # some member's record was read moments after it entered: not yet a stuck collective
        base.kind = "collective_stuck"
        base.reason = (
            f"every member of {_label(members[0].group)} ({len(members)} ranks on {len({m.node for m in members})} "
            f"node{'s' if len(nodes) != 1 else ''}) entered {op or 'collective'} #{top} and none completed it: "
            "the backend or the network between them, no rank to blame"
        )
        stuck.append(base)
    culprit = _culprit(late_findings, waits, stopped)
    if culprit is not None:
        return culprit
    return stuck[0] if stuck else None


def _partly_stuck(
    base: Finding, members: list[_Member], entered: list[_Member], behind: list[_Member], top: int, force: bool,
    stale_after: float,
) -> bool:  # fmt: skip
    """Every member inside a collective for a while, those behind in the one their peers completed:
    `base` becomes the stuck collective (the oldest not every member completed), True."""
    need = WAIT_SECONDS if force else stale_after
    times = [_inside_for(m, top) for m in entered] + [_inside_for(m, m.group.enqueued) for m in behind]
    if not all(t is not None and t >= need for t in times):
        return False
    seq = min(m.group.enqueued for m in behind)
    op = _op_at(behind, seq) or "collective"
    done = sorted(m.rank for m in members if m.group.completed >= seq)[:8]
    base.kind, base.seq, base.op, base.waiting = "collective_stuck", seq, _op_at(behind, seq), len(members)
    base.reason = (
        f"every member of {_label(members[0].group)} ({len(members)} ranks on {len({m.node for m in members})} "
        f"nodes) entered {op} #{seq}; ranks {', '.join(map(str, done))} completed it and wait in #{top}, the "
        "others wait for it still: the backend or the network between them, no rank to blame"
    )
    return True


def _pg_order(pg: str) -> tuple[int, str]:
    return (int(pg), "") if pg.isdigit() else (1 << 30, pg)


def _op_at(members: list[_Member], seq: int) -> str | None:
    for m in members:
        for p in m.group.pending:
            if p.seq == seq:
                return p.signature
    return None


def _mismatch(members: list[_Member], force: bool = False) -> Finding | None:
    """Members holding different collectives at one sequence. `_UNDECIDED` when the calls tie and
    members have yet to show theirs at that sequence (a record read before its rank entered): the
    rest may make one call the minority. Forced, a tie is a desync with no one to name."""
    # each member's whole claim at a sequence: a coalesced group is several entries at one sequence
    claims: dict[tuple[int, int], list[str]] = defaultdict(list)
    for m in members:
        for p in m.group.pending:
            claims[(p.seq, id(m))].append(_signature(p))
    by_seq: dict[int, dict[str, list[_Member]]] = defaultdict(lambda: defaultdict(list))
    for m in members:
        for seq in sorted({p.seq for p in m.group.pending}):
            by_seq[seq][" + ".join(sorted(claims[(seq, id(m))]))].append(m)
    for seq in sorted(by_seq):
        sigs = by_seq[seq]
        if len(sigs) < 2:
            continue
        g = members[0].group
        ops = {sig: sorted(m.rank for m in ms)[:MAX_COLLECTIVE_NAMES] for sig, ms in sorted(sigs.items())[:8]}
        said = "; ".join(f"{sig} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r[:8]))}"
                         for sig, r in ops.items())  # fmt: skip
        finding = Finding(
            "collective_mismatch", g.pg, g.desc, seq, None,
            nodes=sorted({m.node for ms in sigs.values() for m in ms})[:MAX_COLLECTIVE_NAMES],
            waiting=sum(len(ms) for ms in sigs.values()), ops=ops,
            reason=f"members of {_label(g)} called different collectives at sequence #{seq} ({said}): "
            "a desync in the program; a restart runs into it again",
        )  # fmt: skip
        odd = _odd_ones(list(sigs.values()))
        size = max((m.group.size or 0) for m in members)
        if not odd and not force and finding.waiting < max(size, len(members)):
            return _UNDECIDED
        if odd:
            first = min(odd, key=lambda m: m.rank)
            finding.culprit = (first.node, first.view)
            finding.odd = {m.rank: m.node for m in sorted(odd, key=lambda m: m.rank)[:MAX_COLLECTIVE_NAMES]}
            where = ", ".join(f"rank {r} on {n}" for r, n in list(finding.odd.items())[:8])
            finding.reason += f"; the odd one{'s' if len(odd) > 1 else ''} out: {where}"
        return finding
    return None


_UNDECIDED = Finding("collective_mismatch", "", "", 0, None)  # a sentinel: not yet decided


def _odd_ones(groups: list[list[_Member]]) -> list[_Member]:
    """The members of the one smallest call at a desynced sequence (the minority op or size): its
    odd ranks out. None when two calls tie for the fewest members (no minority to name)."""
    sizes = sorted(len(ms) for ms in groups)
    if sizes[0] == sizes[1]:
        return []
    return next(ms for ms in groups if len(ms) == sizes[0])


def _culprit(
    findings: list[tuple[Finding, list[_Member]]], waits: dict[int, bool], stopped: set[int]
) -> Finding | None:
    """The one late rank every group's wait leads to: late somewhere and waiting nowhere (or
    stopped). None when every late rank waits in another group (the chain ends at a rank whose
    record is not known, or at a stuck collective)."""
    best: tuple[tuple, Finding, _Member] | None = None
    for finding, late in findings:
        for m in late:
            halted = m.rank in stopped
            if waits.get(m.rank) and not halted:
                continue  # a victim: it waits in another group
            behind = finding.seq - m.group.enqueued
            key = (not halted, -behind, m.rank)
            if best is None or key < best[0]:
                best = (key, finding, m)
    if best is None:
        return None
    _, finding, m = best
    g = m.group
    where = f"{_label(g)}'s {finding.op or 'collective'} #{finding.seq}"
    others = f"{finding.waiting} rank{'s' if finding.waiting != 1 else ''} wait{'s' if finding.waiting == 1 else ''}"
    if m.rank in stopped:
        age = m.view.collectives_age or 0.0
        how = (
            f"its collective record stopped {age:.1f}s ago (its process no longer runs) "
            + ("inside" if g.enqueued >= finding.seq else "before entering")
            + f" {where}, in which {others}"
        )
    else:
        how = f"it never entered {where} (its last: #{g.enqueued}), in which {others}, and waits in no collective"
    finding.culprit = (m.node, m.view)
    finding.kind = "rank_late"
    finding.reason = how
    return finding
