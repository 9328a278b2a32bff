"""Flight Recorder dumps in the backends' own format through the whole path the sidecar judges a
hang from: the hooks' `summarize` (trainer_hooks/collectives.py), the sidecar's `parse_collectives`
(sidecar/ranks/collectives.py) and the job view's `judge` (sidecar/jobview/collectives.py).

NCCL dumps cannot be recorded on this machine (a CPU wheel has no NCCL), so `NcclRank` and
`NcclGroup` below replay, step by step, what torch 2.13's C++ does for each rank and write the dump
exactly as `FlightRecorder<EventType>::dump_json` does (FlightRecorderDetail.hpp; the key names are
the constants of FlightRecorder.hpp; the bookkeeping is ProcessGroupNCCL.cpp's `collective`,
`pointToPoint`, `startCoalescing`/`endCoalescing`, `initWork`, `workEnqueue` and the watchdog's
loop). The gloo recorder writes its JSON with the same template, so the model's key set is checked
against a real gloo dump recorded here (fixtures/fr_nccl/gloo_*.json, by fixtures/fr_nccl/record_gloo.py).

The section "cases that were bugs" holds what this replay found wrong in the core code at first
(groups keyed by the recorder's process-local id, gloo's lagging `completed`, NCCL's point-to-point
sequences, coalesced groups, NCCL's own recorder): each failed before its fix and passes after.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sidecar.jobview import collectives as judging
from sidecar.jobview.report import RankView
from sidecar.ranks.collectives import Collectives, parse_collectives
from trainer_hooks import collectives

FIXTURES = Path(__file__).parent / "fixtures" / "fr_nccl"
NS = 1_000_000_000
READ_AT = 1_796_400_100.0  # every rank's wall clock when its hooks read the record (summarize's `now`)
AGE = 0.2  # seconds since the sidecar received each record, at the report's time

# ---------------------------------------------------------------- torch's NCCL recorder, replayed


@dataclass
class Entry:
    """`FlightRecorder<EventType>::Entry` (FlightRecorder.hpp), as `recordWithResetEnabled` fills it."""

    id: int  # id_: the recorder's running record number -> "record_id"
    pg_id: int  # ProcessGroupNCCL::local_id_ (per-process count of NCCL groups) -> "pg_id"
    pg_name: tuple[str, str]  # (pg_uid_ = the group's name, pg_desc_) -> "process_group"
    collective_seq_id: int  # seqCollective_ at record -> "collective_seq_id"
    p2p_seq_id: int  # seqP2P_ at record -> "p2p_seq_id"
    op_id: int  # op_id_ at record -> "op_id"
    profiling_name: str  # the op's profiling title, "nccl:all_reduce" -> "profiling_name"
    time_created: int  # c10::getTime(), wall clock ns -> "time_created_ns"
    is_p2p: bool  # -> "is_p2p"
    input_sizes: list[list[int]]  # input_dims_ + sizes_ -> "input_sizes"
    output_sizes: list[list[int]]  # -> "output_sizes"
    dtype: str  # c10::toString(ScalarType) -> "input_dtypes", "output_dtypes" (one per tensor)
    events: bool = True  # start_/end_: null for the per-op entries of a coalesced group
    timing: bool = True  # start_ exists only with TORCH_NCCL_ENABLE_TIMING=1
    timeout_ms: int = 600_000  # options_->timeout (kProcessGroupNCCLDefaultTimeout) -> "timeout_ms"
    gpu_started: float | None = None  # when its start event fires (seconds), None: not yet
    gpu_ended: float | None = None  # when its end event fires
    discovered_started: int | None = None  # time_discovered_started_ -> "time_discovered_started_ns"
    discovered_completed: int | None = None  # time_discovered_completed_ -> "time_discovered_completed_ns"
    duration: float | None = None  # duration_ (ms, only with timing) -> "duration_ms"
    retired: bool = False  # -> "retired"

    def update_state(self, now: float) -> None:
        """`FlightRecorder::update_state`: query the events (the first discovery time sticks)."""
        if self.events and self.timing and self.gpu_started is not None and self.gpu_started <= now:
            if self.discovered_started is None:
                self.discovered_started = int(now * NS)
        if self.events and self.gpu_ended is not None and self.gpu_ended <= now:
            if self.discovered_completed is None:
                self.discovered_completed = int(now * NS)

    def to_json(self) -> dict[str, Any]:
        """One element of `entries`, as `dump_json` writes it (no stack frames in JSON)."""
        j: dict[str, Any] = {
            "record_id": self.id,
            "pg_id": self.pg_id,
            "process_group": list(self.pg_name),
            "thread_name": "python",  # c10::getThreadName() of the calling (training) thread
            "thread_id": "140318021625664",  # c10::str(std::this_thread::get_id())
            "collective_seq_id": self.collective_seq_id,
            "p2p_seq_id": self.p2p_seq_id,
            "op_id": self.op_id,
            "profiling_name": self.profiling_name,
            "time_created_ns": self.time_created,
        }
        if self.duration is not None:
            j["duration_ms"] = self.duration
        j["input_sizes"] = self.input_sizes
        j["input_dtypes"] = [self.dtype] * len(self.input_sizes)
        j["output_sizes"] = self.output_sizes
        j["output_dtypes"] = [self.dtype] * len(self.output_sizes)
        # completed_state / started_state / scheduled_state, from the discovery times
        j["state"] = (
            "completed"
            if self.discovered_completed is not None
            else "started"
            if self.discovered_started is not None
            else "scheduled"
        )
        j["time_discovered_started_ns"] = self.discovered_started or 0  # JSON: 0 when unset (pickle: None)
        j["time_discovered_completed_ns"] = self.discovered_completed or 0
        j["retired"] = self.retired
        j["timeout_ms"] = self.timeout_ms
        j["is_p2p"] = self.is_p2p
        return j


class NcclRank:
    """One rank's `FlightRecorder<at::cuda::CUDAEvent>` (FlightRecorderCUDA) and its NCCL groups."""

    def __init__(self, rank: int, timing: bool = True, max_entries: int = 64):
        self.rank = rank
        self.timing = timing  # TORCH_NCCL_ENABLE_TIMING
        self.max_entries = max_entries  # TORCH_FR_BUFFER_SIZE
        self.entries: list[Entry] = []  # the ring, oldest first (dump_entries' order)
        self.next_id = 0
        self.status: dict[int, dict[str, int]] = {}  # all_pg_status_: pg_id -> ProcessGroupStatus
        self.pg_ranks: dict[tuple[str, str], list[int]] = {}  # pg_name_to_ranks_ (record_pg_ranks)
        self.groups: dict[str, NcclGroup] = {}
        self.local_ids = 0  # ProcessGroupNCCL.cpp's static process_group_id

    def group(self, name: str, desc: str, ranks: list[int]) -> NcclGroup:
        """`new_group` on a member rank: a ProcessGroupNCCL (local_id_ = process_group_id++) whose
        communicator records the group's ranks (record_pg_ranks). A rank outside `ranks` gets
        NON_GROUP_MEMBER and creates nothing, so its local ids do not count that group."""
        g = NcclGroup(self, self.local_ids, name, desc, sorted(ranks))
        self.local_ids += 1
        self.groups[name] = g
        self.pg_ranks[(name, desc)] = g.ranks
        return g

    def record(self, g: NcclGroup, name: str, sizes: list[list[int]], is_p2p: bool, t: float, events: bool,
               out: list[list[int]] | None = None, dtype: str = "Float") -> Entry:  # fmt: skip
        """`recordWithResetEnabled`: registers the group's status on its first record."""
        self.status.setdefault(g.local_id, g.status)
        e = Entry(self.next_id, g.local_id, (g.name, g.desc), g.seq_collective, g.seq_p2p, g.op_id, name,
                  int(t * NS), is_p2p, sizes, sizes if out is None else out, dtype, events, self.timing)  # fmt: skip
        self.next_id += 1
        self.entries = (self.entries + [e])[-self.max_entries :]
        return e

    def watchdog(self, t: float) -> None:
        for g in self.groups.values():
            g.watchdog(t)

    def dump(self, now: float = READ_AT, only_active: bool = False) -> dict[str, Any]:
        """What `_dump_nccl_trace_json(includeCollectives=True, onlyActive=...)` returns, parsed:
        `dump_json(getNCCLCommDumpMap(), ...)`. pg_status's values are strings (getPgStatusJson),
        its keys the groups' pg_id; pg_config's keys the groups' names, ranks as ranks_str."""
        out: dict[str, Any] = {
            "version": "2.10",  # version_val
            "comm_lib_version": "2.27.5",  # record_accelerator_version(getNcclVersion())
            "pg_config": {
                name: {"name": name, "desc": desc, "ranks": "[" + ", ".join(map(str, ranks)) + "]"}
                for (name, desc), ranks in sorted(self.pg_ranks.items())
            },
            "pg_status": {
                str(pg_id): {
                    "last_enqueued_collective": str(s["enqueued"]),
                    "last_started_collective": str(s["started"]),
                    "last_completed_collective": str(s["completed"]),
                }
                for pg_id, s in sorted(self.status.items())
            },
        }
        entries = []
        for e in self.entries:  # dump_entries: copies, their events queried now (not kept)
            copy = Entry(**{k: getattr(e, k) for k in e.__dataclass_fields__})
            if not copy.retired:
                copy.update_state(now)
            if only_active and copy.discovered_completed is not None:
                continue
            entries.append(copy.to_json())
        if entries:  # `entries` is left out when there is none
            out["entries"] = entries
        out["nccl_comm_state"] = {}  # getNCCLCommDumpMap(): ncclCommDump per communicator, when built in
        return out


