"""A rank's collective record (its Flight Recorder, summarised by trainer_hooks/collectives.py) as
the sidecar holds it: validated from a push, kept with the rank, reported to the job's
coordinator, exported per process group and judged (sidecar/jobview/collectives.py).

A rank sends its own record, so everything here is an attacker's input: bounded by the wire's
limits (groups, pending entries, shapes, text lengths), refused whole with a `ProtocolError` that
names the field. A whole Flight Recorder dump (`fr_dump`, sent when an incident asks for it) is
checked for shape and size only: the sidecar stores it for `fr_trace` and never reads it further.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from sidecar.ranks.protocol import ProtocolError
from sidecar.safetext import unsafe
from trainer_hooks.wire import (
    COLLECTIVES_MAX_GROUP_RANKS,
    COLLECTIVES_MAX_GROUPS,
    COLLECTIVES_MAX_PENDING,
    COLLECTIVES_MAX_RECENT,
    COLLECTIVES_MAX_SIZES,
    MAX_RANK,
    MAX_TIME,
)

MAX_SEQ = (1 << 62) - 1
MAX_DIMS = 8
MAX_TEXT = 64
FR_DUMP_MAX_BYTES = 512 * 1024  # a whole Flight Recorder dump, as JSON
FR_DUMP_MAX_ENTRIES = 256
FR_DUMP_MAX_DEPTH = 32  # torch's dump nests about 5 levels; pickling a deep one would recurse past Python's limit


def _depth(obj: Any) -> int:
    """How deep `obj` nests (iteratively: a deep value must not recurse here either)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, level)
            if level > FR_DUMP_MAX_DEPTH:
                return level
            stack.extend((v, level + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


@dataclass(frozen=True, slots=True)
class Pending:
    """A collective the rank enqueued and has not seen complete."""

    seq: int
    op: str  # "all_reduce", "broadcast", "barrier", ... (the backend's prefix removed)
    sizes: tuple[tuple[int, ...], ...]  # input shapes
    created: float  # the rank's wall clock when it was enqueued
    state: str = "scheduled"  # NCCL: scheduled | started; gloo: always scheduled

    @property
    def signature(self) -> str:
        shapes = ",".join("x".join(map(str, s)) or "scalar" for s in self.sizes)
        return f"{self.op}[{shapes}]" if self.sizes else self.op


@dataclass(slots=True)
class Group:
    """One process group as one rank sees it: the last collective sequence it enqueued, started
    and completed, and its oldest collectives in flight."""

    pg: str  # the recorder's name of the group ("0" is the default group)
    desc: str
    size: int | None  # members (None: not known)
    ranks: tuple[int, ...] | None  # members' global ranks, when few enough to send
    enqueued: int
    started: int
    completed: int
    pending: list[Pending] = field(default_factory=list)
    # (seq, created): when the rank entered each of its newest collectives of the group (its wall
    # clock, ascending sequences; hooks before it send none): what lateness is measured from
    recent: tuple[tuple[int, float], ...] = ()

    @property
    def waiting(self) -> bool:
        """The rank entered a collective of this group that has not completed."""
        return self.enqueued > self.completed

    def brief(self) -> str:
        """ "pg 0 (default_pg): in all_reduce[1000] #5; completed #4" for people."""
        name = f"pg {self.pg}" + (f" ({self.desc})" if self.desc else "")
        if not self.waiting:
            return f"{name}: completed #{self.completed}, none in flight"
        first = self.pending[0] if self.pending else None
        inside = f"in {first.signature} #{first.seq}" if first is not None else f"enqueued #{self.enqueued}"
        return f"{name}: {inside}; completed #{self.completed}"


@dataclass(slots=True)
class Collectives:
    """A rank's record: when it read it (its wall clock) and its groups."""

    time: float
    groups: list[Group]

    def group(self, pg: str) -> Group | None:
        return next((g for g in self.groups if g.pg == pg), None)

    @property
    def waiting(self) -> bool:
        """The rank is inside a collective of some group (it waits on its peers)."""
        return any(g.waiting for g in self.groups)

    def to_wire(self) -> dict[str, Any]:
        """The record as a job view report carries it: for a hang's verdict. `recent` stays home (the
        entry times a straggler is judged from; a job view of lateness would send its own summary)."""
        return {
            "time": self.time,
            "groups": [
                {
                    "pg": g.pg, "desc": g.desc, "size": g.size, "ranks": list(g.ranks) if g.ranks is not None else None,
                    "enqueued": g.enqueued, "started": g.started, "completed": g.completed,
                    "pending": [
                        {"seq": p.seq, "op": p.op, "sizes": [list(s) for s in p.sizes], "created": p.created,
                         "state": p.state}
                        for p in g.pending
                    ],
                }
                for g in self.groups
            ],
        }  # fmt: skip

    def brief(self) -> str:
        return "; ".join(g.brief() for g in self.groups[:4])


# ---------------------------------------------------------------- parsing


def _int(obj: dict, key: str, where: str, lo: int, hi: int, nullable: bool = False) -> Any:
    value = obj.get(key)
    if value is None and nullable:
        return None
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"{where}.{key}: expected an integer in [{lo}, {hi}]")
    return value


def _str(obj: dict, key: str, where: str, empty: bool = True) -> str:
    value = obj.get(key, "" if empty else None)
    if value is None and empty:
        value = ""
    if type(value) is not str or len(value) > MAX_TEXT or unsafe(value) or (not value and not empty):
        raise ProtocolError(f"{where}.{key}: expected at most {MAX_TEXT} characters, no control or bidi characters")
    return value


def _list(obj: dict, key: str, where: str, limit: int, nullable: bool = False) -> Any:
    value = obj.get(key)
    if value is None and nullable:
        return None
    if value is None:
        return []
    if type(value) is not list:
        raise ProtocolError(f"{where}.{key}: expected an array")
    if len(value) > limit:
        raise ProtocolError(f"{where}.{key}: at most {limit} entries, got {len(value)}", code="too_large", status=413)
    return value


def _pending(obj: Any, where: str) -> Pending:
    if type(obj) is not dict:
        raise ProtocolError(f"{where}: expected an object")
    sizes = []
    for i, shape in enumerate(_list(obj, "sizes", where, COLLECTIVES_MAX_SIZES)):
        if type(shape) is not list or len(shape) > MAX_DIMS or any(type(d) is not int or not 0 <= d <= MAX_SEQ
                                                                    for d in shape):  # fmt: skip
            raise ProtocolError(f"{where}.sizes[{i}]: expected at most {MAX_DIMS} dimensions >= 0")
        sizes.append(tuple(shape))
    created = obj.get("created")
    if not isinstance(created, (int, float)) or isinstance(created, bool) or not 0 <= created < MAX_TIME:
        raise ProtocolError(f"{where}.created: expected Unix seconds")
    return Pending(
        seq=_int(obj, "seq", where, 0, MAX_SEQ),
        op=_str(obj, "op", where, empty=False),
        sizes=tuple(sizes),
        created=float(created),
        state=_str(obj, "state", where) or "scheduled",
    )


def parse_recent(items: list, where: str) -> tuple[tuple[int, float], ...]:
    """Entry times `[[seq, created], ...]` (a rank's `recent`, or a node report's copy of it):
    sequences ascending, times Unix seconds; ProtocolError names the first bad one."""
    out: list[tuple[int, float]] = []
    for i, item in enumerate(items):
        here = f"{where}[{i}]"
        if type(item) is not list or len(item) != 2:
            raise ProtocolError(f"{here}: expected [seq, created]")
        seq, created = item
        if type(seq) is not int or not 0 <= seq <= MAX_SEQ:
            raise ProtocolError(f"{here}: expected a sequence number in [0, {MAX_SEQ}]")
        if out and seq <= out[-1][0]:
            raise ProtocolError(f"{here}: expected sequence numbers in ascending order")
        if type(created) not in (int, float) or not math.isfinite(created) or not 0 <= created < MAX_TIME:
            raise ProtocolError(f"{here}: expected Unix seconds")
        out.append((seq, float(created)))
    return tuple(out)


def _recent(obj: dict, where: str) -> tuple[tuple[int, float], ...]:
    """A group's `recent`, at most COLLECTIVES_MAX_RECENT pairs."""
    return parse_recent(_list(obj, "recent", where, COLLECTIVES_MAX_RECENT), f"{where}.recent")


def _group(obj: Any, where: str) -> Group:
    if type(obj) is not dict:
        raise ProtocolError(f"{where}: expected an object")
    ranks = _list(obj, "ranks", where, COLLECTIVES_MAX_GROUP_RANKS, nullable=True)
    if ranks is not None and any(type(r) is not int or not 0 <= r <= MAX_RANK for r in ranks):
        raise ProtocolError(f"{where}.ranks: expected global ranks in [0, {MAX_RANK}]")
    raw_pending = _list(obj, "pending", where, COLLECTIVES_MAX_PENDING)
    pending = [_pending(p, f"{where}.pending[{i}]") for i, p in enumerate(raw_pending)]
    return Group(
        pg=_str(obj, "pg", where, empty=False),
        desc=_str(obj, "desc", where),
        size=_int(obj, "size", where, 1, MAX_RANK + 1, nullable=True),
        ranks=tuple(ranks) if ranks is not None else None,
        enqueued=_int(obj, "enqueued", where, -1, MAX_SEQ),
        started=_int(obj, "started", where, -1, MAX_SEQ),
        completed=_int(obj, "completed", where, -1, MAX_SEQ),
        pending=pending,
        recent=_recent(obj, where),
    )


def parse_collectives(obj: Any, where: str = "collectives") -> Collectives | None:
    """A push's `collectives` (None when absent); ProtocolError names the first bad field."""
    if obj is None:
        return None
    if type(obj) is not dict:
        raise ProtocolError(f"{where}: expected an object")
    when = obj.get("time")
    if not isinstance(when, (int, float)) or isinstance(when, bool) or not 0 <= when < MAX_TIME:
        raise ProtocolError(f"{where}.time: expected Unix seconds")
    raw_groups = _list(obj, "groups", where, COLLECTIVES_MAX_GROUPS)
    groups = [_group(g, f"{where}.groups[{i}]") for i, g in enumerate(raw_groups)]
    if len({g.pg for g in groups}) != len(groups):
        raise ProtocolError(f"{where}.groups: a process group is named twice")
    return Collectives(float(when), groups)


def parse_fr_dump(obj: Any, where: str = "fr_dump") -> bytes | None:
    """A push's whole Flight Recorder dump, as compact JSON bytes to keep (None when absent): an
    object with `entries` (at most FR_DUMP_MAX_ENTRIES), `pg_config` and `version`, at most
    FR_DUMP_MAX_BYTES. Its content is the rank's own and is never interpreted."""
    if obj is None:
        return None
    if type(obj) is not dict:
        raise ProtocolError(f"{where}: expected an object")
    entries = obj.get("entries")
    if type(entries) is not list or len(entries) > FR_DUMP_MAX_ENTRIES or any(type(e) is not dict for e in entries):
        raise ProtocolError(f"{where}.entries: expected at most {FR_DUMP_MAX_ENTRIES} objects")
    if type(obj.get("pg_config", {})) is not dict or type(obj.get("version", "")) is not str:
        raise ProtocolError(f"{where}: expected torch's dump (pg_config an object, version a string)")
    if _depth(obj) > FR_DUMP_MAX_DEPTH:
        raise ProtocolError(f"{where}: nested deeper than {FR_DUMP_MAX_DEPTH} levels")
    raw = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    if len(raw) > FR_DUMP_MAX_BYTES:
        raise ProtocolError(f"{where}: at most {FR_DUMP_MAX_BYTES} bytes", code="too_large", status=413)
    return raw
