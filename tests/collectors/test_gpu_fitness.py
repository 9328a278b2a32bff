"""The GPU side of the node verdict, through the real pynvml over the fake NVML library: GPUs gone
(fewer than collectors.expected_gpus, or no NVML on a node that expects GPUs) and GPU memory still
held by a process whose rank is gone. Before, a node without NVML or with two of its four GPUs
was a healthy node without (or with fewer) GPUs, and a leftover process was invisible."""

from __future__ import annotations

import contextlib
import os
import signal

from sidecar.collectors.gpu_fitness import GpuFitness, create_time
from sidecar.fitness import Reason
from tests.collectors.helpers import run
from tests.support import wait_until


def reasons(collector) -> list[Reason]:
    return [f.reason for f in collector.fitness.findings()]


def test_two_gpus_where_four_are_expected_is_gpu_missing(fake_gpus, gpu_collector):
    fake_gpus({"gpu_count": 2})
    collector = gpu_collector(fitness=GpuFitness(expected_gpus=4))
    assert run(collector).success, "the collector itself works: the node, not the collector, is at fault"
    (finding,) = collector.fitness.findings()
    assert finding.reason is Reason.GPU_MISSING
    assert finding.text.startswith("2 of 4 expected GPUs usable")


def test_a_lost_gpu_counts_as_missing(fake_gpus, gpu_collector):
    fake_gpus({"gpu_count": 4, "gpus": {"2": {"errors": {"*": "gpu_is_lost"}}}})
    collector = gpu_collector(fitness=GpuFitness(expected_gpus=4))
    run(collector)
    (finding,) = collector.fitness.findings()
    assert finding.reason is Reason.GPU_MISSING and "lost: GPU 2" in finding.text


def test_every_expected_gpu_present_is_fit(fake_gpus, gpu_collector):
    fake_gpus({"gpu_count": 4})
    collector = gpu_collector(fitness=GpuFitness(expected_gpus=4))
    run(collector)
    assert collector.fitness.findings() == []


def test_no_nvml_on_a_node_that_expects_gpus_is_nvml_unavailable(fake_gpus, gpu_collector):
    fake_gpus(None)  # no spec: the fake library answers LIBRARY_NOT_FOUND, as a node without a driver
    collector = gpu_collector(fitness=GpuFitness(expected_gpus=8))
    result = run(collector)
    assert result.success and not result.families
    (finding,) = collector.fitness.findings()
    assert finding.reason is Reason.NVML_UNAVAILABLE and "expects 8 GPUs" in finding.text


def test_no_nvml_without_expected_gpus_stays_a_fit_node_without_gpus(fake_gpus, gpu_collector):
    fake_gpus(None)
    collector = gpu_collector(fitness=GpuFitness(expected_gpus=0))
    run(collector)
    assert collector.fitness.findings() == []


def holding(pid: int, used: int = 3 << 30) -> dict:
    return {"gpu_count": 2, "gpus": {"1": {"processes": [{"pid": pid, "used_memory_bytes": used}]}}}


def test_gpu_memory_held_by_a_worker_whose_rank_is_gone_is_gpu_held_naming_it(fake_gpus, gpu_collector, rank_process):
    proc, child_pid = rank_process()
    try:
        fake_gpus(holding(child_pid))
        live = [("run-42", 3, proc.pid)]
        collector = gpu_collector(fitness=GpuFitness(held_grace_seconds=0), live_ranks=lambda: live)
        run(collector)
        assert collector.fitness.findings() == [], "the worker of a live rank holds its GPU memory rightly"
        os.kill(proc.pid, signal.SIGKILL)  # the trainer dies; its data-loader worker lives on
        proc.wait()
        live.clear()
        run(collector)
        (finding,) = collector.fitness.findings()
        assert finding.reason is Reason.GPU_HELD and finding.pids == (child_pid,)
        assert f"pid {child_pid} (was in rank 3 of job run-42's tree) 3.0 GiB on GPU 1" in finding.text
        os.kill(child_pid, signal.SIGKILL)
        wait_until(lambda: create_time(child_pid) is None, 10, what="the leftover worker gone")
        run(collector)  # NVML may list a dead pid a moment longer: a process that is gone holds nothing
        assert collector.fitness.findings() == [], "the node is fit again once the leftover process is gone"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child_pid, signal.SIGKILL)  # an orphan: the fixture's kill_tree no longer finds it


def test_a_leftover_within_its_grace_or_budget_is_not_judged(fake_gpus, gpu_collector, rank_process):
    proc, child_pid = rank_process()
    fake_gpus(holding(child_pid, used=1 << 30))
    live = [("run-42", 3, proc.pid)]
    patient = gpu_collector(fitness=GpuFitness(held_grace_seconds=3600), live_ranks=lambda: live)
    tolerant = gpu_collector(
        fitness=GpuFitness(held_budget_bytes=2 << 30, held_grace_seconds=0), live_ranks=lambda: live
    )
    for c in (patient, tolerant):
        run(c)
    live.clear()
    for c in (patient, tolerant):
        run(c)
        assert c.fitness.findings() == []


def test_a_process_never_seen_in_a_rank_s_tree_is_not_judged(fake_gpus, gpu_collector, rank_process):
    proc, child_pid = rank_process()  # another workload's process, on this node's GPU
    fake_gpus(holding(child_pid))
    collector = gpu_collector(fitness=GpuFitness(held_grace_seconds=0), live_ranks=lambda: [])
    run(collector)
    run(collector)
    assert collector.fitness.findings() == []
