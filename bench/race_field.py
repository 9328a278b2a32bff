"""bench_race --field: the race a user runs. One training script with a real job's pauses, none
declared (a data wait at each epoch start, an evaluation, a checkpoint to slow storage), under:

    a  ours, shipped   torchrun (warm agent) + sidecar at its shipped settings (floor 30 s, check 0.5 s,
                       pushes 2 s, dumps 2 s, SIGTERM grace 10 s)
    b  ours, lowest    the same with the lowest floor that killed none of the pauses, found first by
                       pauses-only runs (floors tried from 1 s up), check 0.25 s, pushes 0.25 s, dumps
                       0.5 s, grace 1 s
    c  NVRx heartbeat  ft_launcher, rank_heartbeat_timeout just above the longest pause (the eval + 5 s),
                       the script's heartbeat each step
    d  NVRx sections   ft_launcher, the script changed to NVRx's sections API (bench/field/
                       race_train_sections.py): setup, data, step, eval, checkpointing, the timeouts
                       NVRx computes after each checkpoint (safety_factor 5), kept for restarts

NVRx checks every 0.25 s (its default is 5 s) and stops a group with SIGTERM -> SIGKILL after 1 s
(its default 30 s): the cadence and grace of b. Each run trains through every pause, then a real
hang comes in a step of the last rank of the middle node (rotated per run: stopped, deadlocked,
spinning); after the kill the job resumes from its checkpoint and trains on, through the next
epoch's data wait. Runs interleave settings, their order rotated. Measured from the script's own
records: false kills (restarts beyond the hang's, each named by the pause it cut), hang -> killed,
hang -> training again. Target: hang -> training again of ours' best setting with zero false kills
<= 0.3 x NVRx's best setting with zero false kills, on one node and on three."""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from bench import nvrx, scratch
from bench.bench_race import records, training_again, watched
from bench.field.environment import SlowStorage
from harness.cluster import AGENTS, ClusterSpec, NodeSpec
from harness.job import SidecarSpec
from sidecar.config import Settings

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "field" / "race_train.py"
SECTIONS_SCRIPT = ROOT / "bench" / "field" / "race_train_sections.py"
DATA_SECONDS, EVAL_SECONDS, CKPT_SECONDS = 5.0, 20.0, 10.0
SCHEDULE = {"RACE_STEPS": "90", "RACE_EPOCH": "60", "RACE_EVAL_AT": "30", "RACE_CKPT_AT": "45"}
HANG_STEP = 75
HANGS = ("stop", "deadlock", "spin")
NVRX_TIMEOUT = EVAL_SECONDS + 5.0  # just above the longest pause
CHECK, GRACE = 0.25, 1.0
FLOORS = (1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 20.0, 30.0)
SETTINGS = ("a", "b", "c", "d")
NAMES = {"a": "ours, shipped", "b": "ours, lowest floor", "c": "NVRx heartbeat", "d": "NVRx sections"}
STORM = ["remediation.max_per_window=1000", "remediation.max_per_window_node=1000"]
JOB_TIMEOUT = 200.0  # a run takes 60-100 s; one whose restarts ran out may leave an agent waiting
TARGET = 0.3
MODEL_BYTES = 512 * 512 * 4 + 512 * 4 + 1500  # the script's Linear(512, 512) as torch.save writes it


@dataclass
class FieldRun:
    setting: str
    layout: str
    hang: str | None
    floor: float | None = None
    detected: float | None = None  # hang -> the side decided: ours' incident `detected`, NVRx's "FT timeout elapsed"
    killed: float | None = None  # hang -> the hung rank's process gone
    again: float | None = None  # hang -> every rank trained a step after it
    false_kills: list[str] = field(default_factory=list)  # the pause (or "training") each cut
    finished: bool = False
    seconds: float = 0.0

    def line(self) -> str:
        def s(x: float | None) -> str:
            return f"{x:6.2f} s" if x is not None else "     - "

        fk = ", ".join(self.false_kills) or "none"
        floor = f" floor {self.floor:g} s" if self.floor is not None else ""
        return (f"  {self.setting} {NAMES[self.setting]:<19} {self.layout:<6} {self.hang or 'pauses':<9}{floor:<13}"
                f"killed {s(self.killed)}  training again {s(self.again)}  false kills: {fk}  "
                f"{'finished' if self.finished else 'DID NOT FINISH'} ({self.seconds:.0f} s)")  # fmt: skip