@dataclass
class NcclGroup:
    """The bookkeeping of one ProcessGroupNCCL that feeds the recorder."""

    rank: NcclRank
    local_id: int
    name: str
    desc: str
    ranks: list[int]
    seq_collective: int = 0  # seqCollective_
    seq_p2p: int = 0  # seqP2P_
    op_id: int = 0  # op_id_
    status: dict[str, int] = field(default_factory=lambda: {"enqueued": -1, "started": -1, "completed": -1})
    works: list[tuple[int, Entry]] = field(default_factory=list)  # workMetaList_: (work.seq_, its entry)

    def _enqueue(self, seq: int, e: Entry) -> None:
        """`workEnqueue`: lastEnqueuedSeq = work->seq_ (seqP2P_ for a point-to-point work)."""
        self.works.append((seq, e))
        self.status["enqueued"] = seq

    def collective(self, op: str, sizes: list[list[int]], t: float, out: list[list[int]] | None = None,
                   dtype: str = "Float") -> Entry:  # fmt: skip
        """`ProcessGroupNCCL::collective`: seqCollective_++, op_id_++, initWork records, enqueue."""
        self.seq_collective += 1
        self.op_id += 1
        e = self.rank.record(self, f"nccl:{op}", sizes, False, t, True, out, dtype)
        self._enqueue(self.seq_collective, e)
        return e

    def p2p(self, op: str, peer: int, t: float, sizes: list[list[int]]) -> Entry:
        """`pointToPoint` (lazy init, not coalesced): seqP2P_++, op_id_++; the work's seq_ is seqP2P_."""
        self.seq_p2p += 1
        self.op_id += 1
        arrow = "->" if op == "send" else "<-"
        e = self.rank.record(self, f"nccl:{op} {self.rank.rank}{arrow}{peer}", sizes, True, t, True)
        self._enqueue(self.seq_p2p, e)
        return e

    def coalesced(self, ops: list[tuple[str, list[list[int]]]], t: float) -> Entry:
        """`startCoalescing`, one `collective` per op (the first bumps seqCollective_; each op is
        recorded without events, and not enqueued), `endCoalescing`: the "nccl:coalesced" work."""
        self.seq_collective += 1
        for op, sizes in ops:
            self.op_id += 1
            self.rank.record(self, f"nccl:{op}", sizes, False, t, False)
        e = self.rank.record(self, "nccl:coalesced", [], False, t, True)
        self._enqueue(self.seq_collective, e)
        return e

    def watchdog(self, t: float) -> None:
        """The watchdog's pass over workMetaList_: lastStartedSeq when a work started (timing only),
        lastCompletedSeq and retire_id (update_state, duration, retired) when it completed."""
        left = []
        for seq, e in self.works:
            if e.timing and e.gpu_started is not None and e.gpu_started <= t and self.status["started"] < seq:
                self.status["started"] = seq
            if e.gpu_ended is not None and e.gpu_ended <= t:
                self.status["completed"] = seq
                e.update_state(t)
                if e.timing and e.gpu_started is not None:
                    e.duration = round((e.gpu_ended - e.gpu_started) * 1000, 3)
                e.retired = True
            else:
                left.append((seq, e))
        self.works = left


