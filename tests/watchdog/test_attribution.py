"""Which rank is blamed when several ranks of a job stall."""

from __future__ import annotations

from types import SimpleNamespace

from sidecar.incidents.store import Incident, RankSnapshot
from sidecar.watchdog.attribution import blame, refine_blame
from sidecar.watchdog.stackdumps import in_collective


def rank(n: int, step: int | None, last_progress: float):
    return SimpleNamespace(rank=n, step=step, last_progress=last_progress, key=("job", n))


STALLED = {("job", n) for n in range(4)}


def test_the_rank_with_the_lowest_step_is_blamed():
    chosen, why = blame([rank(0, 7, 1.0), rank(1, 6, 5.0), rank(2, 7, 0.5)], STALLED)
    assert chosen.rank == 1 and "lowest step" in why


def test_among_equal_steps_the_oldest_progress_is_blamed():
    chosen, why = blame([rank(0, 7, 3.0), rank(1, 7, 2.0)], STALLED)
    assert chosen.rank == 1 and "oldest progress" in why


def test_a_rank_that_never_stepped_is_behind_every_stepping_rank():
    chosen, _ = blame([rank(0, 0, 1.0), rank(1, None, 9.0)], STALLED)
    assert chosen.rank == 1


def snap(n: int, step: int, collective: bool | None) -> RankSnapshot:
    return RankSnapshot(
        rank=n,
        local_rank=n,
        pid=100 + n,
        state="stalled",
        step=step,
        phase=None,
        last_progress_age_seconds=10.0,
        timeout_seconds=5.0,
        in_collective=collective,
    )


def incident(*ranks: RankSnapshot, blamed: int = 0) -> Incident:
    return Incident(
        id="x",
        time=0.0,
        job_id="job",
        node="n",
        blamed_rank=blamed,
        blame_reason="oldest progress",
        timeout_seconds=5.0,
        observe_only=False,
        ranks=list(ranks),
    )


def test_a_rank_outside_a_collective_while_the_others_wait_in_one_is_blamed():
    i = incident(snap(0, 7, True), snap(1, 7, False), blamed=0)
    refine_blame(i)
    assert i.blamed_rank == 1 and "not waiting for its peers" in i.blame_reason


def test_when_every_local_rank_waits_in_a_collective_the_culprit_is_elsewhere():
    i = incident(snap(0, 7, True), snap(1, 7, True))
    refine_blame(i)
    assert i.blamed_rank == 0 and "another node" in i.blame_reason


def test_a_single_local_rank_waiting_in_a_collective_points_to_another_node():
    i = incident(snap(0, 7, True))
    refine_blame(i)
    assert "another node" in i.blame_reason


def test_stack_dumps_inside_torch_distributed_are_collectives():
    faulthandler = '  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 2800 in all_reduce'
    py_spy = "    all_reduce (torch/distributed/distributed_c10d.py:2800)"
    assert in_collective(faulthandler) and in_collective(py_spy)
    assert in_collective('  File "/x/sidecar_trainer/faults.py", line 44 in before_allreduce') is False
    assert in_collective("") is None


# The main thread of rank 1 in bench_recovery's hang under `python -m sidecar_trainer.launch`
# (a worker forked by the launcher runs the script from torch/distributed/run.py), and rank 0
# waiting for it in DDP's backward: the launcher's frames at the bottom of every stack, and
# elastic's `@record` wrapper that torchrun's docs ask scripts to use, say nothing.
SLEEPING_UNDER_THE_LAUNCHER = """Current thread 0x00007f3cd15e7b80 (most recent call first):
  File "/w/sidecar_trainer/faults.py", line 56 in before_allreduce
  File "/w/sidecar_trainer/train.py", line 184 in _micro_step
  File "/w/sidecar_trainer/__main__.py", line 68 in main
  File "/v/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367 in wrapper
  File "<frozen runpy>", line 291 in run_path
  File "/v/site-packages/torch/distributed/run.py", line 982 in run_script_path
"""
WAITING_IN_BACKWARD = """Current thread 0x00007f3cd15e7b80 (most recent call first):
  File "/v/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "/v/site-packages/torch/autograd/__init__.py", line 395 in backward
  File "/v/site-packages/torch/_tensor.py", line 623 in backward
  File "/w/sidecar_trainer/train.py", line 186 in _micro_step
  File "/v/site-packages/torch/distributed/run.py", line 982 in run_script_path
"""


def test_only_the_innermost_torch_frames_say_a_rank_waits_for_its_peers():
    assert in_collective(SLEEPING_UNDER_THE_LAUNCHER) is False
    assert in_collective(WAITING_IN_BACKWARD) is True
    py_spy = (
        'Thread 7 (idle): "MainThread"\n    wait (torch/distributed/distributed_c10d.py:2800)\n'
        "    step (train.py:12)\n    wrapper (torch/distributed/elastic/multiprocessing/errors/__init__.py:367)\n"
    )
    assert in_collective(py_spy) is True
    assert (
        in_collective(py_spy.replace("wait (torch/distributed/distributed_c10d.py:2800)", "sleep (train.py:9)"))
        is False
    )


def test_a_rank_sleeping_under_torchrun_s_launcher_is_blamed_against_one_waiting_in_backward():
    i = incident(
        snap(0, 17, in_collective(WAITING_IN_BACKWARD)), snap(1, 17, in_collective(SLEEPING_UNDER_THE_LAUNCHER))
    )
    refine_blame(i)
    assert i.blamed_rank == 1 and "not waiting for its peers" in i.blame_reason