def spec_for(
    setting: str, layout: list[int], hang: str | None, floor: float, nvrx_path: str, work: Path
) -> ClusterSpec:
    middle = len(layout) // 2
    nodes = []
    for i, nproc in enumerate(layout):
        env = {"CYCLE_HANGS": "1", "CYCLE_HANG_LOCAL_RANK": str(nproc - 1)} if i == middle and hang else {}
        nodes.append(NodeSpec(f"node-{i}", nproc, env))
    env = {
        **SCHEDULE, "RACE_DATA_SECONDS": str(DATA_SECONDS), "RACE_EVAL_SECONDS": str(EVAL_SECONDS),
        "CYCLE_HANG_STEP": str(HANG_STEP), "CYCLE_HANG_MODE": hang or "stop", "CYCLE_LOG": str(work / "cycle.jsonl"),
        "FIELD_STORAGE": str(work / "storage"), "RACE_STATE": str(work / "state"), "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    if setting in ("a", "b"):
        launcher, args = AGENTS["warm"]
        if setting == "a":
            sidecar = shipped()
        else:
            sidecar = SidecarSpec(floor_seconds=floor, dump_wait_seconds=0.5, grace_seconds=GRACE,
                                  extra=["hooks_flush_interval_seconds=0.25", *STORM])  # fmt: skip
        return ClusterSpec(nodes, script=SCRIPT, job_id="race-field", sidecar=sidecar, env=env, launcher=launcher,
                           agent_args=args)  # fmt: skip
    common = [f"--ft-workload-check-interval={CHECK}", f"--workers-stop-timeout={GRACE}"]
    if setting == "c":
        args = [*common, f"--ft-rank-heartbeat-timeout={NVRX_TIMEOUT}", "--ft-initial-rank-heartbeat-timeout=60"]
        script = SCRIPT
    else:
        t = f"{NVRX_TIMEOUT:g}"
        args = [*common, f"--ft-rank-section-timeouts=setup:60,data:{t},step:{t},eval:{t},checkpointing:{t}",
                f"--ft-rank-out-of-section-timeout={t}"]  # fmt: skip
        script = SECTIONS_SCRIPT
    return ClusterSpec(nodes, script=script, job_id="race-field", env=env, launcher=nvrx.MODULE, agent_args=args,
                       with_sidecars=False, pythonpath=[nvrx_path])  # fmt: skip


def shipped() -> SidecarSpec:
    """The sidecar at the settings it ships with (sidecar.config's defaults), the storm cap aside."""
    d = Settings()
    return SidecarSpec(floor_seconds=d.watchdog.floor_seconds, dump_wait_seconds=d.remediation.dump_wait_seconds,
                       grace_seconds=d.remediation.grace_seconds,
                       extra=[f"watchdog.check_interval_seconds={d.watchdog.check_interval_seconds}",
                              f"hooks_flush_interval_seconds={d.hooks_flush_interval_seconds}", *STORM])  # fmt: skip


def false_kills(recs: list[dict], hang_time: float | None) -> list[str]:
    """Each restart beyond the one the hang needed, named by the pause it cut ("training" if none)."""
    seen: set[int] = set()
    restarts: list[float] = []
    for r in sorted((r for r in recs if r["kind"] == "first_step"), key=lambda r: r["time"]):
        if r["rank"] in seen and (not restarts or r["time"] - restarts[-1] > 2.0):
            restarts.append(r["time"])  # one restart: the first rank of the new attempt to step
        seen.add(r["rank"])
    if hang_time is not None:
        after = [t for t in restarts if t > hang_time]
        if after:
            restarts.remove(after[0])
    cut = []
    for t in restarts:
        started = [r for r in recs if r["kind"] == "pause" and r["time"] < t]
        ended = {(r["pause"], r["step"], r["rank"]) for r in recs if r["kind"] == "pause_end" and r["time"] < t}
        open_ = [r["pause"] for r in started if (r["pause"], r["step"], r["rank"]) not in ended]
        cut.append(open_[-1] if open_ else "training")
    return cut


def run_one(spec: ClusterSpec, work: Path, run: FieldRun, world: int) -> FieldRun:
    (work / "state").mkdir(parents=True)
    storage = SlowStorage(work / "storage", world, MODEL_BYTES / CKPT_SECONDS)
    log = work / "cycle.jsonl"
    started = time.monotonic()
    try:
        run.finished, killed_at = watched(spec, work, log, JOB_TIMEOUT)
    finally:
        storage.close()
    run.seconds = time.monotonic() - started
    recs = records(log)
    hang = next((r for r in recs if r["kind"] == "hang"), None)
    run.false_kills = false_kills(recs, hang["time"] if hang else None)
    if hang is None:
        return run
    if killed_at is not None:
        run.killed = killed_at - hang["time"]
    found = detected_at(work, hang["time"], killed_at)
    run.detected = found - hang["time"] if found is not None else None
    run.again = training_again(recs, hang["time"], world)
    return run


def detected_at(work: Path, after: float, before: float | None) -> float | None:
    """When the side running in `work` decided on the hang: the first stall incident a sidecar
    opened after it (its `detected` event), or the first "FT timeout elapsed" of NVRx's rank monitors
    (their log lines' local time). None: neither found before the kill."""
    until = before if before is not None else float("inf")
    times = []
    for path in work.glob("node-*/diag/incidents/*.json"):
        with contextlib.suppress(OSError, ValueError):
            for e in json.loads(path.read_text()).get("timeline", []):
                if e.get("event") == "detected" and after <= e["time"] <= until:
                    times.append(e["time"])
    for path in work.glob("node-*-torchrun.log"):
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                if "FT timeout elapsed" in line and line.startswith("["):
                    with contextlib.suppress(ValueError):
                        t = datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                        if after <= t <= until:
                            times.append(t)
    return min(times, default=None)


def find_floor(layout: list[int], nvrx_path: str, root: Path, floors: tuple[float, ...]) -> float | None:
    """The lowest floor at which a pauses-only run was killed by none of its pauses (and finished)."""
    for floor in floors:
        work = root / f"floor-{'_'.join(map(str, layout))}-{floor:g}"
        run = run_one(spec_for("b", layout, None, floor, nvrx_path, work), work,
                      FieldRun("b", label(layout), None, floor), sum(layout))  # fmt: skip
        print(run.line(), flush=True)
        if run.finished and not run.false_kills:
            return floor
    return None


def label(layout: list[int]) -> str:
    return "+".join(map(str, layout))


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def code_change() -> str:
    """How many lines the sections API changed in the script (difflib, docstring excluded)."""
    body = lambda p: p.read_text().split('"""', 2)[2].splitlines()  # noqa: E731
    diff = list(difflib.unified_diff(body(SCRIPT), body(SECTIONS_SCRIPT), lineterm="", n=0))
    added = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
    removed = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
    return f"+{added} -{removed} lines"


def summary(runs: list[FieldRun], layouts: list[list[int]]) -> bool:
    met = True
    print("\nper setting (medians over its runs): false kills over the pauses | hang -> killed | hang -> training "
          "again | where it went: hang -> decided, decided -> killed, killed -> training again")  # fmt: skip
    for layout in layouts:
        name = label(layout)
        nodes = f"{len(layout)} node" + ("s" if len(layout) > 1 else "")
        best: dict[str, tuple[str, float]] = {}
        for s in SETTINGS:
            mine = [r for r in runs if r.setting == s and r.layout == name and r.hang]
            if not mine:
                continue
            fk = sum(len(r.false_kills) for r in mine)
            k, a = median([r.killed for r in mine]), median([r.again for r in mine])
            after = median([r.again - r.killed for r in mine if r.again is not None and r.killed is not None])
            decided = median([r.detected for r in mine])
            kill = median([r.killed - r.detected for r in mine if r.killed is not None and r.detected is not None])
            safe = fk == 0 and all(r.finished for r in mine) and a is not None and all(r.again for r in mine)
            floor = f" (floor {mine[0].floor:g} s)" if s == "b" and mine[0].floor is not None else ""
            print(f"  {nodes:<8} {s} {NAMES[s] + floor:<32} {len(mine)} runs: false kills {fk} | "
                  f"{_s(k)} | {_s(a)} | {_s(decided)}, {_s(kill)}, {_s(after)}"
                  f"{'' if safe else '  (not safe: excluded)'}")  # fmt: skip
            side = "ours" if s in ("a", "b") else "nvrx"
            if safe and a is not None and (side not in best or a < best[side][1]):
                best[side] = (s, a)
        if "ours" not in best or "nvrx" not in best:
            print(f"  {nodes:<8} no safe setting on {'our' if 'ours' not in best else 'NVRx'} side: FAIL")
            met = False
            continue
        (o, oa), (n, na) = best["ours"], best["nvrx"]
        ok = oa / na <= TARGET
        met = met and ok
        print(f"  {nodes:<8} at equal safety: ours ({o}) {oa:.2f} s vs NVRx ({n}) {na:.2f} s: x{oa / na:.2f} "
              f"(target <= {TARGET}: {'PASS' if ok else 'FAIL'})")  # fmt: skip
    return met


def _s(x: float | None) -> str:
    return f"{x:.2f} s" if x is not None else "-"


def main(runs_each: int, layouts: list[list[int]], floor: float | None, keep: bool, settings: str = "abcd") -> int:
    path = nvrx.ensure()
    if path is None:
        print("bench_race --field: NVRx is not available; nothing to race (FAIL)")
        return 1
    root = scratch.make("bench-race-field-")
    print(f"pauses: data wait {DATA_SECONDS:g} s at each epoch start, eval {EVAL_SECONDS:g} s at step 30, "
          f"checkpoint {CKPT_SECONDS:g} s to slow storage at step 45; hang at step {HANG_STEP}; NVRx {nvrx.VERSION} "
          f"heartbeat timeout {NVRX_TIMEOUT:g} s; the sections API changed the script by {code_change()}; "
          f"{os.cpu_count()} CPUs", flush=True)  # fmt: skip
    out: list[FieldRun] = []
    try:
        floors = {}
        for layout in layouts if "b" in settings else []:
            found = floor if floor is not None else find_floor(layout, path, root, FLOORS)
            print(f"  {label(layout)}: lowest floor with no pause killed: {found if found is not None else 'none'}")
            floors[label(layout)] = found if found is not None else FLOORS[-1]
        for i in range(runs_each):
            hang = HANGS[i % len(HANGS)]
            for layout in layouts:
                order = SETTINGS[i % 4 :] + SETTINGS[: i % 4]
                for s in (s for s in order if s in settings):
                    work = root / f"{i}-{label(layout)}-{s}"
                    fl = floors.get(label(layout), FLOORS[-1])
                    spec = spec_for(s, layout, hang, fl, path, work)
                    run = FieldRun(s, label(layout), hang, fl if s == "b" else None)
                    out.append(run_one(spec, work, run, sum(layout)))
                    print(out[-1].line(), flush=True)
    except KeyboardInterrupt:
        return 130
    finally:
        scratch.leave(root, keep)
    met = summary(out, layouts)
    print("PASS" if met else "FAIL")
    return 0 if met else 1
