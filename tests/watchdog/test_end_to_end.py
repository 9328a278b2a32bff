"""A real sidecar watching real torchrun jobs: every kind of hang is detected, its stacks are
saved, the group is killed, torchrun restarts it and the run ends with exactly the parameters
of an uninterrupted run; and nothing that merely looks slow is ever killed."""

from __future__ import annotations

import pytest

from harness.processes import free_port
from tests.support import Sidecar, wait_until
from tests.watchdog import jobs

pytestmark = pytest.mark.slow


def assert_recovered(result: jobs.Finished, reference: str, sidecar: Sidecar, blamed: int | None = 1) -> dict:
    assert result.returncode == 0, result.explain()
    assert result.digest == reference, "the resumed run must end with the uninterrupted run's parameters"
    assert "resumed from step" in result.text()
    found = jobs.incidents(sidecar)
    assert found, "a stall was recovered without an incident record"
    incident = found[0]
    assert incident["outcome"] == "killed", incident
    if blamed is not None:
        assert incident["blamed_rank"] == blamed, (incident["blamed_rank"], incident["blame_reason"])
        (culprit,) = [r for r in incident["ranks"] if r["rank"] == blamed]
        assert culprit["stack_head"], "the blamed rank's stacks were saved"
    events = [e["event"] for e in incident["timeline"]]
    assert events[0] == "detected" and "sigterm" in events and events[-1] == "exit_observed"
    return incident


def assert_untouched(result: jobs.Finished, reference: str | None, sidecar: Sidecar) -> None:
    assert result.returncode == 0, result.explain()
    if reference is not None:
        assert result.digest == reference
    assert jobs.incidents(sidecar) == []
    metrics = sidecar.metrics()
    assert 'to_state="stalled"' not in metrics and "sidecar_watchdog_stalls_total{" not in metrics
    assert "restart_count=1" not in result.text(), "the job was restarted"


@pytest.mark.parametrize("kind", ["sigstop", "loop", "sleep", "dataloader"])
def test_a_hung_rank_is_detected_killed_and_resumed_exactly(kind, tmp_path, reference_digest):
    """sigstop: frozen at a step's start; loop: an endless Python loop before the all-reduce;
    sleep: asleep inside the step while rank 0 blocks in the all-reduce; dataloader: a batch
    fetch that never returns."""
    with Sidecar(tmp_path, *jobs.SIDECAR_SETTINGS) as sidecar:
        result = jobs.run(jobs.spec(fault=kind), tmp_path, sidecar.hook_env())
        assert_recovered(result, reference_digest, sidecar)
        assert "sidecar_watchdog_remediations_total{job_id=" in sidecar.metrics()


def test_a_declared_checkpoint_longer_than_the_step_timeout_is_not_a_stall(tmp_path, reference_digest):
    with Sidecar(tmp_path, *jobs.SIDECAR_SETTINGS) as sidecar:
        job = jobs.spec(checkpoint_every=8, extra=["faults.checkpoint_delay_seconds=5"])
        assert_untouched(jobs.run(job, tmp_path, sidecar.hook_env()), reference_digest, sidecar)


def test_a_slow_start_is_not_a_stall(tmp_path, reference_digest):
    """Rank 1's first step takes 6 s (twice the step floor): start-up has its own budget."""
    with Sidecar(tmp_path, *jobs.SIDECAR_SETTINGS) as sidecar:
        job = jobs.spec(fault="sleep", fault_step=1, extra=["faults.sleep_seconds=6"])
        assert_untouched(jobs.run(job, tmp_path, sidecar.hook_env()), reference_digest, sidecar)


def test_a_slow_but_progressing_job_is_not_a_stall(tmp_path):
    """Every step takes longer than the 3 s floor: the timeout follows the observed step times."""
    with Sidecar(tmp_path, *jobs.SIDECAR_SETTINGS) as sidecar:
        job = jobs.spec(steps=4, step_delay_seconds=3.5)
        assert_untouched(jobs.run(job, tmp_path, sidecar.hook_env()), None, sidecar)
        assert "training finished: step=4" in (tmp_path / "torchrun.log").read_text()