def run(e: Entry, start: float, end: float | None) -> Entry:
    """The GPU: the collective's kernel starts (its peers need not be there) and maybe ends."""
    e.gpu_started, e.gpu_ended = start, end
    return e


# ---------------------------------------------------------------- the job: 4 ranks, 2 nodes

NODES = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
GRAD, SMALL, LOSS = [[4096]], [[1024]], [[1]]
STEPS = 5
HANG = READ_AT - 12.0  # when the collective that hangs was called


def trained(world: int = 4, timing: bool = True) -> list[NcclRank]:
    """Every rank: the default group ("0"), "dp" ("1") and "metrics" ("2"), all of the world, so that
    each rank's pg_id of a group is its name; a parameter broadcast, then STEPS healthy steps (two
    gradient buckets on "dp", a loss all-reduce on "metrics"), each collective done in milliseconds."""
    ranks = []
    everyone = list(range(world))
    for r in everyone:
        rank = NcclRank(r, timing=timing)
        default, dp, metrics = (rank.group(n, d, everyone) for n, d in (("0", "default_pg"), ("1", "dp"),
                                                                           ("2", "metrics")))  # fmt: skip
        t = HANG - 2.0
        run(default.collective("broadcast", GRAD, t), t + 0.001, t + 0.002)
        for step in range(STEPS):
            t = HANG - 1.0 + step * 0.1
            run(dp.collective("all_reduce", GRAD, t, dtype="BFloat16"), t + 0.001, t + 0.003)
            run(dp.collective("all_reduce", SMALL, t + 0.01, dtype="BFloat16"), t + 0.011, t + 0.012)
            run(metrics.collective("all_reduce", LOSS, t + 0.02), t + 0.021, t + 0.022)
            rank.watchdog(t + 0.05)
        ranks.append(rank)
    return ranks


