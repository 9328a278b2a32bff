"""The kinds of hang, judged from the backend's own record (the Flight Recorder) and from the
Python stacks alone, on three simulated nodes (1, 2, 1 ranks; demo/cluster.py) running the user's
own gloo loop with the hooks (bench/cycles/train_faults.py):

    python -m bench.bench_hang_kinds                       # every fault, records on and off, 1 run each
    python -m bench.bench_hang_kinds --runs 3 --fault async-stop --evidence collectives

Faults: `sync-stop` (a rank SIGSTOPs itself between two blocking all-reduces), `async-stop` (the
same with the all-reduce launched async and waited in the user's own function, as a CUDA job
waits), `spin` (a Python busy loop outside any collective), `desync` (a barrier where its peers
all-reduce), `tp-stop` (2 x 2 data x tensor parallel groups, one rank SIGSTOPped), `link-cut`
(each node a host of its own, demo/cluster.py `netns`; node-1's training link cut after 20 steps
and restored once every node has its verdict: no rank to blame, `collective_stuck`), `healthy` (no
fault: the 2x2 job trains about a minute; right when no node records a stall). `--evidence
stacks` runs the same with SIDECAR_COLLECTIVES=0 in the ranks: no record, the stack rule alone.

Printed per run and node: the verdict (kind, evidence, blamed rank), the time from the hang to the
verdict on that node, whether it sent SIGTERM, and the job's hang -> training again. A run is
right when every node names the same culprit (the hung rank; a desync: no rank, kind
collective_mismatch) under one job incident; the summary counts right runs per fault and evidence.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import scratch
from demo import netns
from demo.cluster import Cluster, ClusterSpec, NodeSpec
from demo.job import SidecarSpec, wait_for

ROOT = Path(__file__).resolve().parent.parent
FLOOR_SECONDS = 5.0
GRACE_SECONDS = 5.0
HANG_STEP = 20
JOB_TIMEOUT = 240.0
HEALTHY_STEPS = 1200  # a healthy job of about a minute (0.05 s a step): judged as often as a hung one
FAULTS = {  # name -> (FAULT_SHAPE, CYCLE_HANG_MODE, the hanging node's local rank)
    "sync-stop": ("sync", "stop", "1"),
    "async-stop": ("async", "stop", "1"),
    "spin": ("sync", "spin", "1"),
    "desync": ("sync", "desync", "1"),
    "tp-stop": ("tp", "stop", "0"),
    "link-cut": ("sync", "none", ""),  # every node its own network namespace; node-1's training link cut
    "healthy": ("tp", "none", ""),  # no fault: 2x2 groups, HEALTHY_STEPS steps; right = no stall anywhere
}


@dataclass
class Run:
    fault: str
    evidence: str
    finished: bool = False
    hung_rank: int | None = None
    recover: float | None = None  # hang -> first step after it, any rank
    nodes: list[dict] = field(default_factory=list)

    @property
    def right(self) -> bool:
        if self.fault == "healthy":
            return self.finished and not self.nodes
        if (
            len(self.nodes) != 3
            or len({n["job_incident"] for n in self.nodes}) != 1
            or not self.nodes[0]["job_incident"]
        ):
            return False
        if self.fault == "desync":
            return all(n["kind"] == "collective_mismatch" and n["blamed_rank"] is None for n in self.nodes)
        if self.fault == "link-cut":
            return all(n["kind"] == "collective_stuck" and n["blamed_rank"] is None for n in self.nodes)
        return all(n["blamed_rank"] == self.hung_rank and n["blamed_node"] == "node-1" for n in self.nodes)


def spec(fault: str, evidence: str, log: Path, extra: list[str]) -> ClusterSpec:
    shape, mode, local = FAULTS[fault]
    hang = {"CYCLE_HANGS": "1", "CYCLE_HANG_LOCAL_RANK": local, "CYCLE_HANG_MODE": mode} if local else {}
    nodes = [NodeSpec("node-0", 1), NodeSpec("node-1", 2, hang), NodeSpec("node-2", 1)]
    steps = HEALTHY_STEPS if fault == "healthy" else HANG_STEP
    env = {"CYCLE_HANG_STEP": str(steps), "CYCLE_LOG": str(log), "FAULT_SHAPE": shape}
    if evidence == "stacks":
        env["SIDECAR_COLLECTIVES"] = "0"
    sidecar = SidecarSpec(floor_seconds=FLOOR_SECONDS, grace_seconds=GRACE_SECONDS, extra=list(extra))
    return ClusterSpec(nodes, script=ROOT / "bench" / "cycles" / "train_faults.py", job_id="kinds",
                       sidecar=sidecar, env=env, netns=fault == "link-cut")  # fmt: skip


def run(fault: str, evidence: str, workdir: Path, extra: list[str]) -> Run:
    log = workdir / "cycle.jsonl"
    out = Run(fault, evidence)
    with Cluster(spec(fault, evidence, log, extra), workdir) as cluster:
        cut: dict | None = None
        if fault == "link-cut":
            cluster.wait_steps(HANG_STEP, JOB_TIMEOUT)
            cut = {"kind": "hang", "rank": None, "time": time.time()}
            cluster.cut_link("node-1")
            wait_for(lambda: all(_judged(n) for n in cluster.nodes), 120)
            cluster.restore_link("node-1")
        codes = cluster.wait_agents(JOB_TIMEOUT)
        out.finished = all(c == 0 for c in codes)
        time.sleep(1.0)  # the last incident writes
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        hang = cut or next((r for r in records if r["kind"] == "hang"), None)
        if hang is not None:
            out.hung_rank = hang["rank"]
            after = [r["time"] for r in records if r["kind"] == "first_step" and r["time"] > hang["time"]]
            out.recover = min(after) - hang["time"] if after else None
        for node in cluster.nodes:
            for r in node.incidents():
                event: dict = next((e for e in r.get("timeline", []) if e["event"] == "verdict"), {})
                verdict = event.get("decided") or event.get("time")  # when the job's coordinator decided
                out.nodes.append({
                    "node": node.spec.name, "kind": r.get("hang_kind"), "evidence": r.get("evidence"),
                    "blamed_rank": r.get("blamed_rank"), "blamed_node": r.get("blamed_node"),
                    "job_incident": r.get("job_incident"), "outcome": r.get("outcome"),
                    "to_verdict": verdict - hang["time"] if verdict is not None and hang is not None else None,
                    "sigterm": any(e["event"] == "sigterm" and e.get("ranks") for e in r.get("timeline", [])),
                    "reason": r.get("blame_reason"),
                })  # fmt: skip
    return out


def _judged(node) -> bool:
    return any(any(e["event"] == "verdict" for e in r.get("timeline", [])) for r in node.incidents())


def show(r: Run) -> None:
    recover = f"{r.recover:.2f} s" if r.recover is not None else "-"
    state = "finished" if r.finished else "DID NOT FINISH"
    print(f"{r.fault} / {r.evidence}: hung rank {r.hung_rank}; {state}; hang -> training again {recover}; "
          f"{'RIGHT' if r.right else 'WRONG'}", flush=True)  # fmt: skip
    for n in r.nodes:
        blamed = "no rank" if n["blamed_rank"] is None else f"rank {n['blamed_rank']} on {n['blamed_node']}"
        took = f"{n['to_verdict']:.2f} s" if n["to_verdict"] is not None else "no verdict"
        print(f"  {n['node']:<7} {str(n['kind']):<20} {str(n['evidence']):<12} {blamed:<18} hang -> verdict {took:<11}"
              f" {n['outcome']}{', SIGTERM' if n['sigterm'] else ''}")  # fmt: skip
    if r.nodes and not r.right:
        print(f"          {r.nodes[0]['reason']}")
    if not r.nodes:
        print("  no stall incident on any node")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_hang_kinds", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1, help="runs of each fault and evidence (default 1)")
    p.add_argument("--fault", action="append", choices=sorted(FAULTS), help="only these faults (default all)")
    p.add_argument("--evidence", action="append", choices=("collectives", "stacks"), help="default both")
    p.add_argument("--keep", action="store_true", help="keep the working directory")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra sidecar setting")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    root = scratch.make("bench-hang-kinds-")
    runs: list[Run] = []
    try:
        for fault in args.fault or list(FAULTS):
            if fault == "link-cut" and netns.available() is not None:
                print(f"link-cut: skipped ({netns.available()})")
                continue
            for evidence in args.evidence or ["collectives", "stacks"]:
                for i in range(args.runs):
                    runs.append(run(fault, evidence, root / f"{fault}-{evidence}-{i}", args.set))
                    show(runs[-1])
    except KeyboardInterrupt:
        return 130
    finally:
        scratch.leave(root, args.keep)
    print("\nfault        evidence     right  hang -> verdict (median, every node)  hang -> training again (median)")
    for fault in args.fault or list(FAULTS):
        for evidence in args.evidence or ["collectives", "stacks"]:
            mine = [r for r in runs if (r.fault, r.evidence) == (fault, evidence)]
            if not mine:
                continue
            verdicts = [n["to_verdict"] for r in mine for n in r.nodes if n["to_verdict"] is not None]
            recovers = [r.recover for r in mine if r.recover is not None]
            v = f"{statistics.median(verdicts):.2f} s (max {max(verdicts):.2f})" if verdicts else "-"
            t = f"{statistics.median(recovers):.2f} s" if recovers else "-"
            print(f"{fault:<12} {evidence:<12} {sum(r.right for r in mine)}/{len(mine):<4} {v:<37} {t}")
    wanted = [r for r in runs if r.evidence == "collectives"]
    return 0 if all(r.right and r.finished for r in wanted) else 1


if __name__ == "__main__":
    raise SystemExit(main())
