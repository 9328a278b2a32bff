"""`sidecar drill` on a job of three simulated nodes (harness/cluster.py, one rank each): the drilled
node says so in its job-view reports, the job incident's verdict carries the drill to every node, and
every node records its stall as the drill's. Before, the drilled node alone knew: node-0 and node-2
counted a real stall (sidecar_watchdog_stalls_total 1, the stall alerts) for a drill."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from harness.cluster import Cluster, ClusterSpec, NodeSpec
from harness.job import SidecarSpec
from tests.jobview.clusters import explain
from tests.support import PYTHON

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("jobview-clusters")]


def test_a_drill_on_one_node_is_a_drill_on_every_node_of_the_job(tmp_path):
    nodes = [NodeSpec("node-0", 1), NodeSpec("node-1", 1), NodeSpec("node-2", 1)]
    sidecar = SidecarSpec(floor_seconds=3.0, grace_seconds=1.0, dump_wait_seconds=0.5)
    # a long job (CYCLE_HANG_STEP + 41 steps, no hang of its own): the test ends it
    spec = ClusterSpec(nodes, job_id="drilled", sidecar=sidecar, env={"CYCLE_HANG_STEP": "400"})
    with Cluster(spec, tmp_path) as cluster:
        assert cluster.wait_steps(5, timeout=120), explain(cluster)
        job_id = cluster.nodes[1].ranks()[0]["job_id"]
        # the drill is refused until the drilled node reports the job to its coordinator (else the
        # other nodes would not hear of it): as an operator would, wait for `sidecar status` to show it
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and job_id not in (cluster.nodes[1].status().get("jobs") or {}):
            time.sleep(0.5)
        done = subprocess.run(
            [PYTHON, "-m", "sidecar", "drill", "--job", job_id, "--socket", cluster.nodes[1].socket],
            capture_output=True, text=True, timeout=200,
        )  # fmt: skip
        assert done.returncode == 0, (done.stdout, done.stderr, explain(cluster))
        drill = re.search(r"^drill (drill-\S+):", done.stdout, re.MULTILINE)
        assert drill and "recorded as a drill, not counted as a failure" in done.stdout, done.stdout
        for node in cluster.nodes:
            stalls = node.incidents()  # kind stall
            assert [i.get("drill") for i in stalls] == [drill.group(1)], (node.spec.name, stalls)
            metrics = node.client.get("/metrics")[1].decode()
            for family in ("sidecar_watchdog_stalls_total{", "sidecar_watchdog_remediations_total{",
                           "sidecar_stall_verdicts_total{", "sidecar_job_failures_total{"):  # fmt: skip
                assert family not in metrics, (node.spec.name, family)
        outcomes = {n.spec.name: n.incidents()[0]["outcome"] for n in cluster.nodes}
        assert outcomes["node-1"] == "killed", outcomes  # the drilled rank's node kills, as for a real hang
        drills = cluster.nodes[1].client.get("/metrics")[1].decode()
        assert re.search(r'sidecar_watchdog_drills_total\{job_id="[^"]+",outcome="killed"\} 1\.0', drills), drills
