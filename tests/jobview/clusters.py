"""What the job-view tests on simulated nodes (harness/cluster.py) share: the sidecars' settings, a
cluster's logs for a failed assertion, and the runs several tests judge.

A run of a job is what the tests pay for (each rank a new interpreter importing torch, and again
after the restart); where two tests start the same job with the same fault and
prove different things about it, they take one run (`SharedRuns`): the first to ask starts it and
waits for its end, each test asserts what it proves on it (its sidecars still up: the incidents'
command line reads them), and the last to give it back ends it. The job's story across its nodes is
read when the job ends (`settled_story`): a node forgets a job soon after its last rank went (the
coordinator's sweep), and its story with it, so a test that comes minutes later reads the story
as it was read then."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from harness.cluster import Cluster, ClusterSpec, NodeSpec
from harness.job import SidecarSpec, wait_for
from tests.support import PYTHON

JOB_TIMEOUT = 200.0
HANG_STEP = 12
STAGES = ("detect", "restart", "hang_to_training", "redo")  # of the recovery table, measured on every node


def sidecars() -> SidecarSpec:
    return SidecarSpec(
        floor_seconds=3.0,
        grace_seconds=3.0,
        dump_wait_seconds=1.0,
        extra=["job_view.verdict_wait_seconds=2", "job_view.launcher_grace_seconds=30"],
    )


def node_to_lose(cluster: Cluster) -> str:
    """A node whose loss the job survives: not the coordinator's (rank 0's) nor the rendezvous
    store's host (torchrun cannot re-rendezvous without its store: that loss ends the job)."""
    spared = {n.spec.name for n in cluster.nodes if any(r["rank"] == 0 for r in n.ranks())}
    spared.add(cluster.rendezvous_host() or "")
    return next(n.spec.name for n in reversed(cluster.nodes) if n.spec.name not in spared)


def lose_a_node(cluster: Cluster) -> tuple[str, list[dict]]:
    """Every node reaching the job's coordinator, one it can lose SIGKILLed whole (sidecar, agent,
    ranks); the survivors' agents must end well. The lost node's name and the survivors' exit records."""
    assert wait_for(lambda: all(n.status().get("jobs", {}).get("jv", {}).get("reachable") for n in cluster.nodes),
                    60), explain(cluster)  # fmt: skip
    lost = node_to_lose(cluster)
    cluster.lose_node(lost)
    survivors = [n for n in cluster.nodes if n.spec.name != lost]
    codes = {n.spec.name: c for n, c in zip(cluster.nodes, cluster.wait_agents(JOB_TIMEOUT), strict=True)}
    assert all(codes[n.spec.name] == 0 for n in survivors), (codes, explain(cluster))
    exits = [r for n in survivors for r in n.incidents(kind="exit")]
    assert exits, explain(cluster)
    return lost, exits


def explain(cluster: Cluster) -> str:
    out = []
    for node in cluster.nodes:
        for what in ("sidecar", "torchrun"):
            log = cluster.log(node, what)
            tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
            out.append(f"--- {node.spec.name} {what}\n" + "\n".join(tail))
    return "\n".join(out)


def stacks_of_live_agents(cluster: Cluster) -> str:
    """The Python stacks of every agent still running and of its workers (py-spy), for a failure
    where agents did not end: what a restarted worker waits on (a rendezvous, a store key, gloo)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out = []
    for node in cluster.nodes:
        if node.agent is None or node.agent.poll() is not None:
            continue
        with contextlib.suppress(psutil.Error):
            for proc in [psutil.Process(node.agent.pid), *psutil.Process(node.agent.pid).children(recursive=True)]:
                dump = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=30)
                out.append(f"--- {node.spec.name} pid {proc.pid}\n{(dump.stdout or dump.stderr)[-3000:]}")
    return "\n".join(out)


# For a node none of whose ranks hangs: without CYCLE_HANG_LOCAL_RANK a node's ranks go by
# CYCLE_HANG_RANK (default 1), and the rendezvous, not the node's name, decides who is rank 1.
NO_HANG = {"CYCLE_HANG_LOCAL_RANK": "-1"}


def three_nodes(env: dict[str, str] | None = None, hang_local_rank: int = 1) -> list[NodeSpec]:
    """Nodes of 1, 2 and 1 ranks; the middle node's local rank `hang_local_rank` is the one that hangs."""
    hang = {"CYCLE_HANG_LOCAL_RANK": str(hang_local_rank), **(env or {})}
    return [NodeSpec("node-0", 1, dict(NO_HANG)), NodeSpec("node-1", 2, hang), NodeSpec("node-2", 1, dict(NO_HANG))]


