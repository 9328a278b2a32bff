"""What a node tells the job's coordinator, and what the coordinator answers, on the wire.

A report is one node's picture of one job: each local rank's global rank, watchdog state, step,
phase, how long since its last progress, whether its main thread waits in a collective (from the
latest stack probe) and its innermost frame; whether this node has dumped its ranks' stacks for
the job incident; and, once it has one, its part of the incident (its own record's id, outcome,
timeline and, once known, its recovery's seconds per stage). A verdict names the job incident and
who holds the job up. Both are bounded: a node reports at most `limits.max_ranks_per_job` ranks,
short texts only, and everything is validated like the hooks' own protocol (strict JSON, 4xx
naming the field).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from sidecar import hang_kinds
from sidecar.config import NODE_NAME, check_url
from sidecar.jobview.golive import parse_figures
from sidecar.jobview.stragglers import RankEntries, parse_entries
from sidecar.ranks.collectives import Collectives, parse_collectives
from sidecar.ranks.golive import JobFigures
from sidecar.ranks.protocol import CONTROL_RE, ProtocolError, _int, _job_id, _object, _text
from trainer_hooks.wire import MAX_RANK

MAX_TEXT = 240  # a stack frame, a reason, an outcome
MAX_TIMELINE = 24  # events of one node's part
MAX_LOST = 64  # lost nodes named in a verdict
MAX_NOT_DUMPED = 8  # nodes still dumping named in a verdict
MAX_TIME = 4e9
MAX_STAGES = 16  # recovery stages in one node's part
STAGE_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
STATES = ("starting", "healthy", "suspect", "stalled", "remediating", "gone")
TROUBLED = frozenset({"suspect", "stalled", "remediating"})


@dataclass
class RankView:
    rank: int  # the global rank
    local_rank: int
    state: str  # the watchdog's state of it
    step: int | None
    phase: str | None
    progress_age_seconds: float  # at the report's time
    waiting: bool | None = None  # its main thread waits in a collective (latest probe); None: not probed
    stack_top: str | None = None  # the innermost frame of its main thread, when probed
    exited_at: float | None = None  # wall clock: its process exited (not a clean finish), recently
    collectives: Collectives | None = None  # its Flight Recorder summary (sidecar/ranks/collectives.py)
    collectives_age: float | None = None  # seconds since its node received that record, at the report's time
    busy: bool = False  # alive, not judged hung: busy, or its CPU time growing while judged (Liveness.alive)
    # what its node reads of its process while it is troubled (hang_kinds.CONDITIONS: stopped, io,
    # dataloader, cpu, idle); None: not read (not troubled, or an unverified caller's pid)
    activity: str | None = None
    # a gone rank's exception, as its hooks reported it (EXIT_KINDS: sidecar/exits/reasons.py); a
    # communication error or a collective timeout usually follows another rank's failure
    exit_kind: str | None = None

    @property
    def troubled(self) -> bool:
        return self.state in TROUBLED or self.exited_at is not None

    def to_wire(self) -> dict[str, Any]:
        # every other field is a plain value: no deep copy of the record only to replace it
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["collectives"] = self.collectives.to_wire() if self.collectives is not None else None
        return out


@dataclass
class NodePart:
    """One node's part of a job incident: its own incident record and what it did."""

    incident: str
    outcome: str
    timeline: list[dict[str, Any]] = field(default_factory=list)  # {"event", "time"}
    # its recovery's seconds per stage once known (watchdog/recovery.py STAGES; null: not seen),
    # sent again as the stages come in, after the job incident closed too; {} from an older node
    stages: dict[str, float | None] = field(default_factory=dict)