N = 2 * STEPS + 1  # the sequence number, in "dp", of the collective that hangs


def python_members(rank: NcclRank) -> dict[str, tuple[str, list[int]]]:
    """What the hooks' `_members()` gives on that rank: the groups it belongs to, by name."""
    return {g.name: (g.desc, g.ranks) for g in rank.groups.values()}


def record(rank: NcclRank, dump: dict | None = None, now: float = READ_AT) -> dict:
    """The rank's record as the hooks send it, checked as the sidecar checks it."""
    rec = collectives.summarize(rank.dump(now) if dump is None else dump, python_members(rank), now)
    assert parse_collectives(json.loads(json.dumps(rec))) is not None  # over the wire, then validated
    return rec


def view(r: int, rec: dict) -> RankView:
    """The rank as a node's report shows it (as tests/jobview/helpers.py builds one)."""
    parsed = parse_collectives(rec)
    return RankView(r, r % 2, "stalled", 29, None, 8.0, True, "train_step (train.py:14)", None, parsed, AGE)


def verdict(recs: dict[int, dict], force: bool = False) -> judging.Finding | None:
    return judging.judge([(NODES.get(r, f"node-{r}"), view(r, rec)) for r, rec in recs.items()], force=force)


def group_of(rec: dict, pg: str) -> dict:
    (g,) = [g for g in rec["groups"] if g["pg"] == pg]
    return g


# ---------------------------------------------------------------- the format itself


def test_the_nccl_model_writes_the_keys_a_real_dump_has():
    """The gloo recorder and the NCCL one write JSON with one template (dump_json): the model's keys
    are those of a dump torch wrote on this machine (gloo leaves `duration_ms` out: no timing)."""
    real = json.loads((FIXTURES / "gloo_late_rank.json").read_text())["ranks"]["0"]["dump"]
    [rank] = trained(world=1)
    model = rank.dump()
    assert set(model) == set(real)
    assert {k for e in model["entries"] for k in e} - {"duration_ms"} == {k for e in real["entries"] for k in e}
    assert all("duration_ms" in e for e in model["entries"])  # completed with timing: duration computed
    assert set(model["pg_status"]["0"]) == set(real["pg_status"]["0"])
    assert all(isinstance(v, str) for s in model["pg_status"].values() for v in s.values())
    assert model["pg_config"]["1"] == {"name": "1", "desc": "dp", "ranks": "[0]"}
    assert "entries" not in rank.dump(only_active=True)  # nothing in flight: torch leaves the key out


# ---------------------------------------------------------------- verdicts from NCCL dumps


def test_nccl_a_rank_that_never_entered_the_collective_is_late():
    ranks = trained()
    for r in (0, 1, 3):  # enter dp's all-reduce #N: the kernels start and wait for rank 2
        run(ranks[r].groups["1"].collective("all_reduce", GRAD, HANG, dtype="BFloat16"), HANG + 0.001, None)
    for rank in ranks:  # rank 2 is elsewhere (its data loader), in no collective
        rank.watchdog(READ_AT - 0.05)
    recs = {rank.rank: record(rank) for rank in ranks}

    waiting = group_of(recs[0], "1")
    assert (waiting["enqueued"], waiting["started"], waiting["completed"]) == (N, N, N - 1)
    assert [(p["seq"], p["op"], p["sizes"], p["state"]) for p in waiting["pending"]] == [
        (N, "all_reduce", GRAD, "started")
    ]
    assert waiting["pending"][0]["created"] == pytest.approx(HANG)
    assert recs[0]["groups"][0]["pg"] == "1"  # the group with something in flight comes first
    late = group_of(recs[2], "1")
    assert (late["enqueued"], late["completed"], late["pending"]) == (N - 1, N - 1, [])  # #N-1 completed
    assert all(g["pending"] == [] for rec in recs.values() for g in rec["groups"] if g["pg"] != "1")

    found = verdict(recs)
    assert found is not None and found.kind == "rank_late"
    assert found.culprit is not None and (found.culprit[0], found.culprit[1].rank) == ("node-b", 2)
    assert (found.pg, found.desc, found.seq, found.op, found.late) == ("1", "dp", N, "all_reduce[4096]", [2])
    assert found.to_culprit().evidence == "collectives"


