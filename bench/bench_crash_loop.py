"""A crash loop ended on purpose (job_view.crash_loop_repeats) against the same job left to
torchrun's restarts: three simulated nodes of one rank each (harness/cluster.py), rank 1 raises at the
same step of every attempt (bench/cycles/train_faults.py `crash`), --max-restarts 5, the agents
`python -m trainer_hooks.launch`.

    python -m bench.bench_crash_loop                 # crash_loop_repeats 2 (the default) and 0 (off)
    python -m bench.bench_crash_loop --repeats 1 2 0

Printed per setting: the attempts that met the crash, the agents' exit codes, the time from the
first crash to the last agent's exit, and the restarts spent. NVRx's launchers end a job after 3
cycles without progress (exit 93): the default here ends it at the third meeting of the same
verdict at the same step, with the same code.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench import scratch
from harness.cluster import Cluster, ClusterSpec, NodeSpec
from harness.job import SidecarSpec

ROOT = Path(__file__).resolve().parent.parent
MAX_RESTARTS = 5
CRASH_STEP = 150  # mid-training: every node has learned the job's coordinator
JOB_TIMEOUT = 600.0


def spec(log: Path, repeats: int) -> ClusterSpec:
    nodes = [NodeSpec(f"node-{i}", 1, {"CYCLE_HANG_LOCAL_RANK": "0" if i == 1 else "-1"}) for i in range(3)]
    env = {"FAULT_SHAPE": "async", "CYCLE_HANG_MODE": "crash", "CYCLE_HANGS": str(MAX_RESTARTS + 1),
           "CYCLE_HANG_STEP": str(CRASH_STEP), "CYCLE_LOG": str(log)}  # fmt: skip
    sidecar = SidecarSpec(floor_seconds=5.0, grace_seconds=5.0, extra=[f"job_view.crash_loop_repeats={repeats}"])
    return ClusterSpec(nodes, script=ROOT / "bench" / "cycles" / "train_faults.py", job_id="loop",
                       max_restarts=MAX_RESTARTS, sidecar=sidecar, env=env,
                       launcher="trainer_hooks.launch")  # fmt: skip


def run(repeats: int, workdir: Path) -> dict:
    log = workdir / "cycle.jsonl"
    with Cluster(spec(log, repeats), workdir) as cluster:
        codes = cluster.wait_agents(JOB_TIMEOUT)
        ended = time.time()
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    crashes = [r for r in records if r["kind"] == "hang"]
    attempts = sorted({r["attempt"] for r in records if r["kind"] == "first_step"})
    return {
        "repeats": repeats,
        "crashed_in": sorted({r["attempt"] for r in crashes}),
        "attempts": len(attempts),
        "codes": codes,
        "first_crash_to_end": ended - crashes[0]["time"] if crashes else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, nargs="+", default=[2, 0], help="crash_loop_repeats settings to run")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = p.parse_args()
    root = scratch.make("bench-crash-loop")
    results = []
    try:
        for repeats in args.repeats:
            print(f"crash_loop_repeats {repeats}: running ...", flush=True)
            results.append(run(repeats, root / f"repeats-{repeats}"))
    finally:
        scratch.leave(root, args.keep)
    print(f"\n3 nodes, rank 1 raises at step {CRASH_STEP} of every attempt, --max-restarts {MAX_RESTARTS}")
    print(f"{'crash_loop_repeats':<20}{'attempts':>9}{'crashes':>9}{'restarts':>10}  {'agents exit':<14}"
          f"{'first crash -> job ended':>26}")  # fmt: skip
    for r in results:
        took = f"{r['first_crash_to_end']:.1f} s" if r["first_crash_to_end"] is not None else "-"
        codes = ",".join(str(c) for c in r["codes"])
        print(f"{r['repeats']:<20}{r['attempts']:>9}{len(r['crashed_in']):>9}{max(0, r['attempts'] - 1):>10}  "
              f"{codes:<14}{took:>26}")  # fmt: skip
    on, off = (next((r for r in results if r["repeats"] == n), None) for n in (2, 0))
    if on and off and on["first_crash_to_end"] and off["first_crash_to_end"]:
        saved = off["first_crash_to_end"] - on["first_crash_to_end"]
        print(
            f"\nended {saved:.1f} s sooner ({on['first_crash_to_end'] / off['first_crash_to_end']:.2f}x the time), "
            f"{off['attempts'] - on['attempts']} fewer attempts, exit {on['codes'][0]} instead of {off['codes'][0]}"
        )


if __name__ == "__main__":
    main()