@dataclass
class NodeReport:
    job_id: str
    node: str
    world_size: int
    time: float  # the reporter's wall clock
    ranks: list[RankView]
    url: str = ""  # where the node's sidecar takes peer requests (for the coordinator's probes)
    dumped: str | None = None  # the job incident whose stacks this node has dumped
    part: NodePart | None = None  # set once the node has a record of the job incident
    job_incident: str | None = None  # the job incident the node knows of (from an earlier verdict)
    healthy: int = 0  # ranks left out because all is well (a heartbeat: no incident, nothing troubled)
    # its ranks' newest collective entry times, for the job's lateness (stragglers.py); heartbeats
    # carry them too, only for ranks whose entries moved since the coordinator last took them
    lateness: list[RankEntries] = field(default_factory=list)
    # its ranks' figures for the job's go-live checks (jobview/golive.py): only when they changed
    # since the coordinator last took them (or every golive.REFRESH_SECONDS); None: unchanged or none
    golive: JobFigures | None = None
    drill: str | None = None  # a drill of the job armed on this node (`sidecar drill`): its id
    # the round trip (seconds) of this node's previous report to the coordinator, when it was answered:
    # the bound on that report's one-way delay, so on its clock offset sample (stragglers.ClockOffset)
    rtt: float | None = None

    @property
    def troubled(self) -> bool:
        return any(r.troubled for r in self.ranks)

    def to_wire(self) -> dict[str, Any]:
        skip = ("ranks", "part", "lateness", "golive", "rtt")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out["ranks"] = [r.to_wire() for r in self.ranks]  # each once, not converted twice
        out["part"] = asdict(self.part) if self.part is not None else None
        if self.lateness:  # absent when none: a report of a job without entry times stays as it was
            out["lateness"] = [e.to_wire() for e in self.lateness]
        if self.golive is not None:  # absent likewise: a coordinator that predates it reads none
            out["golive"] = self.golive.to_wire()
        if self.rtt is not None:  # absent likewise
            out["rtt"] = round(self.rtt, 6)
        return out


# A gone rank's exception kind (sidecar/exits/reasons.py EXCEPTION_KINDS); the peer failures among them
EXIT_KINDS = ("cuda_oom", "collective_timeout", "communication", "nonfinite", "other")
PEER_FAILURES = frozenset({"communication"})  # a peer closed the connection: it died first

# What held the job up (a verdict's `kind`: sidecar/hang_kinds.py, the one table), and what judged it
# (`evidence`): the backend's own record first (collectives), then the ranks' Python stacks, then
# progress and exits alone.
KINDS = tuple(hang_kinds.KINDS)
EVIDENCE = ("collectives", "stacks", "progress")
NO_RANK_KINDS = hang_kinds.NO_RANK_KINDS  # no rank named: no node blamed


@dataclass
class Culprit:
    rank: int | None  # None: a whole node is gone, the collective's, or a pause (hang_kinds: blames)
    node: str
    step: int | None = None
    phase: str | None = None
    stack_top: str | None = None
    reason: str = ""
    kind: str = "rank_not_waiting"  # a name of sidecar/hang_kinds.py (or a newer node's, carried)
    evidence: str = "stacks"
    # kind rank_late/collective_*: {"pg", "desc", "seq", "op", "sizes", "nodes", "ranks", "ops", "repeat"};
    # a desync's also "odd": {"rank": node} of the odd ranks out
    collective: dict[str, Any] | None = None
    busy: bool = False  # its node finds it busy, not hung: no node kills while it is so (episode.Episode.hold)


@dataclass
class Verdict:
    job_id: str
    job_incident: str
    version: int  # grows with every change; a reporter long-polls for a newer one
    opened: float  # wall clock of the first troubled report
    culprit: Culprit | None = None
    lost_nodes: list[str] = field(default_factory=list)
    # Counts, not names: a verdict goes to every node, so its size must not grow with the job.
    nodes: int = 0  # nodes that reported during the incident
    dumped: int = 0  # of them, those whose stacks are dumped
    not_dumped: list[str] = field(default_factory=list)  # a few of those still dumping (for the record)
    decided: float | None = None  # wall clock of the culprit decision
    closed: bool = False  # every rank progresses again (or the job is gone)
    drill: str | None = None  # a node of the job drills it (`sidecar drill`): a drill, not a real stall, on every node
    # earlier incidents of the job with the same verdict at the same step (jobs.signature), and whether
    # that makes a crash loop (job_view.crash_loop_after): the job is ended, not restarted again
    repeats: int = 0
    crash_loop: bool = False

    @property
    def all_dumped(self) -> bool:
        return self.nodes > 0 and self.dumped >= self.nodes

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------- parsing


def _bool(obj: dict, key: str, where: str) -> bool | None:
    value = obj.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise ProtocolError(f"{where}: expected true, false or null")


def _seconds(obj: dict, key: str, where: str) -> float:
    value = obj.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < MAX_TIME:
        raise ProtocolError(f"{where}: expected seconds >= 0")
    return float(value)


def _list(obj: dict, key: str, where: str, limit: int) -> list:
    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ProtocolError(f"{where}: expected an array")
    if len(value) > limit:
        raise ProtocolError(f"{where}: at most {limit} entries, got {len(value)}", code="too_large", status=413)
    return value