def test_nccl_every_member_inside_and_none_done_is_a_stuck_collective():
    ranks = trained()
    for rank in ranks:
        run(rank.groups["1"].collective("all_reduce", GRAD, HANG, dtype="BFloat16"), HANG + 0.001, None)
        rank.watchdog(READ_AT - 0.05)
    recs = {rank.rank: record(rank) for rank in ranks}
    assert all(group_of(rec, "1")["pending"][0]["state"] == "started" for rec in recs.values())

    found = verdict(recs)
    assert found is not None and found.kind == "collective_stuck" and found.culprit is None
    assert (found.pg, found.seq, found.op, found.late) == ("1", N, "all_reduce[4096]", [])
    assert found.nodes == ["node-a", "node-b"] and found.to_culprit().rank is None


@pytest.mark.parametrize(
    ("odd_rank", "op", "sizes", "ops"),
    [
        (3, "broadcast", GRAD, {"all_reduce[4096]": [0, 1, 2], "broadcast[4096]": [3]}),
        (1, "all_reduce", [[2048]], {"all_reduce[2048]": [1], "all_reduce[4096]": [0, 2, 3]}),
    ],
    ids=["profiling_name", "input_sizes"],
)
def test_nccl_members_at_one_sequence_with_different_collectives_are_a_desync(odd_rank, op, sizes, ops):
    ranks = trained()
    for rank in ranks:
        called = (op, sizes) if rank.rank == odd_rank else ("all_reduce", GRAD)
        run(rank.groups["1"].collective(*called, HANG, dtype="BFloat16"), HANG + 0.001, None)
        rank.watchdog(READ_AT - 0.05)
    recs = {rank.rank: record(rank) for rank in ranks}

    found = verdict(recs)
    assert found is not None and found.kind == "collective_mismatch"
    assert found.culprit is not None and found.culprit[1].rank == odd_rank and list(found.odd) == [odd_rank]
    assert (found.pg, found.seq, found.ops) == ("1", N, ops)


@pytest.mark.parametrize("only_active", [False, True], ids=["all_entries", "only_active"])
def test_nccl_a_healthy_job_has_nothing_in_flight(only_active):
    ranks = trained()
    recs = {rank.rank: record(rank, rank.dump(only_active=only_active)) for rank in ranks}
    for rec in recs.values():
        assert all(g["enqueued"] == g["completed"] and g["pending"] == [] for g in rec["groups"])
        if not only_active:  # without entries, only pg_status (by pg_id) is left to name the groups
            assert {g["pg"] for g in rec["groups"]} == {"0", "1", "2"}
            assert (group_of(rec, "1")["enqueued"], group_of(rec, "2")["enqueued"]) == (2 * STEPS, STEPS)
            assert group_of(rec, "1")["ranks"] == [0, 1, 2, 3]
    assert verdict(recs) is None and verdict(recs, force=True) is None


def test_nccl_a_completed_entry_the_watchdog_has_not_retired_is_not_in_flight():
    """The dump queries the events itself: an entry can say "completed" while pg_status, which only
    the watchdog updates, still has the previous sequence. Counting it in flight would call a slow
    collective that just finished (12 s here) a stuck one."""
    ranks = trained()
    for rank in ranks:
        run(rank.groups["1"].collective("all_reduce", GRAD, HANG, dtype="BFloat16"), HANG + 0.001, READ_AT - 0.01)
        rank.watchdog(READ_AT - 0.05)  # before the end event fired
    recs = {rank.rank: record(rank) for rank in ranks}
    dumped = [e for e in ranks[0].dump()["entries"] if e["collective_seq_id"] == N and e["pg_id"] == 1]
    assert [(e["state"], e["retired"]) for e in dumped] == [("completed", False)]
    g = group_of(recs[0], "1")
    assert (g["enqueued"], g["pending"]) == (N, []) and g["completed"] in (N - 1, N)
    assert verdict(recs) is None and verdict(recs, force=True) is None


def test_nccl_groups_take_their_members_from_the_recorders_pg_config():
    """Without the Python side's membership (it moved in some torch), NCCL's pg_config names the
    ranks of each group (gloo's does not)."""
    [rank, *_] = trained()
    rec = collectives.summarize(rank.dump(), {}, READ_AT)
    assert {g["pg"]: (g["desc"], g["size"], g["ranks"]) for g in rec["groups"]} == {
        "0": ("default_pg", 4, [0, 1, 2, 3]),
        "1": ("dp", 4, [0, 1, 2, 3]),
        "2": ("metrics", 4, [0, 1, 2, 3]),
    }


