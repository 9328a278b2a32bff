"""The faults of issue 42's table on three simulated nodes of one rank each (harness/cluster.py: one
sidecar and one torchrun agent per node, one c10d rendezvous), the user's own loop waiting on its
all-reduce asynchronously as a CUDA job does (bench/cycles/train_faults.py, shape `async`):

- a healthy job: every rank evaluates for 12 s inside torch ops, outside any collective, nothing
  declared. No one waits on anyone: the job is paused, not hung. Every node records `job_paused`,
  nothing is signalled, nothing restarts (before: every node stalled with `rank_running`, one
  killed the job, 3 of 3 runs);
- a rank raises an exception while its peers wait in their all-reduce: `rank_crashed` names it,
  on every node, and the others' exits are its consequences."""

from __future__ import annotations

import json

import pytest

from harness.cluster import Cluster, NodeSpec
from harness.job import wait_for
from tests.jobview.clusters import JOB_TIMEOUT, NO_HANG, explain, lose_a_node, stacks_of_live_agents
from tests.jobview.clusters import faults_spec as spec
from tests.support import freezer

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hang-kinds-clusters")]  # beside jobview-clusters


def one_rank_each(hang_node: int = 1) -> list[NodeSpec]:
    return [
        NodeSpec(f"node-{i}", 1, {"CYCLE_HANG_LOCAL_RANK": "0"} if i == hang_node else dict(NO_HANG)) for i in range(3)
    ]


def cycle(workdir) -> list[dict]:
    path = workdir / "cycle.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def reachable(node) -> bool:
    """The node's sidecar knows the job's coordinator and hears from it (it learns it from its ranks)."""
    return bool(node.status().get("jobs", {}).get("jv", {}).get("reachable"))


def verdict_in(node) -> bool:
    """The node's stall record has the job's culprit."""
    return any(r.get("culprit") for r in node.incidents())


def sigterms(record: dict) -> bool:
    return any(e["event"] == "sigterm" and e.get("ranks") for e in record["timeline"])


def test_every_rank_evaluating_for_12s_outside_any_collective_is_a_pause_and_nothing_is_killed(tmp_path):
    nodes = [NodeSpec(f"node-{i}", 1) for i in range(3)]
    job = spec(tmp_path, "async", "evaluate", nodes)
    job.env["CYCLE_WORK_SECONDS"] = "12"
    with Cluster(job, tmp_path) as cluster:
        codes = cluster.wait_agents(JOB_TIMEOUT)
        assert codes == [0, 0, 0], explain(cluster)
        records = cycle(tmp_path)
        assert len([r for r in records if r["kind"] == "worked"]) == 3, records  # every rank did pause
        assert {r["attempt"] for r in records} == {0}, explain(cluster)  # nothing was restarted
        logs = {n.spec.name: cluster.log(n, "sidecar").read_text(errors="replace") for n in cluster.nodes}
        assert not any("SIGTERM" in text for text in logs.values()), explain(cluster)
        found = {n.spec.name: n.incidents() for n in cluster.nodes}
        stalls = [r for records in found.values() for r in records]
        assert stalls, explain(cluster)  # the ranks did stop stepping past the 3 s floor
        for record in stalls:
            assert record["hang_kind"] == "job_paused", record["summary"]
            assert record["blamed_rank"] is None and not sigterms(record), record["summary"]
            assert record["outcome"] in ("resumed", "paused"), record["outcome"]


def test_a_rank_that_raises_while_its_peers_wait_is_the_crashed_one_on_every_node(tmp_path):
    job = spec(tmp_path, "async", "crash", one_rank_each())
    job.env["CYCLE_HANG_STEP"] = "150"  # mid-training (~8 s in): every node has learned the job's coordinator
    with Cluster(job, tmp_path) as cluster:
        codes = cluster.wait_agents(JOB_TIMEOUT)
        assert codes == [0, 0, 0], explain(cluster)
        crashed = next(r for r in cycle(tmp_path) if r["kind"] == "hang")["rank"]
        exits = {n.spec.name: n.incidents(kind="exit") for n in cluster.nodes}
        assert all(exits.values()), explain(cluster)
        for name, records in exits.items():
            for record in records:
                for e in record["exits"]:
                    if e["rank"] == crashed:
                        assert e.get("role") == "cause" and not e.get("consequence_of"), (name, record["summary"])
                    else:
                        assert e.get("consequence_of") == f"rank {crashed} on node-1", (name, record["summary"])


def test_a_lost_node_of_one_rank_is_named_and_no_survivor_is_blamed(tmp_path):
    """Issue 42's case: one rank per node, waits asynchronous, the lost node's agent, rank and sidecar
    SIGKILLed at once (before: every survivor named a healthy rank of another node, `first_exit`)."""
    job = spec(tmp_path, "async", "stop", [NodeSpec(f"node-{i}", 1, dict(NO_HANG)) for i in range(3)])
    job.env.update({"CYCLE_HANGS": "0", "CYCLE_HANG_STEP": "100"})
    job.min_nodes = 2
    with Cluster(job, tmp_path) as cluster:
        assert cluster.wait_steps(8, JOB_TIMEOUT), explain(cluster)
        lost, exits = lose_a_node(cluster)
        named = {e.get("consequence_of") for r in exits for e in r["exits"]}
        assert named == {f"node {lost} lost"}, [r["summary"] for r in exits]
        assert all(e["role"] == "consequence" for r in exits for e in r["exits"]), [r["summary"] for r in exits]