_STATES = frozenset(STATES)
_MAX_STEP = (1 << 63) - 1


def _seconds_value(value: Any) -> bool:
    return type(value) in (int, float) and 0 <= value < MAX_TIME


def _plain_text(value: Any) -> bool:
    return value is None or (type(value) is str and 0 < len(value) <= MAX_TEXT and not CONTROL_RE.search(value))


def _well_formed(obj: Any) -> RankView | None:
    """The common case, checked in one pass (a coordinator reads a thousand reports at once);
    None sends the entry through the checks that name the bad field."""
    if type(obj) is not dict:
        return None
    rank, local, state, step = obj.get("rank"), obj.get("local_rank"), obj.get("state"), obj.get("step")
    age, waiting, exited = obj.get("progress_age_seconds"), obj.get("waiting"), obj.get("exited_at")
    phase, top, busy = obj.get("phase"), obj.get("stack_top"), obj.get("busy", False)
    activity = obj.get("activity")
    exit_kind = obj.get("exit_kind")
    if not (
        type(rank) is int and 0 <= rank <= MAX_RANK and type(local) is int and 0 <= local <= MAX_RANK
        and state in _STATES and (step is None or (type(step) is int and 0 <= step <= _MAX_STEP))
        and _seconds_value(age) and (waiting is None or type(waiting) is bool)
        and (exited is None or _seconds_value(exited))
        and _plain_text(phase) and _plain_text(top) and type(busy) is bool
        and (activity is None or activity in _CONDITIONS)
    ):  # fmt: skip
        return None
    assert isinstance(age, (int, float))  # _seconds_value checked it
    coll_age = obj.get("collectives_age")
    if coll_age is not None and not _seconds_value(coll_age):
        return None
    return RankView(
        rank, local, state, step, phase, float(age), waiting, top, None if exited is None else float(exited),
        parse_collectives(obj.get("collectives")), None if coll_age is None else float(coll_age), busy, activity,
        exit_kind if exit_kind in EXIT_KINDS else None,  # a newer node's kind: dropped, never refused
    )  # fmt: skip


def _rank_view(obj: Any, where: str) -> RankView:
    fast = _well_formed(obj)
    if fast is not None:
        return fast
    if not isinstance(obj, dict):
        raise ProtocolError(f"{where}: expected an object")
    state = _text(obj, "state", f"{where}.state")
    if state not in STATES:
        raise ProtocolError(f"{where}.state: expected one of {', '.join(STATES)}")
    return RankView(
        rank=_int(obj, "rank", f"{where}.rank", 0, MAX_RANK),
        local_rank=_int(obj, "local_rank", f"{where}.local_rank", 0, MAX_RANK),
        state=state,
        step=_int(obj, "step", f"{where}.step", 0, (1 << 63) - 1, nullable=True),
        phase=_text(obj, "phase", f"{where}.phase", nullable=True, max_len=MAX_TEXT),
        progress_age_seconds=_seconds(obj, "progress_age_seconds", f"{where}.progress_age_seconds"),
        waiting=_bool(obj, "waiting", f"{where}.waiting"),
        stack_top=_text(obj, "stack_top", f"{where}.stack_top", nullable=True, max_len=MAX_TEXT),
        exited_at=None if obj.get("exited_at") is None else _seconds(obj, "exited_at", f"{where}.exited_at"),
        collectives=parse_collectives(obj.get("collectives"), f"{where}.collectives"),
        collectives_age=(
            None if obj.get("collectives_age") is None
            else _seconds(obj, "collectives_age", f"{where}.collectives_age")
        ),
        busy=bool(_bool(obj, "busy", f"{where}.busy")),
        exit_kind=obj.get("exit_kind") if obj.get("exit_kind") in EXIT_KINDS else None,
        activity=_activity(obj.get("activity")),
    )  # fmt: skip


_CONDITIONS = frozenset(hang_kinds.CONDITIONS)


def _activity(value: Any) -> str | None:
    """A rank's condition; one a newer node reads that this version does not know is dropped, not refused."""
    return value if value in _CONDITIONS else None


def _part(obj: dict, where: str) -> NodePart | None:
    if obj.get("part") is None:
        return None
    raw = _object(obj, "part", where)
    timeline = []
    for i, e in enumerate(_list(raw, "timeline", f"{where}.timeline", MAX_TIMELINE)):
        if not isinstance(e, dict):
            raise ProtocolError(f"{where}.timeline[{i}]: expected an object")
        event = _text(e, "event", f"{where}.timeline[{i}].event", max_len=64)
        timeline.append({"event": event, "time": _seconds(e, "time", f"{where}.timeline[{i}].time")})
    return NodePart(
        incident=_text(raw, "incident", f"{where}.incident", max_len=MAX_TEXT),
        outcome=_text(raw, "outcome", f"{where}.outcome", max_len=64),
        timeline=timeline,
        stages=_stages(raw.get("stages"), f"{where}.stages"),
    )