# ---------------------------------------------------------------- real gloo dumps (this machine)


def gloo_records(recorded: dict) -> dict[int, dict]:
    out = {}
    for r, part in recorded["ranks"].items():
        members = {name: (desc, ranks) for name, (desc, ranks) in part["members"].items()}
        rec = collectives.summarize(part["dump"], members, part["read_at"])
        assert parse_collectives(json.loads(json.dumps(rec))) is not None
        out[int(r)] = rec
    return out


def check_gloo_late_rank(recorded: dict) -> None:
    """Rank 1 never entered dp's all-reduce #5, in which rank 0 waits (record_gloo.py)."""
    dump0 = recorded["ranks"]["0"]["dump"]
    assert {e["state"] for e in dump0["entries"]} == {"scheduled"}  # gloo: no events, state stays
    assert all(s["last_started_collective"] == "-1" for s in dump0["pg_status"].values())
    assert dump0["pg_config"] == {"": {"desc": "", "name": "", "ranks": "[]"}}  # gloo: no members there
    recs = gloo_records(recorded)
    waiting, late = group_of(recs[0], "1"), group_of(recs[1], "1")
    assert (waiting["desc"], waiting["ranks"], waiting["enqueued"], waiting["completed"]) == ("dp", [0, 1], 5, 4)
    assert [(p["seq"], p["op"], p["sizes"]) for p in waiting["pending"]] == [(5, "all_reduce", [[1000]])]
    assert (late["enqueued"], late["completed"], late["pending"]) == (4, 4, [])

    found = judging.judge([(f"node-{r}", view(r, rec)) for r, rec in recs.items()])
    assert found is not None and found.kind == "rank_late"
    assert found.culprit is not None and found.culprit[1].rank == 1
    assert (found.pg, found.desc, found.seq, found.op, found.late) == ("1", "dp", 5, "all_reduce[1000]", [1])


def test_gloo_a_recorded_dump_of_a_late_rank_names_it():
    recorded = json.loads((FIXTURES / "gloo_late_rank.json").read_text())
    check_gloo_late_rank(recorded)
    idle = [group_of(rec, "0") for rec in gloo_records(recorded).values()]
    assert [(g["enqueued"], g["completed"], g["pending"]) for g in idle] == [(3, 3, [])] * 2


@pytest.mark.slow
def test_gloo_a_fresh_dump_of_a_late_rank_names_it(tmp_path):
    """The same, recorded now by two real gloo ranks (about 10 s): torch's format has not moved."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("record_gloo", FIXTURES / "record_gloo.py")
    assert spec is not None and spec.loader is not None
    recorder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recorder)
    check_gloo_late_rank(recorder.record(tmp_path / "dump.json"))


# ---------------------------------------------------------------- cases that were bugs
# pg_status is keyed by the backend's process-local pg_id (ProcessGroupNCCL/Gloo::local_id_), not the
# group's name (entries' process_group[0], pg_config's key, _world.pg_names): they differ once a rank
# skips a group it is not in or a group is named by a hash.


def test_gloo_a_group_named_by_a_hash_keeps_its_own_record():
    """Recorded here: a "tp" group named by a hash of its ranks comes first, so torch names "dp" "1"
    while its recorder id is 2; rank 1 is late in dp's #5 again."""
    recs = gloo_records(json.loads((FIXTURES / "gloo_hashed_group.json").read_text()))
    assert {g["pg"] for g in recs[0]["groups"]} == {"0", "1", "4a2ad14e7181d5235b64cf37fcd715cb5ce5c8e7"}
    dp = group_of(recs[0], "1")
    assert (dp["desc"], dp["enqueued"], dp["completed"], [p["seq"] for p in dp["pending"]]) == ("dp", 5, 4, [5])
    found = judging.judge([(f"node-{r}", view(r, rec)) for r, rec in recs.items()])
    assert found is not None and found.culprit is not None and found.culprit[1].rank == 1
    assert (found.pg, found.desc, found.seq, found.op) == ("1", "dp", 5, "all_reduce[1000]")


def test_gloo_a_finished_collective_is_not_in_flight_when_pg_status_lags():
    """Recorded here, unpaced: rank 0's default group says completed #2 of 3 while #3 is retired and
    rank 0 has since done four all-reduces on dp."""
    recorded = json.loads((FIXTURES / "gloo_stale_completed.json").read_text())
    dump0 = recorded["ranks"]["0"]["dump"]
    assert dump0["pg_status"]["0"]["last_completed_collective"] == "2"
    assert [e["retired"] for e in dump0["entries"] if e["pg_id"] == 0] == [True, True, True]
    idle = group_of(gloo_records(recorded)[0], "0")
    assert (idle["enqueued"], idle["completed"], idle["pending"]) == (3, 3, [])