def test_rank_0s_node_lost_ends_the_job_on_every_survivor_and_each_records_its_ranks_exit(tmp_path):
    """Rank 0's node holds the rendezvous store (the first agent to bind it, as with the default
    launch) and the job view's coordinator. Lost, the job ends: torchrun cannot re-form without its
    store, so every survivor's agent fails within seconds (measured: 1.1 s) instead of waiting; with
    the judge gone too, no verdict names the lost node, and each survivor records its own rank's exit
    with the communication error that ended it (docs/runbook.md, node_lost). The scheduler restarts it."""
    job = spec(tmp_path, "async", "stop", [NodeSpec(f"node-{i}", 1, dict(NO_HANG)) for i in range(3)])
    job.env.update({"CYCLE_HANGS": "0", "CYCLE_HANG_STEP": "100"})
    job.min_nodes = 2
    with Cluster(job, tmp_path) as cluster:
        assert cluster.wait_steps(8, JOB_TIMEOUT), explain(cluster)
        assert wait_for(lambda: all(reachable(n) for n in cluster.nodes), 60), explain(cluster)
        zero = next(n.spec.name for n in cluster.nodes if any(r["rank"] == 0 for r in n.ranks()))
        store_lost = cluster.rendezvous_host() == zero  # rank 0 may land elsewhere: the store then lives on
        cluster.lose_node(zero)
        survivors = [n for n in cluster.nodes if n.spec.name != zero]
        codes = {n.spec.name: c for n, c in zip(cluster.nodes, cluster.wait_agents(JOB_TIMEOUT), strict=True)}
        if store_lost:  # the job ends on every survivor
            assert all(codes[n.spec.name] not in (None, 0) for n in survivors), (codes, explain(cluster))
        else:  # the coordinator alone is lost: the survivors re-form the job and train to its end
            # (make test-under-load, 1 run: the restarted workers never reached their first step, nor
            # the hooks' registration; their stacks are printed when it happens again)
            assert all(codes[n.spec.name] == 0 for n in survivors), (
                codes, stacks_of_live_agents(cluster), explain(cluster))  # fmt: skip
        for node in survivors:
            exits = wait_for(lambda node=node: node.incidents(kind="exit"), 30)
            assert exits, (node.spec.name, explain(cluster))
            # Its rank raised the communication error (in a collective when rank 0 died), or its own
            # agent, whose store connection failed first, ended it with SIGTERM (between collectives:
            # make test, 1 run of 4; torchrun's log "Sending process N closing signal SIGTERM").
            reasons = {e["reason"] for r in exits for e in r["exits"]}
            assert reasons and reasons <= {"exception/communication", "signal"}, (
                node.spec.name, [r["summary"] for r in exits])  # fmt: skip
            assert node.status()["health"] is not None  # its sidecar lives on


def test_a_stopped_dataloader_worker_is_named_dataloader_stuck_on_every_node_and_only_its_node_kills(tmp_path):
    with Cluster(spec(tmp_path, "async", "dataloader", one_rank_each()), tmp_path) as cluster:
        codes = cluster.wait_agents(JOB_TIMEOUT)
        assert codes == [0, 0, 0], explain(cluster)
        hung = next(r for r in cycle(tmp_path) if r["kind"] == "hang")["rank"]
        found = {n.spec.name: n.incidents() for n in cluster.nodes}
        assert all(len(f) == 1 for f in found.values()), {k: [r["summary"] for r in v] for k, v in found.items()}
        mine = {name: f[0] for name, f in found.items()}
        for name, record in mine.items():
            assert (record["blamed_rank"], record["blamed_node"]) == (hung, "node-1"), (name, record["summary"])
            assert record["hang_kind"] == "dataloader_stuck", (name, record["blame_reason"])
        assert {name: sigterms(r) for name, r in mine.items()} == {"node-0": False, "node-1": True, "node-2": False}


