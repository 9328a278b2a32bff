"""The process collector against real processes: a rank that holds 64 MiB and has a child."""

from __future__ import annotations

import psutil

from sidecar.collectors.process import ProcessCollector
from tests.collectors.helpers import run, series
from tests.support import kill_tree, wait_until

RANK = (("job_id", "run-42"), ("rank", "0"))


def collect(ranks):
    result = run(ProcessCollector(lambda: ranks))
    assert result.success, result.error
    return result.families


def test_a_rank_and_its_children_are_summed(rank_process):
    proc, child_pid = rank_process()
    families = collect([("run-42", 0, proc.pid)])
    own_rss = psutil.Process(proc.pid).memory_info().rss
    child_rss = psutil.Process(child_pid).memory_info().rss
    assert series(families, "sidecar_process_resident_memory_bytes")[RANK] >= 64 * 2**20
    assert series(families, "sidecar_process_resident_memory_bytes")[RANK] >= own_rss + child_rss * 0.5
    assert series(families, "sidecar_process_children")[RANK] == 1
    assert series(families, "sidecar_process_threads")[RANK] >= 2
    assert series(families, "sidecar_process_open_fds")[RANK] >= 6  # three standard fds each
    assert series(families, "sidecar_process_cpu_seconds_total")[RANK] > 0


def test_the_state_of_the_rank_process_is_one_hot(rank_process):
    proc, _ = rank_process()
    wait_until(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_SLEEPING, 10, what="the rank to sleep")
    states = {
        dict(k)["state"]: v for k, v in series(collect([("run-42", 0, proc.pid)]), "sidecar_process_state").items()
    }
    assert states["sleeping"] == 1 and sum(states.values()) == 1
    assert set(states) == {"running", "sleeping", "disk_sleep", "stopped", "zombie", "other"}


def test_a_stopped_rank_shows_stopped(rank_process):
    proc, _ = rank_process()
    psutil.Process(proc.pid).suspend()
    wait_until(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, 10, what="SIGSTOP")
    states = series(collect([("run-42", 0, proc.pid)]), "sidecar_process_state")
    assert states[RANK + (("state", "stopped"),)] == 1


def test_a_rank_whose_process_is_gone_has_no_series(rank_process):
    proc, _ = rank_process()
    kill_tree(proc)
    assert collect([("run-42", 0, proc.pid)]) == []


def test_ranks_are_labelled_separately(rank_process):
    (a, _), (b, _) = rank_process(), rank_process()
    rss = series(collect([("run-42", 0, a.pid), ("run-42", 1, b.pid)]), "sidecar_process_resident_memory_bytes")
    assert {dict(k)["rank"] for k in rss} == {"0", "1"}


def test_no_registered_ranks_means_no_series():
    assert collect([]) == []
