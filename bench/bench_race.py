"""The race, fair: one unmodified script under NVIDIA's ft_launcher and under torchrun + sidecar,
the same hang, the same timeout, interleaved, on one node and on three simulated nodes.

    python -m bench.bench_race                    # 5 runs of each contender on each layout
    python -m bench.bench_race --runs 1 --layouts 2
    python -m bench.bench_race --ours torchrun    # ours with plain torchrun as the agent
    python -m bench.bench_race --field            # the race at equal safety, a real job's pauses (bench/race_field.py)

The script is bench/cycles/train_race.py: the `Monitor` example of docs/guide.md plus NVRx's heartbeat
(sent only under ft_launcher, which starts the rank monitor it goes to). After 20 steps and 1.5 s
of training, the last local rank of the middle node SIGSTOPs itself: a frozen rank, which neither
side can tell from a slow one until its timeout has passed.

    ours   python -m trainer_hooks.launch --warm (torchrun, its agent's rendezvous made faster, the
           restarted workers forked warm) next to one sidecar per node: watchdog.floor_seconds=T
           (a stall is declared T after the rank's last step), check every 0.25 s, dumps 0.5 s,
           SIGTERM grace 1 s; `--ours torchrun` or `--ours hooks` for the plain or unwarmed agent
    NVRx   ft_launcher (nvidia-resiliency-ext, installed on first use into build/nvrx: bench/nvrx.py)
           with rank_heartbeat_timeout=T, workload_check_interval=0.25 (its default is 5 s: the
           same cadence as ours, not its default), initial_rank_heartbeat_timeout=60 (start-up),
           --workers-stop-timeout 1 (SIGTERM -> SIGKILL when it stops the group: ours' grace; its
           default, 30 s, is what a frozen rank costs it otherwise, since every rank whose heartbeat
           stopped times out together, the healthy ones blocked in the collective first as often
           as not, and the frozen rank then goes in the group's stop)

Both: the same c10d rendezvous on this machine (harness/cluster.py; --standalone's store on one
node), torchrun's monitor interval (0.1 s), --max-restarts 3. Measured from the script's own
records: hang (just before the SIGSTOP) -> killed (the frozen rank's process gone, polled every
10 ms) and hang -> training again (every rank of the job past its first step after the hang).
Target: hang -> training again <= 0.7 x NVRx's, medians, on one node and on three. Printed too:
kill -> training again (the restart alone), and, where the target is missed, the lowest ratio the
timeout allows: with both killing at the timeout, even a restart of 0 s leaves ours at T / NVRx's.
`--nvrx-interval 5` runs NVRx at its own default cadence (a hang noticed up to 5 s after its timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench import nvrx, scratch
from harness.cluster import AGENTS, Cluster, ClusterSpec, NodeSpec
from harness.job import SidecarSpec

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "cycles" / "train_race.py"
HANG_STEP = 20
CHECK_SECONDS = 0.25  # ours: watchdog.check_interval_seconds (harness/job.py); NVRx: workload_check_interval
GRACE_SECONDS = 1.0  # ours: remediation.grace_seconds; NVRx: --workers-stop-timeout (SIGTERM -> SIGKILL)
JOB_TIMEOUT = 240.0
TARGET = 0.7


@dataclass
class Run:
    contender: str
    layout: str
    killed: float | None = None  # hang -> the frozen rank's process gone
    again: float | None = None  # hang -> every rank trained a step after it
    finished: bool = False
    load: float = 0.0  # 1-minute load average when it started

    def line(self) -> str:
        k = f"{self.killed:6.2f} s" if self.killed is not None else "     - "
        a = f"{self.again:6.2f} s" if self.again is not None else "     - "
        done = "finished" if self.finished else "DID NOT FINISH"
        after = f"{self.again - self.killed:5.2f} s" if self.again is not None and self.killed is not None else "    - "
        return (
            f"  {self.contender:<5} {self.layout:<11} killed {k}  training again {a}  (after the kill {after})  "
            f"{done}  (load {self.load:.2f})"
        )


def spec_for(
    contender: str, layout: list[int], timeout: float, ours: str, nvrx_path: str | None, interval: float = CHECK_SECONDS
) -> ClusterSpec:
    hung = len(layout) // 2
    nodes = []
    for i, nproc in enumerate(layout):
        env = {"CYCLE_HANGS": "1", "CYCLE_HANG_LOCAL_RANK": str(nproc - 1)} if i == hung else {}
        nodes.append(NodeSpec(f"node-{i}", nproc, env))
    env = {"CYCLE_HANG_STEP": str(HANG_STEP), "CYCLE_HANG_MODE": "stop"}
    if contender == "ours":
        launcher, args = AGENTS[ours]
        sidecar = SidecarSpec(
            floor_seconds=timeout,
            dump_wait_seconds=0.5,
            grace_seconds=GRACE_SECONDS,
            extra=[
                "remediation.max_per_window=1000",
                "remediation.max_per_window_node=1000",
                "hooks_flush_interval_seconds=0.25",
            ],  # fmt: skip
        )
        return ClusterSpec(nodes, script=SCRIPT, job_id="race", sidecar=sidecar, env=env, launcher=launcher,
                           agent_args=args)  # fmt: skip
    assert nvrx_path is not None
    args = [
        f"--ft-param-rank_heartbeat_timeout={timeout}",
        "--ft-param-initial_rank_heartbeat_timeout=60",
        f"--ft-param-workload_check_interval={interval}",
        f"--workers-stop-timeout={GRACE_SECONDS}",
    ]
    return ClusterSpec(nodes, script=SCRIPT, job_id="race", env=env, launcher=nvrx.MODULE, agent_args=args,
                       with_sidecars=False, pythonpath=[nvrx_path])  # fmt: skip


def records(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


class KillWatch(threading.Thread):
    """Finds the hang record, then polls its process until it is gone (or a zombie: killed, not yet
    reaped by its agent)."""

    def __init__(self, log: Path):
        super().__init__(daemon=True)
        self.log = log
        self.killed_at: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        pid = None
        while not self.stop.is_set():
            if pid is None:
                hang = next((r for r in records(self.log) if r["kind"] == "hang"), None)
                pid = hang.get("pid") if hang else None
                self.stop.wait(0.05)
                continue
            try:
                gone = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                self.killed_at = time.time()
                return
            self.stop.wait(0.01)


def run_one(spec: ClusterSpec, workdir: Path, contender: str, layout: list[int]) -> Run:
    log = workdir / "cycle.jsonl"
    spec.env = {**spec.env, "CYCLE_LOG": str(log)}
    result = Run(contender, "+".join(map(str, layout)) + " rank" + ("s" if sum(layout) > 1 else ""))
    result.load = os.getloadavg()[0]
    result.finished, killed_at = watched(spec, workdir, log, JOB_TIMEOUT)
    recs = records(log)
    hang = next((r for r in recs if r["kind"] == "hang"), None)
    if hang is None:
        return result
    if killed_at is not None:
        result.killed = killed_at - hang["time"]
    result.again = training_again(recs, hang["time"], sum(layout))
    return result


def watched(spec: ClusterSpec, workdir: Path, log: Path, timeout: float) -> tuple[bool, float | None]:
    """Run the cluster until its agents end (at most `timeout`), watching for the hung rank's
    process to go: (every agent exited 0, when the hung process went)."""
    watch = KillWatch(log)
    with Cluster(spec, workdir) as cluster:
        watch.start()
        codes = cluster.wait_agents(timeout)
        watch.stop.set()
        watch.join(5)
    return all(c == 0 for c in codes), watch.killed_at


def training_again(recs: list[dict], hang_time: float, world: int) -> float | None:
    """Hang -> every rank of the job past its first step after it (None: not all came back)."""
    firsts: dict[int, float] = {}
    for r in recs:
        if r["kind"] == "first_step" and r["time"] > hang_time:
            firsts.setdefault(r["rank"], r["time"])
    return max(firsts.values()) - hang_time if len(firsts) == world else None


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summary(runs: list[Run], layouts: list[list[int]]) -> bool:
    """Medians per layout and the ratio; True when every layout met the target."""
    met = True
    print("\nmedians (hang -> killed | hang -> training again), ours / NVRx:")
    for layout in layouts:
        label = "+".join(map(str, layout))
        mine = [r for r in runs if r.contender == "ours" and r.layout.startswith(label + " ")]
        theirs = [r for r in runs if r.contender == "NVRx" and r.layout.startswith(label + " ")]
        mk, ma = median([r.killed for r in mine]), median([r.again for r in mine])
        tk, ta = median([r.killed for r in theirs]), median([r.again for r in theirs])
        ms = median([r.again - r.killed for r in mine if r.again is not None and r.killed is not None])
        ts = median([r.again - r.killed for r in theirs if r.again is not None and r.killed is not None])
        if None in (mk, ma, tk, ta):
            print(f"  {label:<8} not enough runs that came back to compare")
            met = False
            continue
        assert mk is not None and ma is not None and tk is not None and ta is not None
        ratio = ma / ta
        ok = ratio <= TARGET
        met = met and ok
        nodes = f"{len(layout)} node" + ("s" if len(layout) > 1 else "")
        print(
            f"  {nodes:<8} ({label} ranks, {len(mine)}+{len(theirs)} runs): killed {mk:.2f} | {tk:.2f} s "
            f"(x{mk / tk:.2f}), training again {ma:.2f} | {ta:.2f} s (x{ratio:.2f}; target <= {TARGET}: "
            f"{'PASS' if ok else 'FAIL'})"
        )
        if ms is not None and ts is not None:
            print(f"  {'':<8} after the kill: {ms:.2f} | {ts:.2f} s (x{ms / ts:.2f})")
        if not ok:
            # our kill comes at the timeout: even a restart of 0 s leaves the ratio at killed / theirs
            print(f"  {'':<8} (ours killed at the timeout, the ratio cannot go below {mk / ta:.2f} at this timeout)")
    return met


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_race", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, help="runs of each contender on each layout (default 5; --field: 3)")
    p.add_argument("--layouts", default="2;1,1,1", help="ranks per node, layouts split by ';' (default: 2;1,1,1)")
    p.add_argument("--timeout", type=float, default=5.0, help="the effective timeout T of both (default 5 s)")
    p.add_argument("--ours", choices=sorted(AGENTS), default="warm", help="our agent (default warm)")
    p.add_argument("--nvrx-interval", type=float, default=CHECK_SECONDS,
                   help=f"NVRx's workload_check_interval (default {CHECK_SECONDS}, ours; its own is 5)")  # fmt: skip
    p.add_argument("--field", action="store_true",
                   help="the race at equal safety: a job with a real job's pauses under ours (shipped, lowest "
                        "floor) and NVRx (heartbeat, sections); bench/race_field.py (default 3 runs)")  # fmt: skip
    p.add_argument("--settings", default="abcd", help="--field: which settings run (default abcd)")
    p.add_argument("--floor", type=float, help="--field: ours' lowered floor (default: found by pauses-only runs)")
    p.add_argument("--keep", action="store_true", help="keep the working directory")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.field:
        from bench import race_field

        layouts = [[int(x) for x in part.split(",")] for part in args.layouts.split(";")]
        return race_field.main(args.runs or 3, layouts, args.floor, args.keep, args.settings)
    path = nvrx.ensure()
    if path is None:
        print("bench_race: NVRx is not available; nothing to race (FAIL)")
        return 1
    layouts = [[int(x) for x in part.split(",")] for part in args.layouts.split(";")]
    root = scratch.make("bench-race-")
    ours = " ".join([AGENTS[args.ours][0], *AGENTS[args.ours][1]])
    print(f"timeout {args.timeout:g} s each; ours: {ours} + sidecar, check every {CHECK_SECONDS:g} s; "
          f"NVRx {nvrx.VERSION} from {path}, check every {args.nvrx_interval:g} s; "
          f"{args.runs or 5} interleaved runs per layout; {os.cpu_count()} CPUs")  # fmt: skip
    runs: list[Run] = []
    try:
        for i in range(args.runs or 5):
            for layout in layouts:
                order = ("ours", "NVRx") if i % 2 == 0 else ("NVRx", "ours")  # neither always goes first
                for contender in order:
                    spec = spec_for(contender.lower() if contender == "ours" else "nvrx", layout, args.timeout,
                                    args.ours, path, args.nvrx_interval)  # fmt: skip
                    work = root / f"{i}-{'_'.join(map(str, layout))}-{contender}"
                    runs.append(run_one(spec, work, contender, layout))
                    print(runs[-1].line(), flush=True)
    except KeyboardInterrupt:
        return 130
    finally:
        scratch.leave(root, args.keep)
    met = summary(runs, layouts)
    finished = all(r.finished for r in runs)
    if not finished:
        print("some runs did not finish: see --keep")
    return 0 if met and finished else 1


if __name__ == "__main__":
    raise SystemExit(main())