def _stages(raw: Any, where: str) -> dict[str, float | None]:
    """A part's recovery stages: at most MAX_STAGES names -> seconds >= 0 or null (absent: none)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where}: expected an object of stage -> seconds")
    if len(raw) > MAX_STAGES:
        raise ProtocolError(f"{where}: at most {MAX_STAGES} stages, got {len(raw)}", code="too_large", status=413)
    out: dict[str, float | None] = {}
    for name, seconds in raw.items():
        if type(name) is not str or not STAGE_NAME_RE.fullmatch(name):
            raise ProtocolError(f"{where}: stage names are 1-32 of a-z, 0-9 and '_', got {str(name)[:40]!r}")
        out[name] = None if seconds is None else _seconds(raw, name, f"{where}.{name}")
    return out


def parse_report(data: dict, max_ranks: int) -> NodeReport:
    """A node's report, validated; ProtocolError names the first bad field."""
    node = _text(data, "node", "node", max_len=253)
    if not NODE_NAME.fullmatch(node):
        raise ProtocolError("node: expected letters, digits, '.', '_' or '-'")
    url = data.get("url") or ""
    if url and check_url(url) is not None:
        raise ProtocolError(f"url: {check_url(url)}")
    return NodeReport(
        job_id=_job_id(data),
        node=node,
        world_size=_int(data, "world_size", "world_size", 1, MAX_RANK + 1),
        time=_seconds(data, "time", "time"),
        ranks=[_rank_view(r, f"ranks[{i}]") for i, r in enumerate(_list(data, "ranks", "ranks", max_ranks))],
        url=url,
        dumped=_text(data, "dumped", "dumped", nullable=True, default=None, max_len=MAX_TEXT),
        part=_part(data, "part"),
        job_incident=_text(data, "job_incident", "job_incident", nullable=True, default=None, max_len=MAX_TEXT),
        healthy=_int(data, "healthy", "healthy", 0, max_ranks, default=0),
        lateness=parse_entries(data.get("lateness"), max_ranks),
        golive=parse_figures(data.get("golive"), max_ranks),
        drill=_drill(data, "drill"),
        rtt=None if data.get("rtt") is None else _seconds(data, "rtt", "rtt"),
    )


DRILL_ID = re.compile(r"drill-\d{8}T\d{6}Z-[0-9a-f]{6}")  # sidecar/watchdog/drill.py names drills so


def _drill(obj: dict, where: str) -> str | None:
    value = obj.get("drill")
    if value is None:
        return None
    if type(value) is not str or not DRILL_ID.fullmatch(value):
        raise ProtocolError(f"{where}: expected a drill id (drill-YYYYMMDDTHHMMSSZ-xxxxxx) or null")
    return value


def _choice(obj: dict, key: str, where: str, choices: tuple[str, ...], default: str) -> str:
    value = obj.get(key, default)
    if value not in choices:
        raise ProtocolError(f"{where}: expected one of {', '.join(choices)}")
    return value


def _kind(raw: dict) -> str:
    """A verdict's kind: any well-formed name (a newer node's kind is carried, hang_kinds.OTHER)."""
    value = raw.get("kind", hang_kinds.RANK_UNKNOWN.name)
    if type(value) is not str or not hang_kinds.NAME_RE.fullmatch(value):
        raise ProtocolError("culprit.kind: expected a kind's name (a-z, 0-9 and '_', at most 40)")
    return value


MAX_COLLECTIVE_NAMES = 64  # nodes or ranks named in a verdict's collective


