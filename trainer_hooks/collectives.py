"""The rank's collective progress, from PyTorch's Flight Recorder (the backend's own record).

torch keeps, per process, a ring of the collectives it enqueued on every process group (gloo and
NCCL alike, `TORCH_FR_BUFFER_SIZE` entries; none by default) and, per group, the sequence number
of the last collective enqueued, started and completed. That record says which collective a rank
waits in, whatever its Python stack shows: a CUDA job's waiting rank blocks at its next sync point,
not in torch.distributed's frames. The sidecar judges a hang from it (sidecar/jobview/collectives.py):
a rank that never entered the collective its peers wait in is the culprit; a collective every
member entered and none finished is the network's; members at one sequence with different ops are
a desync.

- `enable()` turns the recorder on (a small ring) before the process group forms, unless the user
  set `TORCH_FR_BUFFER_SIZE` (their setting wins) or `SIDECAR_COLLECTIVES=0`. Importing
  `trainer_hooks` under torchrun, creating a `Monitor` and `-m trainer_hooks.attach` call it.
- `read()` runs on the hooks' sender thread, never on the training thread: one
  `_dump_fr_trace_json` call (0.3-3 ms for a ring of tens of entries), summarised by `summarize()`
  into what the sidecar needs: per group the last enqueued / started / completed sequence, the
  oldest collectives still in flight (op, sizes, when each was created) and when the rank entered
  each of its most recent ones (`recent`: the sidecar's lateness of a straggler,
  sidecar/ranks/lateness.py). Bounded by the wire's limits.
- `dump_json()` is the whole record (torch's JSON form), sent when the sidecar asks for it: the
  incident keeps it in torch's own pickle format, which `fr_trace` reads.

Standard library only at import; torch is used only where the process already imported it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from trainer_hooks.environment import switched_on
from trainer_hooks.wire import (
    COLLECTIVES_EVERY_SECONDS,
    COLLECTIVES_MAX_GROUP_RANKS,
    COLLECTIVES_MAX_GROUPS,
    COLLECTIVES_MAX_PENDING,
    COLLECTIVES_MAX_RECENT,
    COLLECTIVES_MAX_SIZES,
    MAX_TIME,
)

SWITCH = "SIDECAR_COLLECTIVES"
BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
DEFAULT_BUFFER = 64  # entries: a few steps of a DDP job; the ring's memory is a few tens of KiB
FR_DUMP_MAX_ENTRIES = 256  # of a whole dump sent for an incident (wire: under the push body limit)
WHOLE_EVERY_SECONDS = 10.0  # the entries are read at least this often, and whenever they matter (read())
_MAX_SEQ = 1 << 62  # the sidecar's bound on a sequence number (sidecar/ranks/collectives.py)
_MAX_NS = int(MAX_TIME * 1e9)
READ_EVERY_SECONDS = COLLECTIVES_EVERY_SECONDS  # the record is read this often, with a push (one of its own if idle)


def enabled(environ: Mapping[str, str]) -> bool:
    return switched_on(environ, SWITCH)


def enable(environ: MutableMapping[str, str] | None = None) -> bool:
    """Turn the Flight Recorder on for the process groups formed from now on; True when it is on
    (the user's own buffer size counts). torch reads the variable when it creates its recorder."""
    env = os.environ if environ is None else environ
    try:
        if not enabled(env):
            return False
        current = env.get(BUFFER_ENV)
        if current is not None:
            return current.strip() not in ("", "0")
        # changes: flight-recorder (docs/changes-to-others.md)
        env[BUFFER_ENV] = str(DEFAULT_BUFFER)
        return True
    except Exception:  # an environment mapping that refuses writes: nothing to do
        return False


def _c10d() -> Any:
    """torch's c10d bindings when the process imported torch and formed a group, else None."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return sys.modules.get("torch._C._distributed_c10d") or getattr(
        getattr(torch, "_C", None), "_distributed_c10d", None
    )


def _members() -> dict[str, tuple[str, list[int]]]:
    """Each process group of this process by its recorder name: (description, global ranks)."""
    dist = sys.modules["torch"].distributed
    world = dist.distributed_c10d._world
    out: dict[str, tuple[str, list[int]]] = {}
    for pg, name in list(world.pg_names.items()):
        ranks = world.pg_group_ranks.get(pg)
        out[str(name)] = (str(getattr(pg, "group_desc", "") or ""), sorted(ranks) if ranks else [])
    return out


def _traces(c10d: Any, entries: bool = True) -> list[dict]:
    """Every recorder's dump: the generic one (gloo, CPU) and, on a CUDA build, NCCL's own.
    `entries=False`: pg_status alone (0.1 ms however large the ring; the entries cost ~0.5 ms per
    64, under the GIL)."""
    out = []
    for call in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        dump = getattr(c10d, call, None)
        if dump is None:
            continue
        try:
            trace = json.loads(dump(includeCollectives=entries, onlyActive=False))
        except RuntimeError:  # NCCL's recorder absent from this build or process
            continue
        if isinstance(trace, dict):
            out.append(trace)
    return out


def _status_in_flight(statuses: list[dict]) -> bool:
    return any(_seq(s, "last_enqueued_collective") > _seq(s, "last_completed_collective") for st in statuses
               for s in st.values() if isinstance(s, Mapping))  # fmt: skip


class _Cache:
    """What the last whole read learnt, for the light reads in between: each recorder's
    pg_id -> name, the groups as summarised, and whether any carried point-to-point work."""

    def __init__(self) -> None:
        self.statuses: list[dict] | None = None  # the previous read's pg_status of each recorder
        self.names: list[dict[str, str]] = []
        self.groups: dict[str, dict] = {}
        self.p2p = True  # until a whole read says otherwise: read whole
        self.whole_slot = -1  # the wall-clock slot (WHOLE_EVERY_SECONDS long) of the last whole read


_cache = _Cache()


def read(now: float | None = None, whole: bool = False, clock_offset: float = 0.0) -> dict | None:
    """This rank's collective record for the sidecar, or None (no torch, no group, no recorder).

    Reading the recorder's entries holds the GIL for ~0.5 ms per 64 entries (50-110 ms for a ring of
    2,000 a user may have set): the training thread would wait for it. So the entries are read only
    when they matter: when a collective has been in flight since the previous read (a rank waits:
    what a hang is judged from), when the sidecar asks (`whole`), once in every WHOLE_EVERY_SECONDS
    slot of the wall clock, and while a group carries point-to-point work (its pg_status mixes both).
    Otherwise the record is pg_status alone (0.1 ms), named through the last whole read, with the last
    whole read's `recent`. The slots are the wall clock's, not this process's: every rank of a node
    reads its entries within about a read interval of its peers, so their `recent` windows overlap
    (the sidecar compares the ranks' entry times of the same collectives). `clock_offset` (this
    node's clock - the job's coordinator's, as the sidecar says it) moves the slots onto the
    coordinator's clock, so that ranks on nodes whose clocks differ by seconds read together too."""
    c10d = _c10d()
    if c10d is None:
        return None
    when = time.time() if now is None else now
    statuses = [t.get("pg_status") or {} for t in _traces(c10d, entries=False)]
    if not statuses:
        return None
    waited = _status_in_flight(statuses) and statuses == _cache.statuses
    known = len(statuses) == len(_cache.names) and all(
        str(k) in names for st, names in zip(statuses, _cache.names, strict=True) for k in st
    )
    _cache.statuses = statuses
    slot = _slot(when - clock_offset)
    if whole or waited or _cache.p2p or not known or slot != _cache.whole_slot:
        return _read_whole(c10d, when, slot)
    groups = []
    for st, names in zip(statuses, _cache.names, strict=True):
        for key, s in st.items():
            last = _cache.groups.get(names[str(key)])
            if last is None:
                continue
            groups.append({**last, "enqueued": _seq(s, "last_enqueued_collective"),
                           "started": _seq(s, "last_started_collective"),
                           "completed": _seq(s, "last_completed_collective"), "pending": []})  # fmt: skip
    groups.sort(key=_in_flight_first)
    return {"time": round(when, 6), "groups": groups[:COLLECTIVES_MAX_GROUPS]}


def _read_whole(c10d: Any, when: float, slot: int) -> dict | None:
    traces = _traces(c10d)
    if not traces:
        return None
    try:
        members = _members()
    except Exception:  # a torch whose private world moved: membership from the record alone
        members = {}
    records = [summarize(t, members, when) for t in traces]
    _cache.names = [_pg_names(t) for t in traces]
    _cache.p2p = any(isinstance(e, dict) and e.get("is_p2p") for t in traces for e in t.get("entries") or [])
    _cache.whole_slot = slot
    merged: dict[str, dict] = {}  # a group both recorders know (a CPU and a CUDA backend): the busier
    for record in records:
        for g in record["groups"]:
            if g["pg"] not in merged or g["enqueued"] > merged[g["pg"]]["enqueued"]:
                merged[g["pg"]] = g
    _cache.groups = merged
    groups = sorted(merged.values(), key=_in_flight_first)[:COLLECTIVES_MAX_GROUPS]
    return {"time": round(when, 6), "groups": groups}


def _pg_names(trace: Mapping[str, Any]) -> dict[str, str]:
    """The recorder's pg_id -> the group's name, from its entries."""
    names: dict[str, str] = {}
    for e in trace.get("entries") or []:
        if isinstance(e, dict) and "pg_id" in e:
            names.setdefault(str(e["pg_id"]), _clean((e.get("process_group") or ["?"])[0], "?"))
    return names


def dump_json(max_entries: int = FR_DUMP_MAX_ENTRIES) -> dict | None:
    """The whole record as torch gives it in JSON (entries, pg_config, pg_status, version; the
    newest `max_entries` entries), or None. The sidecar keeps it with the incident in torch's own
    pickle format, which `python -m torch.distributed.flight_recorder.fr_trace` reads."""
    c10d = _c10d()
    if c10d is None:
        return None
    traces = _traces(c10d)
    if not traces:
        return None
    trace = max(traces, key=lambda t: len(t.get("entries") or []))  # NCCL's, in a CUDA job
    if isinstance(trace.get("entries"), list):
        trace["entries"] = trace["entries"][-max_entries:]
    config = trace.get("pg_config")
    if not isinstance(config, dict) or not any(name for name in config):
        # gloo's record leaves the groups' members out; fr_trace needs them
        descs = {str(e["process_group"][0]): str(e["process_group"][1]) for e in trace.get("entries") or []
                 if isinstance(e, dict) and len(e.get("process_group") or ()) > 1}  # fmt: skip
        trace["pg_config"] = {
            name: {"name": name, "desc": desc or descs.get(name, ""), "ranks": json.dumps(ranks)}
            for name, (desc, ranks) in _members().items()
        }
    return trace


# What the sidecar refuses in a record's names (control, C1, bidi, separators, lone surrogates):
# replaced here, so that an odd group description never costs the push its steps.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")


def _clean(text: object, default: str = "") -> str:
    return _UNSAFE.sub("?", str(text))[:64] or default


def _op(entry: Mapping[str, Any]) -> str:
    name = str(entry.get("profiling_name") or "?")
    return _clean(name.split(":", 1)[-1], "?")  # "nccl:all_reduce", "gloo:all_reduce" -> "all_reduce"


def _sizes(entry: Mapping[str, Any]) -> list[list[int]]:
    sizes = entry.get("input_sizes") or []
    out = []
    for shape in sizes[:COLLECTIVES_MAX_SIZES]:
        out.append([int(d) for d in shape[:8]] if isinstance(shape, list) else [])
    return out


def _seq(status: Mapping[str, Any], key: str) -> int:
    try:
        return int(status.get(key, -1))
    except (TypeError, ValueError):
        return -1


MAX_CLOCK_OFFSET = 86400.0  # seconds: a larger offset from the sidecar is ignored


def clock_offset(said: object, before: float) -> float:
    """The clock offset a push's answer says (`clock_offset`), or `before` when it says none or
    something that is not a plausible offset (the hooks never raise on what the sidecar sends)."""
    if isinstance(said, (int, float)) and not isinstance(said, bool) and abs(said) <= MAX_CLOCK_OFFSET:
        return float(said)  # NaN fails the comparison
    return before


def _slot(when: float) -> int:
    """The wall-clock slot a read falls in: a whole read once per slot, at about the same moment on
    every rank of the node (their reads are at most a read interval apart)."""
    return int(when // WHOLE_EVERY_SECONDS)


def _recent(coll: list[Mapping[str, Any]]) -> list[list[float]]:
    """[[seq, created seconds], ...] of the group's newest COLLECTIVES_MAX_RECENT collectives, in
    sequence order, completed or not: when this rank entered each (a coalesced collective's several
    entries share a sequence: its first). Its peers' entries of the same sequences say how late it was."""
    created: dict[int, int] = {}
    for e in coll:
        ns, seq = e.get("time_created_ns"), e["collective_seq_id"]
        # what the sidecar refuses (and the push with it) is left out: not a time, not a sequence
        if (
            type(ns) is int
            and 0 < ns < _MAX_NS
            and type(seq) is int
            and 0 <= seq < _MAX_SEQ
            and created.get(seq, ns) >= ns
        ):
            created[seq] = ns
    # microseconds, as `pending`'s `created` (ns // 1000: the float's shortest form has at most 6 decimals)
    return [[seq, created[seq] // 1000 / 1e6] for seq in sorted(created)[-COLLECTIVES_MAX_RECENT:]]


def _in_flight_first(group: dict[str, Any]) -> tuple[bool, str]:
    return (not group["pending"] and group["enqueued"] <= group["completed"], str(group["pg"]))


def _done(entry: Mapping[str, Any]) -> bool:
    """The collective finished: gloo retires its work (`retired`), NCCL also says `completed`."""
    return entry.get("retired") is True or entry.get("state") == "completed"


def _sequences(status: Mapping[str, Any], coll: list[Mapping[str, Any]], p2p: bool) -> tuple[int, int, int]:
    """(enqueued, started, completed) of one group. pg_status is the backend's own word, but on NCCL
    it counts point-to-point work too (a send's sequence is written there), and gloo's two worker
    threads can leave its `completed` behind an op retired since: the group's collective entries
    correct both (completed: the highest sequence up to which each sequence has a finished entry)."""
    enqueued = -1 if p2p else _seq(status, "last_enqueued_collective")
    started = -1 if p2p else _seq(status, "last_started_collective")
    completed = -1 if p2p else _seq(status, "last_completed_collective")
    by_seq: dict[int, list[Mapping[str, Any]]] = {}
    for e in coll:
        by_seq.setdefault(int(e["collective_seq_id"]), []).append(e)
    for seq in sorted(by_seq):
        enqueued = max(enqueued, seq)
        if any(e.get("state") in ("started", "completed") for e in by_seq[seq]):
            started = max(started, seq)
        # a coalesced group's per-op entries are never retired: its 'coalesced' work entry is
        if seq > completed and any(_done(e) for e in by_seq[seq]):
            completed = seq
    return enqueued, started, completed


def summarize(trace: Mapping[str, Any], members: Mapping[str, tuple[str, list[int]]], now: float) -> dict:
    """The record the hooks send: per process group (by its name, the same on every rank), the last
    enqueued, started and completed collective sequence, the group's size and members (global ranks,
    when few enough), and its oldest collectives still in flight. `trace`: what `_dump_fr_trace_json`
    or `_dump_nccl_trace_json` returns; `members`: name -> (description, global ranks).

    pg_status is keyed by the backend's process-local id, not the group's name (a rank creates only
    the groups it is in; a group may be named by a hash): the entries map one to the other. A group
    with no entry left in the ring is left out (nothing of it is in flight, and its name is not known)."""
    status = trace.get("pg_status") or {}
    config = trace.get("pg_config") or {}
    names: dict[str, str] = {}  # the recorder's pg_id -> the group's name
    descs: dict[str, str] = {}
    entries: dict[str, list[Mapping[str, Any]]] = {}
    for e in trace.get("entries") or []:
        if not isinstance(e, dict) or not isinstance(e.get("collective_seq_id"), int):
            continue
        group = e.get("process_group") or ["", ""]
        name = str(group[0])
        if "pg_id" in e:
            names.setdefault(str(e["pg_id"]), name)
        if len(group) > 1 and group[1]:
            descs.setdefault(name, str(group[1]))
        entries.setdefault(name, []).append(e)
    groups: list[dict[str, Any]] = []
    for key, s in status.items():
        found = names.get(str(key))
        if found is None:
            continue
        name = found
        mine = entries.get(name, [])
        coll = [e for e in mine if not e.get("is_p2p")]
        enqueued, started, completed = _sequences(s, coll, any(e.get("is_p2p") for e in mine))
        desc, ranks = members.get(name, ("", []))
        if not ranks:  # NCCL's record names each group's ranks; gloo's does not
            try:
                ranks = sorted(int(r) for r in json.loads((config.get(name) or {}).get("ranks") or "[]"))
            except (TypeError, ValueError):
                ranks = []
        inflight = sorted(
            (e for e in coll if e["collective_seq_id"] > completed and not _done(e)),
            key=lambda e: e["collective_seq_id"],
        )[:COLLECTIVES_MAX_PENDING]
        groups.append(
            {
                "pg": _clean(name, "?"),
                "desc": _clean(desc or descs.get(name) or (config.get(name) or {}).get("desc") or ""),
                "size": len(ranks) if ranks else None,
                "ranks": ranks if 0 < len(ranks) <= COLLECTIVES_MAX_GROUP_RANKS else None,
                "enqueued": enqueued,
                "started": started,
                "completed": completed,
                "pending": [
                    {
                        "seq": int(e["collective_seq_id"]),
                        "op": _op(e),
                        "sizes": _sizes(e),
                        "created": round(int(e.get("time_created_ns") or 0) / 1e9, 6),
                        "state": _clean(e.get("state") or "scheduled")[:16],
                    }
                    for e in inflight
                ],
                "recent": _recent(coll),
            }
        )
    # Groups with something in flight first: they are what a hang is judged from.
    groups.sort(key=_in_flight_first)
    return {"time": round(now, 6), "groups": groups[:COLLECTIVES_MAX_GROUPS]}