def faults_spec(workdir: Path, shape: str, mode: str, nodes: list[NodeSpec]) -> ClusterSpec:
    """The user's own loop in one of the field's shapes (bench/cycles/train_faults.py), whose
    hanging rank hangs once, at HANG_STEP, in `mode` (stop, spin, desync...)."""
    env = {"CYCLE_HANG_STEP": str(HANG_STEP), "CYCLE_LOG": str(workdir / "cycle.jsonl"), "FAULT_SHAPE": shape,
           "CYCLE_HANGS": "1", "CYCLE_HANG_MODE": mode}  # fmt: skip
    base = ClusterSpec(nodes, job_id="jv", sidecar=sidecars(), env=env)
    base.script = base.script.parent / "train_faults.py"
    return base


def story_of(cluster: Cluster, node: str = "node-2") -> subprocess.CompletedProcess:
    """`sidecar incidents --job jv` asked of `node`'s sidecar: the job's story across its nodes."""
    cmd = [PYTHON, "-m", "sidecar", "incidents", "--job", "jv", "--socket", cluster.node(node).socket]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def stage_table(story: str) -> tuple[list[str], dict[str, list[str]]]:
    """The story's recovery table: its lines, and each stage's cells (one per node); none without one."""
    if "recovery, seconds per stage" not in story:
        return [], {}
    table = story.split("recovery, seconds per stage")[1].split("\n\n")[0].splitlines()
    return table, {line.split()[0]: line.split()[-3:] for line in table[2:] if line.strip()}


def measured(cells: list[str]) -> bool:
    return all(cell.rstrip("*").replace(".", "").isdigit() for cell in cells)


def settled_story(cluster: Cluster, within: float = 30.0) -> subprocess.CompletedProcess:
    """The story once every node's recovery stages are in (each node sends its part again after the
    job incident closed, the last one can come after the job ended), or as it is after `within` s."""
    read: list[subprocess.CompletedProcess] = []

    def settled() -> bool:
        read.append(story_of(cluster))
        rows = stage_table(read[-1].stdout)[1]
        return read[-1].returncode != 0 or all(measured(rows.get(s, ["?"])) for s in STAGES)

    wait_for(settled, within, interval=1.0)
    return read[-1]


@dataclass
class Run:
    cluster: Cluster  # its sidecars are up until the run is given back
    workdir: Path
    codes: list[int | None]  # the agents' exit codes
    story: subprocess.CompletedProcess  # the job's story, read when the job ended (settled_story)


class SharedRuns:
    """The three-node job with synchronous all-reduces whose middle node's local rank 1 hangs at
    HANG_STEP, one run per hang mode, for the USERS tests that judge it."""

    USERS = 2  # test_multinode's [mode] case and test_collective_verdicts' case of that mode

    def __init__(self, factory: pytest.TempPathFactory):
        self.factory = factory
        self.runs: dict[str, Run] = {}
        self.given_back: dict[str, int] = {}

    @contextlib.contextmanager
    def hung_middle_rank(self, mode: str) -> Iterator[Run]:
        assert self.given_back.get(mode, 0) < self.USERS, f"the {mode} run was given back by all its {self.USERS} users"
        run = self.runs.get(mode)
        if run is None:
            workdir = self.factory.mktemp(f"hung-{mode}")
            cluster = Cluster(faults_spec(workdir, "sync", mode, three_nodes()), workdir).__enter__()
            try:
                codes = cluster.wait_agents(JOB_TIMEOUT)
                run = Run(cluster, workdir, codes, settled_story(cluster))
            except BaseException:
                cluster.close()
                raise
            self.runs[mode] = run
        try:
            yield run
        finally:
            self.given_back[mode] = self.given_back.get(mode, 0) + 1
            if self.given_back[mode] >= self.USERS:
                run.cluster.close()

    def close(self) -> None:
        for run in self.runs.values():
            run.cluster.close()