def test_a_sidecar_restart_in_the_middle_of_a_job_kills_nothing(tmp_path, reference_digest):
    """The hooks re-register with their current step; the new sidecar watches them as healthy.
    A step a second: at 0.4 s the job once ended (its ranks gone) before the restarted sidecar,
    slow to start beside the suite, was asked."""
    sidecar = Sidecar(tmp_path, *jobs.SIDECAR_SETTINGS)
    with sidecar:
        with jobs.start(jobs.spec(step_delay_seconds=1.0), tmp_path, sidecar.hook_env()) as proc:
            jobs.wait_for_step(sidecar, 4)
            sidecar.stop()
            sidecar.start()
            jobs.wait_for_step(sidecar, 6)
            states = {r["rank"]: r["state"] for r in sidecar.status()["ranks"]}
            assert proc.poll() is None, "the job ended before the restarted sidecar was asked"
            assert set(states.values()) <= {"healthy", "suspect"}, states
            result = jobs.finish(proc, tmp_path / "torchrun.log")
        assert_untouched(result, reference_digest, sidecar)


def test_a_hang_on_one_of_two_nodes_is_remediated_and_both_nodes_finish(tmp_path, reference_digest):
    """Two torchrun agents (one rank each) in one c10d rendezvous, one sidecar per 'node'."""
    port = free_port()
    job = jobs.spec(fault="sleep", nproc=1, nnodes=2, checkpoint_dir=str(tmp_path / "shared-ckpt"))
    with (
        Sidecar(tmp_path / "node0", *jobs.SIDECAR_SETTINGS) as node0,
        Sidecar(tmp_path / "node1", *jobs.SIDECAR_SETTINGS) as node1,
    ):
        with (
            jobs.start(job, tmp_path / "node0", node0.hook_env(), rdzv_port=port) as agent0,
            jobs.start(job, tmp_path / "node1", node1.hook_env(), rdzv_port=port) as agent1,
        ):
            results = [
                jobs.finish(agent0, tmp_path / "node0" / "torchrun.log"),
                jobs.finish(agent1, tmp_path / "node1" / "torchrun.log"),
            ]
        for result in results:
            assert result.returncode == 0, result.explain()
            assert "resumed from step" in result.text() or result.digest is None
        assert [d for r in results for d in r.digests] == [reference_digest]
        # One judgement for the job (its coordinator's): both nodes' stall records blame rank 1, and
        # only rank 1's node kills; the other leaves its waiting rank to the launcher.
        stalls = {name: [i for i in jobs.incidents(n) if i.get("kind", "stall") == "stall"]
                  for name, n in (("node0", node0), ("node1", node1))}  # fmt: skip
        assert {name: [(i["blamed_rank"], i["outcome"]) for i in found] for name, found in stalls.items()} == {
            "node0": [(1, "left_to_launcher")], "node1": [(1, "killed")]}, stalls  # fmt: skip


def test_observe_only_reports_a_real_hang_and_leaves_the_job_alone(tmp_path):
    with Sidecar(tmp_path, *jobs.SIDECAR_SETTINGS, "watchdog.observe_only=true") as sidecar:
        with jobs.start(jobs.spec(fault="sleep"), tmp_path, sidecar.hook_env()) as proc:

            def reported():
                briefs = sidecar.status()["incidents"]
                return briefs if briefs and briefs[0]["outcome"] == "observe_only" else None

            wait_until(reported, jobs.JOB_TIMEOUT, interval=0.3, what="an observe-only incident")
            status = sidecar.status()
            assert {r["state"] for r in status["ranks"]} == {"stalled"}
            assert status["health"] == "degraded" and status["watchdog"]["observe_only"] is True
            assert proc.poll() is None, "torchrun is still running: nothing was killed"
            assert "restart_count=1" not in (tmp_path / "torchrun.log").read_text()
        (incident,) = jobs.incidents(sidecar)
        assert "sigterm" not in [e["event"] for e in incident["timeline"]]
