"""The job seen across nodes: a hang on one node of a multi-node job, and what each node's
sidecar records and does about it, next to the same script on one node.

    python -m bench.bench_jobview                 # 3 nodes (1, 2, 1 ranks) vs 1 node of 4 ranks, SIGSTOP
    python -m bench.bench_jobview --mode spin     # the hung rank spins in a Python loop instead
    python -m bench.bench_jobview --runs 3        # more runs of each

Each run: sidecars and torchrun agents in one c10d rendezvous (harness/cluster.py), the user's
own gloo loop with the hooks (bench/cycles/train_plain.py), floor 5 s, grace 5 s; after 20 steps
local rank 1 of the middle node hangs (on one node: local rank 1). Printed per run: each node's
record (blamed rank and node, outcome, job incident), hang -> training again (the first step
after the hang, any rank), and each node's recovery stages side by side, as `sidecar incidents
--job` shows them from the job incident's story (sidecar/commands/recovery_table.py).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import scratch
from harness.cluster import AGENTS, Cluster, ClusterSpec, NodeSpec
from harness.job import SidecarSpec
from sidecar.commands.recovery_table import recovery_table

FLOOR_SECONDS = 5.0
GRACE_SECONDS = 5.0
HANG_STEP = 20
JOB_TIMEOUT = 240.0
# the agents: torchrun, or torchrun whose agent re-forms a multi-node job faster (harness/cluster.py)
LAUNCHERS = {name: AGENTS[name][0] for name in ("torchrun", "hooks")}


@dataclass
class Outcome:
    label: str
    finished: bool
    recover: float | None = None  # hang -> first step after it
    records: list[dict] = field(default_factory=list)  # (node, record) summaries
    story: dict | None = None  # the job incident's story, each node's recovery stages in it
    filled: list[str] = field(default_factory=list)  # nodes whose stages came from their own record


def cluster_spec(
    layout: list[int],
    mode: str,
    sidecar_extra: list[str],
    launcher: str = LAUNCHERS["torchrun"],
    monitor_interval: float | None = None,
) -> ClusterSpec:
    hung = len(layout) // 2  # the middle node
    nodes = []
    for i, nproc in enumerate(layout):
        env = {}
        if i == hung:
            env = {"CYCLE_HANGS": "1", "CYCLE_HANG_LOCAL_RANK": str(nproc - 1), "CYCLE_HANG_MODE": mode}
        nodes.append(NodeSpec(f"node-{i}", nproc, env))
    sidecar = SidecarSpec(floor_seconds=FLOOR_SECONDS, grace_seconds=GRACE_SECONDS, extra=list(sidecar_extra))
    env = {"CYCLE_HANG_STEP": str(HANG_STEP)}
    return ClusterSpec(nodes, sidecar=sidecar, env=env, launcher=launcher, monitor_interval=monitor_interval)


def records_of(node) -> list[dict]:
    out = []
    for r in node.incidents(kind=None):
        out.append(
            {
                "node": node.spec.name,
                "kind": r.get("kind", "stall"),
                "blamed_rank": r.get("blamed_rank"),
                "blamed_node": r.get("blamed_node"),
                "job_incident": r.get("job_incident"),
                "outcome": r.get("outcome"),
                "summary": r.get("summary"),
                "sigterm": any(e.get("event") == "sigterm" and e.get("ranks") for e in r.get("timeline", [])),
            }
        )
    return out


def run(spec: ClusterSpec, workdir: Path, label: str) -> Outcome:
    log = workdir / "cycle.jsonl"
    spec.env = {**spec.env, "CYCLE_LOG": str(log)}
    with Cluster(spec, workdir) as cluster:
        codes = cluster.wait_agents(JOB_TIMEOUT)
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        outcome = Outcome(label, all(c == 0 for c in codes))
        hang = next((r["time"] for r in records if r["kind"] == "hang"), None)
        after = [r["time"] for r in records if r["kind"] == "first_step" and hang is not None and r["time"] > hang]
        if hang is not None and after:
            outcome.recover = min(after) - hang
        time.sleep(1.0)  # the last incident writes
        for node in cluster.nodes:
            outcome.records += records_of(node)
        outcome.story, outcome.filled = story_of(cluster)
    return outcome


def story_of(cluster: Cluster) -> tuple[dict | None, list[str]]:
    """The job incident's story as `sidecar incidents --job` reads it (from the coordinator, through
    the first node's sidecar). A node's stages measured after its last report reached the
    coordinator (the job ended first) are taken from its own record, and said so."""
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "incidents", "--job", cluster.spec.job_id, "--json",
         "--socket", cluster.nodes[0].socket],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    try:
        story = json.loads(out.stdout).get("story") if out.returncode == 0 else None
    except ValueError:
        story = None
    if not isinstance(story, dict):
        return None, []
    filled = []
    for node in cluster.nodes:
        part = (story.get("nodes", {}).get(node.spec.name) or {}).get("part")
        mine = [r for r in node.incidents() if r.get("job_incident") == story.get("verdict", {}).get("job_incident")]
        stages = ((mine[-1].get("recovery") or {}).get("stages_seconds") or {}) if mine else {}
        known = sum(v is not None for v in stages.values())
        if part is not None and known > sum(v is not None for v in (part.get("stages") or {}).values()):
            part["stages"] = stages
            filled.append(node.spec.name)
    return story, filled


def show(o: Outcome) -> None:
    state = "finished" if o.finished else "DID NOT FINISH"
    recover = f"{o.recover:.2f} s" if o.recover is not None else "-"
    print(f"{o.label}: {state}, hang -> training again {recover}")
    for r in o.records:
        blamed = f"rank {r['blamed_rank']}" + (f" on {r['blamed_node']}" if r.get("blamed_node") else "")
        sent = ", sent SIGTERM" if r["sigterm"] else ""
        print(f"  {r['node']:<7} {r['kind']:<5} blamed {blamed:<18} job_incident {r['job_incident'] or '-'}{sent}")
        print(f"          {r['summary']}")
    table = recovery_table(o.story)
    if table:
        print("\n".join(table[1:]))
        if o.filled:
            print(f"  (stages of {', '.join(o.filled)} from its own record: measured after its last report)")
    else:
        print("  (no node's recovery stages in the job incident's story)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_jobview", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1, help="runs of each layout (default 1)")
    p.add_argument("--mode", choices=("stop", "spin"), default="stop", help="how the rank hangs (default stop)")
    p.add_argument("--layout", default="1,2,1", help="ranks per node of the multi-node job (default 1,2,1)")
    p.add_argument("--keep", action="store_true", help="keep the working directory")
    p.add_argument("--launcher", choices=sorted(LAUNCHERS), default="torchrun",
                   help="the agents: torchrun, or python -m trainer_hooks.launch (faster re-rendezvous)")  # fmt: skip
    p.add_argument("--monitor-interval", type=float, default=None,
                   help="the agents' --monitor-interval in seconds (default: torchrun's, 0.1)")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra sidecar setting")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    layout = [int(x) for x in args.layout.split(",")]
    root = scratch.make("bench-jobview-")
    multi: list[Outcome] = []
    single: list[Outcome] = []
    try:
        for i in range(args.runs):
            spec = cluster_spec(layout, args.mode, args.set, LAUNCHERS[args.launcher], args.monitor_interval)
            multi.append(run(spec, root / f"multi-{i}", f"{len(layout)} nodes"))
            show(multi[-1])
            spec = cluster_spec([sum(layout)], args.mode, args.set, LAUNCHERS[args.launcher], args.monitor_interval)
            single.append(run(spec, root / f"single-{i}", "1 node"))
            show(single[-1])
    except KeyboardInterrupt:
        return 130
    finally:
        scratch.leave(root, args.keep)
    m = [o.recover for o in multi if o.recover is not None]
    s = [o.recover for o in single if o.recover is not None]
    if m and s:
        print(
            f"hang -> training again, median: {len(layout)} nodes {statistics.median(m):.2f} s, "
            f"1 node {statistics.median(s):.2f} s, difference {statistics.median(m) - statistics.median(s):+.2f} s"
        )
    return 0 if all(o.finished for o in multi + single) else 1


if __name__ == "__main__":
    raise SystemExit(main())