def tp_dp() -> list[NcclRank]:
    """4 ranks, tensor parallel x data parallel: tp "1" = [0, 1], tp "2" = [2, 3], dp "3" = [0, 2],
    dp "4" = [1, 3] (every rank calls new_group for all four; each creates only its own two). Stage
    shapes differ: dp "3" reduces [4096], dp "4" [1024]. Two healthy steps of (tp, then dp)."""
    layout = {"1": ("tp", [0, 1]), "2": ("tp", [2, 3]), "3": ("dp", [0, 2]), "4": ("dp", [1, 3])}
    ranks = []
    for r in range(4):
        rank = NcclRank(r)
        rank.group("0", "default_pg", [0, 1, 2, 3])
        for name, (desc, members) in layout.items():
            if r in members:
                rank.group(name, desc, members)
        ranks.append(rank)
    for step in range(2):
        t = HANG - 1.0 + step * 0.1
        for rank in ranks:
            tp, dp = (g for g in rank.groups.values() if g.name != "0")
            run(tp.collective("all_reduce", [[8, 512]], t), t + 0.001, t + 0.002)
            run(dp.collective("all_reduce", GRAD if rank.rank % 2 == 0 else SMALL, t + 0.01), t + 0.011, t + 0.012)
            rank.watchdog(t + 0.05)
    return ranks


def test_nccl_tensor_and_data_parallel_groups_keep_their_names():
    """Rank 3 stalls before step 3's tp all-reduce: rank 2 waits in tp "2" #3, rank 1 (its tp done
    with rank 0) waits in dp "4" #3 for rank 3, rank 0 waits in dp "3" #3 for rank 2. Every rank's
    pg_status says "1" and "2" for its own tp and dp, whatever their names."""
    ranks = tp_dp()
    t = HANG
    for r in (0, 1):
        run(ranks[r].groups["1"].collective("all_reduce", [[8, 512]], t), t + 0.001, t + 0.002)
    run(ranks[2].groups["2"].collective("all_reduce", [[8, 512]], t), t + 0.001, None)
    run(ranks[0].groups["3"].collective("all_reduce", GRAD, t + 0.01), t + 0.011, None)
    run(ranks[1].groups["4"].collective("all_reduce", SMALL, t + 0.01), t + 0.011, None)
    for rank in ranks:
        rank.watchdog(READ_AT - 0.05)
    dumped = ranks[1].dump()
    assert set(dumped["pg_status"]) == {"1", "2"} and set(dumped["pg_config"]) == {"0", "1", "4"}
    recs = {rank.rank: record(rank) for rank in ranks}
    for rank in ranks:  # the groups that recorded a collective, by their names
        assert {g["pg"] for g in recs[rank.rank]["groups"]} == {g.name for g in rank.groups.values() if g.op_id}
    assert [p["sizes"] for p in group_of(recs[0], "3")["pending"]] == [GRAD]
    found = verdict(recs)
    assert found is not None and found.kind == "rank_late"
    assert found.culprit is not None and found.culprit[1].rank == 3
    # late in its tp ("2", where rank 2 waits) and its dp ("4", where rank 1 waits): the first group
    assert (found.pg, found.seq, found.op, found.waiting, found.late) == ("2", 3, "all_reduce[8x512]", 1, [3])


def test_nccl_point_to_point_traffic_does_not_hide_a_collective():
    """A 3-stage pipeline on "pp" (the middle stage sends and receives twice as much) with a loss
    all-reduce on "pp" per step; in step 6 rank 2 stalls after its sends and receives, before the
    all-reduce that ranks 0 and 1 wait in."""
    ranks = [NcclRank(r) for r in range(3)]
    for rank in ranks:
        rank.group("0", "default_pg", [0, 1, 2])  # unused here; pp's pg_id is its name, 1
        rank.group("1", "pp", [0, 1, 2])
    for step in range(STEPS + 1):
        t = HANG - 1.0 + step * 0.1
        for rank in ranks:
            pp = rank.groups["1"]
            peers = {0: [1], 1: [0, 2], 2: [1]}[rank.rank]
            for k, peer in enumerate(peers * 2):  # forward and backward: a send or a recv each
                run(pp.p2p("send" if (k + rank.rank) % 2 == 0 else "recv", peer, t + k * 0.001, [[16, 256]]),
                    t + k * 0.001, t + k * 0.001 + 0.0005)  # fmt: skip
            rank.watchdog(t + 0.01)
            if step < STEPS:
                run(pp.collective("all_reduce", LOSS, t + 0.02), t + 0.021, t + 0.022)
            elif rank.rank != 2:
                run(pp.collective("all_reduce", LOSS, HANG), HANG + 0.001, None)
            rank.watchdog(t + 0.05)
    for rank in ranks:
        rank.watchdog(READ_AT - 0.05)
    recs = {rank.rank: record(rank) for rank in ranks}
    pp = group_of(recs[0], "1")
    assert (pp["enqueued"], pp["completed"], [p["seq"] for p in pp["pending"]]) == (STEPS + 1, STEPS, [STEPS + 1])
    assert group_of(recs[2], "1")["enqueued"] == STEPS
    found = verdict(recs)
    assert found is not None and found.kind == "rank_late"
    assert found.culprit is not None and found.culprit[1].rank == 2
    assert (found.pg, found.seq, found.op, found.late) == ("1", STEPS + 1, "all_reduce[1]", [2])


