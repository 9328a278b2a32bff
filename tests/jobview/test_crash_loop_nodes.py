"""A crash loop ended on purpose (issue 42, item 5) on three simulated nodes of one rank each
(harness/cluster.py: one sidecar and one agent per node, one c10d rendezvous): rank 1 raises at the
same step in every attempt, torchrun has restarts to spare (--max-restarts 5), and
job_view.crash_loop_repeats is 1. The second time the job meets the same verdict at the same step,
every node marks the job, its ranks exit 93, and every `trainer_hooks.launch` agent exits 93 without
using its remaining restarts; `/v1/status` and `/metrics` say why on every node."""

from __future__ import annotations

import json

import pytest

from harness.cluster import Cluster
from harness.job import wait_for
from tests.jobview.clusters import JOB_TIMEOUT, explain
from tests.jobview.clusters import faults_spec as spec
from tests.jobview.test_hang_kinds_nodes import cycle, one_rank_each
from tests.support import ROOT
from trainer_hooks.wire import CRASH_LOOP_EXIT

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hang-kinds-clusters")]


def looping(tmp_path, mode: str):
    """Rank 1 on node-1 meets `mode` at step 150 of every attempt; restarts to spare (5), agents of
    trainer_hooks.launch, a crash loop at the first repeat."""
    job = spec(tmp_path, "async", mode, one_rank_each())
    job.env.update({"CYCLE_HANG_STEP": "150", "CYCLE_HANGS": "6"})
    job.max_restarts = 5
    job.launcher = "trainer_hooks.launch"
    job.sidecar.extra.append("job_view.crash_loop_repeats=1")
    return job


def test_a_rank_that_crashes_at_the_same_step_every_attempt_ends_the_job_with_93_on_every_node(tmp_path):
    with Cluster(looping(tmp_path, "crash"), tmp_path) as cluster:
        codes = cluster.wait_agents(JOB_TIMEOUT)
        assert codes == [CRASH_LOOP_EXIT] * 3, explain(cluster)
        crashes = sorted({r["attempt"] for r in cycle(tmp_path) if r["kind"] == "hang"})
        assert crashes[:2] == [0, 1] and len(crashes) <= 3, crashes  # ended, not restarted 5 times
        for node in cluster.nodes:
            ended = node.status().get("crash_loops", {}).get("jv")
            assert ended is not None and ended["exit_code"] == CRASH_LOOP_EXIT, (node.spec.name, explain(cluster))
            assert "rank_crashed (rank 1 on node-1, its last step 150)" in ended["reason"], ended
            assert 'sidecar_job_crash_loop{job_id="jv"} 1.0' in node.client.get("/metrics")[1].decode(), node.spec.name
        logs = [cluster.log(n, "torchrun").read_text(errors="replace") for n in cluster.nodes]
        assert all("exiting 93" in text for text in logs), json.dumps([t[-2000:] for t in logs])


@pytest.mark.parametrize("mode", ["stop", "desync"])
def test_a_hang_met_again_at_the_same_step_ends_the_job_with_93_on_every_node(tmp_path, mode):
    """A stopped rank (its node kills it: its agent, told by no exit code, asks its sidecar before it
    restarts) and a desync (every node kills its own ranks), each at step 150 of every attempt."""
    with Cluster(looping(tmp_path, mode), tmp_path) as cluster:
        codes = cluster.wait_agents(JOB_TIMEOUT)
        assert codes == [CRASH_LOOP_EXIT] * 3, explain(cluster)
        hangs = sorted({r["attempt"] for r in cycle(tmp_path) if r["kind"] == "hang"})
        assert hangs[:2] == [0, 1] and len(hangs) <= 3, hangs

        # the incidents say so: a stall's record that took the verdict, or the exit of a rank that obeyed it
        def exits() -> list[dict]:  # decided once settled (sidecar/exits/tracker.py): seconds after the exit
            return [
                e for n in cluster.nodes for r in n.incidents(kind="exit") for e in r["exits"] if e.get("crash_loop")
            ]

        stalls = [r for n in cluster.nodes for r in n.incidents() if r.get("crash_loop")]
        assert stalls or wait_for(exits, 30), explain(cluster)
        assert all(e["crash_loop"]["exit_code"] == CRASH_LOOP_EXIT for e in exits()), exits()
        assert all(n.status().get("crash_loops", {}).get("jv") for n in cluster.nodes), explain(cluster)


@pytest.mark.parametrize("launcher", ["torch.distributed.run", "trainer_hooks.launch"])
def test_slurms_batch_script_exits_93_for_a_crash_loop_with_either_launcher(tmp_path, launcher):
    """deploy/slurm/train.sbatch run for real as a one-node job of 2 ranks (srun a stand-in that runs
    the step, tests/security/test_slurm_launch.py), a real sidecar: rank 1 raises at step 40 of every
    attempt, --max-restarts 4. trainer_hooks.launch exits 93 itself; plain torchrun spends its
    restarts (each attempt's ranks exit 93 at registration) and exits 1: the script asks the node's
    sidecar and exits 93 all the same, the status slurm.conf's RequeueExit leaves out."""
    from tests.security.test_slurm_launch import batch_env, sbatch
    from tests.support import Sidecar

    settings = ("watchdog.floor_seconds=3", "watchdog.check_interval_seconds=0.25",
                "hooks_flush_interval_seconds=0.5", "job_view.crash_loop_repeats=1")  # fmt: skip
    with Sidecar(tmp_path, *settings) as sidecar:
        env = batch_env(tmp_path, **sidecar.hook_env(), NPROC_PER_NODE="2", MAX_RESTARTS="4", LAUNCHER=launcher,
                        FAULT_SHAPE="async", CYCLE_HANG_MODE="crash", CYCLE_HANGS="6", CYCLE_HANG_STEP="40",
                        CYCLE_LOG=str(tmp_path / "cycle.jsonl"))  # fmt: skip
        env.pop("SIDECAR_HOOKS_DISABLED")
        out = sbatch(env, str(ROOT / "bench" / "cycles" / "train_faults.py"), timeout=180)
        assert out.returncode == CRASH_LOOP_EXIT, (out.returncode, out.stderr[-4000:])
        crashes = sorted({r["attempt"] for r in cycle(tmp_path) if r["kind"] == "hang"})
        assert crashes[:2] == [0, 1] and len(crashes) <= 3, crashes
        # the ranks of an attempt were told (`the sidecar ended the job`), or the agent asked first
        assert "ended the job" in out.stderr, out.stderr[-4000:]
        if launcher == "torch.distributed.run":
            assert "was ended for a crash loop by its sidecar (sidecar status): exit 93" in out.stderr
