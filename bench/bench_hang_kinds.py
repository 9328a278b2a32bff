"""The kinds of hang (sidecar/hang_kinds.py), judged from the backend's own record (the Flight
Recorder) and from the Python stacks alone, on three simulated nodes (1, 2, 1 ranks; harness/cluster.py)
or on one node of 4 ranks (`--nodes 1`), running the user's own gloo loop with the hooks
(bench/cycles/train_faults.py):

    python -m bench.bench_hang_kinds                       # every fault, records on and off, 1 run each
    python -m bench.bench_hang_kinds --runs 3 --fault async-stop --evidence collectives
    python -m bench.bench_hang_kinds --nodes 1 --evidence collectives

Faults: `sync-stop` (a rank SIGSTOPs itself between two blocking all-reduces), `async-stop` (the
same with the all-reduce launched async and waited in the user's own function, as a CUDA job
waits), `spin` (a Python busy loop outside any collective), `desync` (a barrier where its peers
all-reduce), `tp-stop` (2 x 2 data x tensor parallel groups, one rank SIGSTOPped), `link-cut`
(each node a host of its own, harness/cluster.py `netns`; node-1's training link cut after 20 steps
and restored once every node has its verdict: no rank to blame, `collective_stuck`), `healthy` (no
fault: the 2x2 job trains about a minute; right when no node records a stall), `evaluate` (no fault:
every rank evaluates 12 s inside torch ops, outside any collective; right when every stall recorded is
`job_paused`, nothing is signalled and nothing restarts), `dataloader` (the rank's DataLoader worker
SIGSTOPped: `dataloader_stuck`), `crash` (the rank raises while its peers wait: every exit record names
it, `rank_crashed`), `deadlock` (its main thread and another take two locks in opposite orders:
`rank_deadlocked`). `--evidence
stacks` runs the same with SIDECAR_COLLECTIVES=0 in the ranks: no record, the stack rule alone.

Printed per run and node: the verdict (kind, evidence, blamed rank), the time from the hang to the
verdict on that node, whether it sent SIGTERM, and the job's hang -> training again. A run is
right when every node names the same culprit (the hung rank; a desync: the odd rank out, kind
collective_mismatch) with the fault's kind under one job incident; the summary counts right runs,
false kills (a SIGTERM where the table says nobody or another node acts) and times per fault.
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
from harness import netns
from harness.cluster import Cluster, ClusterSpec, NodeSpec
from harness.job import SidecarSpec, wait_for

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
    "evaluate": ("async", "evaluate", ""),  # no fault: every rank pauses 12 s in torch ops; right = job_paused
    "dataloader": ("async", "dataloader", "1"),
    "crash": ("async", "crash", "1"),
    "deadlock": ("async", "deadlock", "1"),
}
# The kinds a right verdict may have, per fault and evidence (the record says who is late; the rank's
# process, read by its node, says why where it can: stopped, a DataLoader that cannot deliver).
KINDS = {
    "sync-stop": {"rank_stopped", "rank_late"}, "async-stop": {"rank_stopped", "rank_late"},
    "tp-stop": {"rank_stopped", "rank_late"}, "spin": {"rank_late", "rank_spinning"},
    "desync": {"collective_mismatch"}, "link-cut": {"collective_stuck"}, "evaluate": {"job_paused"},
    "dataloader": {"dataloader_stuck"}, "crash": {"rank_crashed"}, "deadlock": {"rank_deadlocked"},
}  # fmt: skip


@dataclass
class Run:
    fault: str
    evidence: str
    finished: bool = False
    nodes_n: int = 3
    hung_rank: int | None = None
    recover: float | None = None  # hang -> first step after it, any rank
    attempts: int = 1
    nodes: list[dict] = field(default_factory=list)

    @property
    def hung_node(self) -> str:
        return "node-1" if self.nodes_n == 3 else "node-0"

    @property
    def false_kills(self) -> int:
        """SIGTERMs where the table says nobody acts (a pause) or another node does (a named culprit)."""
        if self.fault in ("healthy", "evaluate"):
            return sum(n["sigterm"] for n in self.nodes)
        if self.fault in ("desync", "link-cut", "crash"):
            return 0  # every node acts on its own ranks (a crash: torchrun's restart, no SIGTERM expected)
        return sum(n["sigterm"] for n in self.nodes if n["node"] != self.hung_node)

    @property
    def right(self) -> bool:
        if self.fault == "healthy":
            return self.finished and not self.nodes
        if self.fault == "evaluate":
            return self.finished and self.attempts == 1 and all(n["kind"] == "job_paused" for n in self.nodes)
        if (
            len(self.nodes) != self.nodes_n
            or len({n["job_incident"] for n in self.nodes}) != 1
            or not self.nodes[0]["job_incident"]
        ):
            return False
        if any(n["kind"] not in KINDS[self.fault] for n in self.nodes) or self.false_kills:
            return False
        if self.fault == "link-cut":
            return all(n["blamed_rank"] is None for n in self.nodes)
        return all(n["blamed_rank"] == self.hung_rank and n["blamed_node"] == self.hung_node for n in self.nodes)


def spec(fault: str, evidence: str, log: Path, extra: list[str], nodes_n: int = 3) -> ClusterSpec:
    shape, mode, local = FAULTS[fault]
    hang = {"CYCLE_HANGS": "1", "CYCLE_HANG_LOCAL_RANK": local, "CYCLE_HANG_MODE": mode} if local else {}
    if fault == "evaluate":
        hang = {"CYCLE_HANGS": "1", "CYCLE_HANG_MODE": mode, "CYCLE_WORK_SECONDS": "12"}  # every rank pauses
    other = dict(hang) if fault == "evaluate" else {}  # the pause is every rank's; a fault only node-1's
    if nodes_n == 3:
        nodes = [NodeSpec("node-0", 1, dict(other)), NodeSpec("node-1", 2, hang), NodeSpec("node-2", 1, dict(other))]
    else:
        nodes = [NodeSpec("node-0", 4, hang)]
    # a crash mid-training, once every node has learned the job's coordinator (its hooks take a few seconds)
    steps = HEALTHY_STEPS if fault == "healthy" else HANG_STEP * 8 if fault == "crash" else HANG_STEP
    env = {"CYCLE_HANG_STEP": str(steps), "CYCLE_LOG": str(log), "FAULT_SHAPE": shape}
    if evidence == "stacks":
        env["SIDECAR_COLLECTIVES"] = "0"
    sidecar = SidecarSpec(floor_seconds=FLOOR_SECONDS, grace_seconds=GRACE_SECONDS, extra=list(extra))
    return ClusterSpec(nodes, script=ROOT / "bench" / "cycles" / "train_faults.py", job_id="kinds",
                       sidecar=sidecar, env=env, netns=fault == "link-cut")  # fmt: skip


def run(fault: str, evidence: str, workdir: Path, extra: list[str], nodes_n: int = 3) -> Run:
    log = workdir / "cycle.jsonl"
    out = Run(fault, evidence, nodes_n=nodes_n)
    with Cluster(spec(fault, evidence, log, extra, nodes_n), workdir) as cluster:
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
        out.attempts = len({r["attempt"] for r in records if r["kind"] == "first_step"}) or 1
        if hang is not None:
            out.hung_rank = hang["rank"]
            after = [r["time"] for r in records if r["kind"] == "first_step" and r["time"] > hang["time"]]
            out.recover = min(after) - hang["time"] if after else None
        for node in cluster.nodes:
            for r in node.incidents(kind="exit" if fault == "crash" else "stall"):
                if fault == "crash":  # the first exit of the node's record: the cause, or its consequence
                    first = r["exits"][0]
                    cause = first.get("consequence_of") or f"rank {first['rank']} on {node.spec.name}"
                    rank_s, node_s = cause.removeprefix("rank ").split(" on ")
                    out.nodes.append({
                        "node": node.spec.name, "kind": "rank_crashed", "evidence": "exits", "blamed_rank": int(rank_s),
                        "blamed_node": node_s, "job_incident": r.get("job_incident") or first.get("job_incident"),
                        "outcome": first.get("reason"), "to_verdict": None, "sigterm": False, "to_kill": None,
                        "reason": r["summary"],
                    })  # fmt: skip
                    continue
                event: dict = next((e for e in r.get("timeline", []) if e["event"] == "verdict"), {})
                verdict = event.get("decided") or event.get("time")  # when the job's coordinator decided
                out.nodes.append({
                    "node": node.spec.name, "kind": r.get("hang_kind"), "evidence": r.get("evidence"),
                    "blamed_rank": r.get("blamed_rank"), "blamed_node": r.get("blamed_node"),
                    "job_incident": r.get("job_incident"), "outcome": r.get("outcome"),
                    "to_verdict": verdict - hang["time"] if verdict is not None and hang is not None else None,
                    "sigterm": any(e["event"] == "sigterm" and e.get("ranks") for e in r.get("timeline", [])),
                    "to_kill": next((e["time"] - hang["time"] for e in r.get("timeline", [])
                                     if e["event"] == "sigterm" and e.get("ranks") and hang is not None), None),
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
    p.add_argument("--nodes", type=int, choices=(1, 3), default=3, help="3 simulated nodes (1+2+1 ranks) or 1 of 4")
    p.add_argument("--keep", action="store_true", help="keep the working directory")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra sidecar setting")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    root = scratch.make("bench-hang-kinds-")
    runs: list[Run] = []
    try:
        for fault in args.fault or list(FAULTS):
            if fault == "link-cut" and (netns.available() is not None or args.nodes == 1):
                print(f"link-cut: skipped ({netns.available() or 'needs several nodes'})")
                continue
            for evidence in args.evidence or ["collectives", "stacks"]:
                for i in range(args.runs):
                    runs.append(run(fault, evidence, root / f"{fault}-{evidence}-{i}", args.set, args.nodes))
                    show(runs[-1])
    except KeyboardInterrupt:
        return 130
    finally:
        scratch.leave(root, args.keep)
    print(f"\n{args.nodes} node(s)")
    print(
        "fault        evidence     right  false kills  hang -> verdict (median, every node)  hang -> kill  "
        "hang -> training again"
    )
    for fault in args.fault or list(FAULTS):
        for evidence in args.evidence or ["collectives", "stacks"]:
            mine = [r for r in runs if (r.fault, r.evidence) == (fault, evidence)]
            if not mine:
                continue
            verdicts = [n["to_verdict"] for r in mine for n in r.nodes if n["to_verdict"] is not None]
            recovers = [r.recover for r in mine if r.recover is not None]
            v = f"{statistics.median(verdicts):.2f} s (max {max(verdicts):.2f})" if verdicts else "-"
            t = f"{statistics.median(recovers):.2f} s" if recovers else "-"
            kills = sum(r.false_kills for r in mine)
            killed = [n["to_kill"] for r in mine for n in r.nodes if n["to_kill"] is not None]
            k = f"{statistics.median(killed):.2f} s" if killed else "-"
            right = f"{sum(r.right for r in mine)}/{len(mine)}"
            print(f"{fault:<12} {evidence:<12} {right:<6} {kills:<12} {v:<37} {k:<13} {t}")
    wanted = [r for r in runs if r.evidence == "collectives"]
    return 0 if all(r.right and r.finished for r in wanted) else 1


if __name__ == "__main__":
    raise SystemExit(main())