def test_a_rank_deadlocked_on_two_locks_is_rank_deadlocked_on_every_node_and_only_its_node_kills(tmp_path):
    """Its main thread and another take two locks in opposite orders (bench/cycles/chaos.py
    `deadlock`): no CPU, its stack still in `acquire`, outside any collective, while its peers wait
    in their all-reduce. Floor 5 s, as issue 42's table: no CPU is read over a 2-s window that starts
    when the rank turns suspect (half the floor); at 3 s its node killed it as `rank_late` first."""
    job = spec(tmp_path, "async", "deadlock", one_rank_each())
    job.sidecar.floor_seconds = 5.0
    job.env["CYCLE_HANG_STEP"] = "150"  # mid-training: every node has learned the job's coordinator
    with Cluster(job, tmp_path) as cluster:
        codes = cluster.wait_agents(JOB_TIMEOUT)
        assert codes == [0, 0, 0], explain(cluster)
        hung = next(r for r in cycle(tmp_path) if r["kind"] == "hang")["rank"]
        mine = {n.spec.name: n.incidents() for n in cluster.nodes}
        assert all(len(f) == 1 for f in mine.values()), {k: [r["summary"] for r in v] for k, v in mine.items()}
        for name, (record,) in mine.items():
            assert (record["blamed_rank"], record["blamed_node"]) == (hung, "node-1"), (name, record["summary"])
            assert record["hang_kind"] == "rank_deadlocked", (name, record["blame_reason"])
        assert {name: sigterms(r) for name, (r,) in mine.items()} == {"node-0": False, "node-1": True, "node-2": False}


# ---------------------------------------------------------------- one node: the same judgement


def test_on_one_node_the_healthy_evaluation_is_a_pause_too(tmp_path):
    job = spec(tmp_path, "async", "evaluate", [NodeSpec("node-0", 2)])
    job.env["CYCLE_WORK_SECONDS"] = "12"
    with Cluster(job, tmp_path) as cluster:
        assert cluster.wait_agents(JOB_TIMEOUT) == [0], explain(cluster)
        records = cycle(tmp_path)
        assert len([r for r in records if r["kind"] == "worked"]) == 2 and {r["attempt"] for r in records} == {0}
        stalls = cluster.nodes[0].incidents()
        assert stalls and all(r["hang_kind"] == "job_paused" and not sigterms(r) for r in stalls), [
            (r["hang_kind"], r["summary"]) for r in stalls]  # fmt: skip


def test_on_one_node_a_stopped_rank_is_named_from_its_record_not_its_stack(tmp_path):
    """Issue 42: on one node the verdict came from the stacks (`rank_running`) though the record showed
    the peer in its all-reduce and the stopped rank with nothing in flight; and the stopped rank showed
    `healthy` for a while. Its record is old because it is stopped: that is evidence."""
    job = spec(tmp_path, "async", "stop", [NodeSpec("node-0", 2, {"CYCLE_HANG_LOCAL_RANK": "1"})])
    with Cluster(job, tmp_path) as cluster:
        assert cluster.wait_agents(JOB_TIMEOUT) == [0], explain(cluster)
        hung = next(r for r in cycle(tmp_path) if r["kind"] == "hang")["rank"]
        (record,) = cluster.nodes[0].incidents()
        found = (record["blamed_rank"], record["hang_kind"], record["evidence"])
        assert found == (hung, "rank_stopped", "collectives"), record["summary"]
        log = cluster.log(cluster.nodes[0], "sidecar").read_text(errors="replace")
        assert f"rank jv/{hung} (pid" in log and not any(
            f"rank jv/{hung} " in line and "-> healthy" in line and "suspect -> healthy" in line
            for line in log.splitlines()
        ), log[-3000:]


def test_a_rank_frozen_in_its_cgroup_is_rank_stopped_on_every_node_and_recovers_once_thawed(tmp_path):
    """A frozen cgroup (v1 shows its tasks in D: a rank in uninterruptible sleep) stops the rank as
    SIGSTOP does, and no signal reaches it until it is thawed."""
    if not freezer.available():
        pytest.skip("no cgroup v1 freezer hierarchy to create cgroups in")
    job = spec(tmp_path, "async", "stop", [NodeSpec(f"node-{i}", 1, dict(NO_HANG)) for i in range(3)])
    job.env.update({"CYCLE_HANGS": "0", "CYCLE_HANG_STEP": "200"})
    with Cluster(job, tmp_path) as cluster, freezer.frozen_cgroup() as cg:
        assert cluster.wait_steps(8, JOB_TIMEOUT), explain(cluster)
        assert wait_for(lambda: all(reachable(n) for n in cluster.nodes), 60), explain(cluster)
        frozen = next(n for n in cluster.nodes if any(r["rank"] == 1 for r in n.ranks()))
        pid = cluster.rank_pid(1)
        assert pid is not None
        cg.add(pid)
        cg.freeze()
        judged = wait_for(lambda: all(verdict_in(n) for n in cluster.nodes), 60)
        found = {n.spec.name: n.incidents() for n in cluster.nodes}
        cg.thaw()  # the kill its node sent is pending until then
        assert judged, explain(cluster)
        codes = cluster.wait_agents(JOB_TIMEOUT)
    for name, records in found.items():
        assert len(records) == 1, (name, [r["summary"] for r in records])
        record = records[0]
        found_kind = (record["blamed_rank"], record["blamed_node"], record["hang_kind"])
        assert found_kind == (1, frozen.spec.name, "rank_stopped"), record["summary"]
    assert codes == [0, 0, 0], explain(cluster)
