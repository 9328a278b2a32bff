"""The job view judging from the backend's own record (the Flight Recorder, on gloo as on NCCL),
on three simulated nodes (harness/cluster.py: three sidecars, three torchrun agents in one c10d
rendezvous, the middle node with two ranks) running the user's own loop with the hooks
(bench/cycles/train_faults.py), in the shapes the field's hangs come in:

- a rank SIGSTOPped, with synchronous all-reduces and with async ones waited in the user's own
  function (as a CUDA job waits: the waiting ranks are not in torch.distributed's frames);
- a rank in a Python busy loop outside any collective;
- a rank that calls a barrier where its peers all-reduce (a desync);
- 2 x 2 data x tensor parallel (two kinds of subgroup), one rank SIGSTOPped.

Each gives one job incident on every node with the verdict's kind and evidence `collectives`; where
a rank is to blame it is named on every node and only its node kills; a desync names the odd rank out and its node, and
every node acts on its own ranks."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.cluster import Cluster
from tests.jobview.clusters import JOB_TIMEOUT, Run, SharedRuns, explain, story_of, three_nodes
from tests.jobview.clusters import faults_spec as spec
from tests.support import PYTHON

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("jobview-clusters")]


def hang_record(workdir) -> dict:
    path = workdir / "cycle.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return next(r for r in lines if r["kind"] == "hang")


def incidents(cluster: Cluster) -> dict[str, dict]:
    found = {node.spec.name: node.incidents() for node in cluster.nodes}
    assert all(len(f) == 1 for f in found.values()), {k: [i["summary"] for i in v] for k, v in found.items()}
    return {name: f[0] for name, f in found.items()}


def signalled(record: dict) -> bool:
    return any(e["event"] == "sigterm" and e.get("ranks") for e in record["timeline"])


def check_rank_late(
    cluster: Cluster, workdir, hung_node: str, codes: list[int | None] | None = None, kind: str = "rank_late"
) -> dict[str, dict]:
    """The late rank named on every node with `kind`: `rank_late` from the records, `rank_stopped` where
    its node also read its process stopped (the record says who is late, the process why)."""
    codes = cluster.wait_agents(JOB_TIMEOUT) if codes is None else codes
    assert codes == [0] * len(cluster.nodes), explain(cluster)
    hung = hang_record(workdir)["rank"]
    mine = incidents(cluster)
    for name, record in mine.items():
        assert (record["blamed_rank"], record["blamed_node"]) == (hung, hung_node), (name, record["summary"])
        assert (record["hang_kind"], record["evidence"]) == (kind, "collectives"), (name, record["summary"])
    assert len({r["job_incident"] for r in mine.values()}) == 1
    assert {name: signalled(r) for name, r in mine.items()} == {n.spec.name: n.spec.name == hung_node
                                                                 for n in cluster.nodes}  # fmt: skip
    return mine


@contextlib.contextmanager
def stopped_rank(shared_runs: SharedRuns, tmp_path, shape: str) -> Iterator[Run]:
    """The sync case is test_multinode's stopped-rank run (shared); the async one a run of its own."""
    if shape == "sync":
        with shared_runs.hung_middle_rank("stop") as run:
            yield run
    else:
        with Cluster(spec(tmp_path, shape, "stop", three_nodes()), tmp_path) as cluster:
            codes = cluster.wait_agents(JOB_TIMEOUT)
            yield Run(cluster, tmp_path, codes, story_of(cluster))


@pytest.mark.parametrize("shape", ["sync", "async"])
def test_a_stopped_rank_is_the_late_one_whether_its_peers_wait_in_torch_or_in_their_own_code(
    shared_runs: SharedRuns, tmp_path, shape
):
    with stopped_rank(shared_runs, tmp_path, shape) as run:
        cluster = run.cluster
        mine = check_rank_late(cluster, run.workdir, "node-1", run.codes, kind="rank_stopped")
        reason = mine["node-0"]["blame_reason"]
        assert "never entered" in reason or "stopped" in reason, reason
        # the incident keeps the ranks' Flight Recorder dumps; its summary shows each rank's collective
        assert mine["node-0"]["fr_dumps"], mine["node-0"]
        node_1 = cluster.node("node-1").socket
        full = subprocess.run([PYTHON, "-m", "sidecar", "incidents", "--full", "--socket", node_1],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert "collectives (Flight Recorder)" in full.stdout and "all_reduce[256]" in full.stdout, full.stdout
        story = run.story  # `sidecar incidents --job jv` on node-2, read when the job ended
        assert "kind      rank_stopped (judged from collectives)" in story.stdout, story.stdout


def test_a_rank_spinning_outside_any_collective_is_the_late_one(shared_runs: SharedRuns):
    """test_multinode's spinning-rank run (shared)."""
    with shared_runs.hung_middle_rank("spin") as run:
        mine = check_rank_late(run.cluster, run.workdir, "node-1", run.codes)
        assert "never entered" in mine["node-2"]["blame_reason"], mine["node-2"]["blame_reason"]


def test_a_desync_is_a_collective_mismatch_naming_the_odd_rank_out_and_its_node(tmp_path):
    """Before issue 42 no rank was named and `culprit.node` was the first node of the group (node-0)."""
    with Cluster(spec(tmp_path, "sync", "desync", three_nodes()), tmp_path) as cluster:
        codes = cluster.wait_agents(JOB_TIMEOUT)
        assert codes == [0, 0, 0], explain(cluster)
        mine = incidents(cluster)
        odd = hang_record(tmp_path)["rank"]
        for name, record in mine.items():
            assert (record["hang_kind"], record["evidence"]) == ("collective_mismatch", "collectives"), (
                name, record["summary"])  # fmt: skip
            assert (record["blamed_rank"], record["blamed_node"]) == (odd, "node-1"), record["summary"]
            assert record["culprit"]["node"] == "node-1" and record["collective"]["odd"] == {str(odd): "node-1"}
            ops = record["collective"]["ops"]
            assert "barrier" in ops and "all_reduce[256]" in ops and len(ops) == 2, ops
            assert ops["barrier"] == [hang_record(tmp_path)["rank"]], ops
        assert len({r["job_incident"] for r in mine.values()}) == 1
        # no culprit: every node acts on its own ranks (a node whose rank a peer failure ended first, as the
        # others' kills closed its connections, finds none left to signal: make test, 1 run in 7)
        assert all(any(e["event"] == "sigterm" for e in r["timeline"]) for r in mine.values()), mine
        assert any(signalled(r) for r in mine.values())
        # every rank's Flight Recorder dump, gathered from the nodes' incidents, reads in torch's fr_trace
        gathered = tmp_path / "fr"
        gathered.mkdir()
        for record in mine.values():
            for dump in Path(record["fr_dumps"]).iterdir():
                shutil.copy(dump, gathered / dump.name)
        assert sorted(p.name for p in gathered.iterdir()) == [f"rank_{r}" for r in range(4)]
        trace = subprocess.run([PYTHON, "-m", "torch.distributed.flight_recorder.fr_trace", str(gathered)],
                               capture_output=True, text=True, timeout=120)  # fmt: skip
        assert "COLLECTIVE_TYPE_MISMATCH" in trace.stdout + trace.stderr, trace.stdout + trace.stderr


def test_with_data_and_tensor_parallel_groups_the_one_stopped_rank_is_named(tmp_path):
    with Cluster(spec(tmp_path, "tp", "stop", three_nodes(hang_local_rank=0)), tmp_path) as cluster:
        check_rank_late(cluster, tmp_path, "node-1", kind="rank_stopped")