def _collective(raw: Any) -> dict[str, Any] | None:
    """A verdict's collective, checked field by field; unknown keys dropped."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ProtocolError("culprit.collective: expected an object or null")
    where = "culprit.collective"
    out: dict[str, Any] = {
        "pg": _text(raw, "pg", f"{where}.pg", max_len=64),
        "desc": _text(raw, "desc", f"{where}.desc", nullable=True, default=None, max_len=64),
        "seq": _int(raw, "seq", f"{where}.seq", 0, (1 << 62) - 1),
        "op": _text(raw, "op", f"{where}.op", nullable=True, default=None, max_len=MAX_TEXT),
        "repeat": bool(_bool(raw, "repeat", f"{where}.repeat")),
        "waiting": _int(raw, "waiting", f"{where}.waiting", 0, MAX_RANK + 1, default=0),
    }
    for key, limit in (("nodes", MAX_COLLECTIVE_NAMES), ("late", MAX_COLLECTIVE_NAMES)):
        values = _list(raw, key, f"{where}.{key}", limit)
        if key == "nodes":
            out[key] = [_text({"n": n}, "n", f"{where}.nodes[{i}]", max_len=253) for i, n in enumerate(values)]
        else:
            out[key] = [_int({"r": r}, "r", f"{where}.late[{i}]", 0, MAX_RANK) for i, r in enumerate(values)]
    ops = raw.get("ops") or {}
    if not isinstance(ops, dict) or len(ops) > 8:
        raise ProtocolError(f"{where}.ops: expected an object of at most 8 signatures")
    out["ops"] = {
        _text({"s": sig}, "s", f"{where}.ops", max_len=MAX_TEXT): [
            _int({"r": r}, "r", f"{where}.ops[{sig!r}]", 0, MAX_RANK)
            for r in _list(ops, sig, f"{where}.ops", MAX_COLLECTIVE_NAMES)
        ]
        for sig in ops
    }
    odd = raw.get("odd")
    if odd is not None:
        if not isinstance(odd, dict) or len(odd) > MAX_COLLECTIVE_NAMES:
            raise ProtocolError(f"{where}.odd: expected an object of at most {MAX_COLLECTIVE_NAMES} rank -> node")
        out["odd"] = {
            str(_int({"r": int(r) if isinstance(r, str) and r.isdigit() else r}, "r", f"{where}.odd", 0, MAX_RANK)):
            _text(odd, r, f"{where}.odd[{r!r}]", max_len=253)
            for r in odd
        }  # fmt: skip
    return out


def parse_verdict(data: Any) -> Verdict | None:
    """The coordinator's answer (None: no incident); ProtocolError when it is malformed."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ProtocolError("verdict: expected an object or null")
    culprit = None
    if data.get("culprit") is not None:
        raw = _object(data, "culprit", "verdict.culprit")
        culprit = Culprit(
            rank=_int(raw, "rank", "culprit.rank", 0, MAX_RANK, nullable=True),
            node=_text(raw, "node", "culprit.node", max_len=253),
            step=_int(raw, "step", "culprit.step", 0, (1 << 63) - 1, nullable=True),
            phase=_text(raw, "phase", "culprit.phase", nullable=True, max_len=MAX_TEXT),
            stack_top=_text(raw, "stack_top", "culprit.stack_top", nullable=True, max_len=MAX_TEXT),
            reason=_text(raw, "reason", "culprit.reason", default="", max_len=4 * MAX_TEXT),
            kind=_kind(raw),
            evidence=_choice(raw, "evidence", "culprit.evidence", EVIDENCE, "stacks"),
            collective=_collective(raw.get("collective")),
            busy=bool(_bool(raw, "busy", "culprit.busy")),
        )

    def names(key: str, limit: int) -> list[str]:
        return [
            _text({"n": n}, "n", f"verdict.{key}[{i}]", max_len=253)
            for i, n in enumerate(_list(data, key, f"verdict.{key}", limit))
        ]

    decided = data.get("decided")
    return Verdict(
        job_id=_job_id(data),
        job_incident=_text(data, "job_incident", "verdict.job_incident", max_len=MAX_TEXT),
        version=_int(data, "version", "verdict.version", 0, (1 << 63) - 1),
        opened=_seconds(data, "opened", "verdict.opened"),
        culprit=culprit,
        lost_nodes=names("lost_nodes", MAX_LOST),
        nodes=_int(data, "nodes", "verdict.nodes", 0, 1 << 31, default=0),
        dumped=_int(data, "dumped", "verdict.dumped", 0, 1 << 31, default=0),
        not_dumped=names("not_dumped", MAX_NOT_DUMPED),
        decided=None if decided is None else _seconds(data, "decided", "verdict.decided"),
        closed=bool(_bool(data, "closed", "verdict.closed")),
        repeats=_int(data, "repeats", "verdict.repeats", 0, 1 << 31, default=0),
        crash_loop=bool(_bool(data, "crash_loop", "verdict.crash_loop")),
        drill=_drill(data, "verdict.drill"),
    )