def test_nccl_a_coalesced_group_in_flight_is_not_a_desync():
    ranks = trained()
    for r in (0, 1, 2):  # rank 3 never comes: its peers wait in the coalesced broadcasts
        e = ranks[r].groups["1"].coalesced([("broadcast", GRAD), ("broadcast", SMALL)], HANG)
        run(e, HANG + 0.001, None)
    for rank in ranks:
        rank.watchdog(READ_AT - 0.05)
    recs = {rank.rank: record(rank) for rank in ranks}
    assert [(p["seq"], p["op"]) for p in group_of(recs[0], "1")["pending"]] == [
        (N, "broadcast"),
        (N, "broadcast"),
        (N, "coalesced"),
    ]
    found = verdict(recs)
    assert found is not None and found.kind == "rank_late", found and found.reason
    assert found.culprit is not None and found.culprit[1].rank == 3
    assert (found.pg, found.seq) == ("1", N)


class _C10d:
    """torch._C._distributed_c10d of a CUDA build in a job with only NCCL groups: the generic
    recorder (`_dump_fr_trace_json`, FlightRecorder<c10::Event>: gloo and CPU) is empty; NCCL's
    entries are in FlightRecorderCUDA, which `_dump_nccl_trace_json` dumps (torch 2.13's debug
    server shows the two as "FlightRecorder CPU" and "FlightRecorder NCCL")."""

    def __init__(self, nccl: dict):
        self.nccl = nccl

    def _dump_fr_trace_json(self, includeCollectives: bool = True, onlyActive: bool = False) -> bytes:
        empty = {"comm_lib_version": "", "nccl_comm_state": {}, "pg_config": {}, "pg_status": {}, "version": "2.10"}
        return json.dumps(empty).encode()

    def _dump_nccl_trace_json(self, includeCollectives: bool = True, onlyActive: bool = False) -> bytes:
        return json.dumps(self.nccl).encode()


def test_an_nccl_jobs_record_comes_from_the_nccl_recorder(monkeypatch):
    [rank, *_] = trained()
    monkeypatch.setattr(collectives, "_c10d", lambda: _C10d(rank.dump()))
    monkeypatch.setattr(collectives, "_members", lambda: python_members(rank))
    rec = collectives.read(now=READ_AT)
    assert rec is not None and {g["pg"] for g in rec["groups"]} == {"0", "1", "2"}
    whole = collectives.dump_json()
    assert whole is not None and len(whole.get("entries", [])) == len(rank.entries)


def test_nccl_a_finished_coalesced_group_beside_point_to_point_traffic_is_not_in_flight():
    """Two pipeline stages on "pp": a send/recv, then broadcasts coalesced on "pp" (startCoalescing /
    endCoalescing), all finished 13 s before the read."""
    ranks = [NcclRank(r) for r in range(2)]
    for rank in ranks:
        rank.group("0", "default_pg", [0, 1])
        pp = rank.group("1", "pp", [0, 1])
        t = HANG - 1.0
        run(pp.p2p("send" if rank.rank == 0 else "recv", 1 - rank.rank, t, [[16, 256]]), t, t + 0.0005)
        run(pp.coalesced([("broadcast", GRAD), ("broadcast", SMALL)], t + 0.01), t + 0.011, t + 0.012)
        rank.watchdog(t + 0.05)
    recs = {rank.rank: record(rank) for rank in ranks}
    for rec in recs.values():
        pp = group_of(rec, "1")
        assert (pp["enqueued"], pp["completed"], pp["pending"]) == (1, 1, [])
    assert verdict(recs) is None and verdict(recs, force=True) is None


def test_the_record_parses_as_the_sidecar_keeps_it():
    """Sanity for the helpers above: a record round-trips through the sidecar's own type."""
    [rank, *_] = trained()
    parsed = parse_collectives(record(rank))
    assert isinstance(parsed, Collectives) and parsed.group("1") is not None and not parsed.group("1").waiting
