"""A straggler's cause on its own node (sidecar/ranks/straggler_cause.py): `throttled` when its
process's CPU cgroup throttles it (a real cgroup v1 CPU quota where this machine has one, and a
cgroup v2 `cpu.stat` under a fake procfs root), else `unknown`; an unverified rank is never looked at."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sidecar.host import cgroups, procs
from sidecar.ranks.model import Rank
from sidecar.ranks.straggler_cause import Causes
from tests.support import cgroup_cpu


def _rank(pid: int, verified: bool = True) -> Rank:
    return Rank(job_id="job", rank=1, local_rank=1, world_size=2, local_world_size=2, pid=pid,
                pid_start_time=procs.start_time(pid), peer_verified=verified)  # fmt: skip


@contextlib.contextmanager
def busy_process(quota_us: int | None):
    """A process spinning on a CPU, in a fresh cgroup v1 cpu group with `quota_us` per 100 ms
    (None: no quota)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with cgroup_cpu.cpu_quota(proc.pid, quota_us, "test-straggler-cause"):
            yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(cgroup_cpu.unavailable() is not None, reason=str(cgroup_cpu.unavailable()))
def test_a_rank_held_by_a_real_cgroup_v1_cpu_quota_is_throttled_and_one_without_is_not():
    cgroups._mounts_cache.clear()
    for quota, expected in ((10_000, "throttled"), (None, "compute")):
        with busy_process(quota) as proc:
            causes, rank = Causes(), _rank(proc.pid)
            first = causes.look(rank)
            assert first.cause == "unknown" and "next look" in first.evidence
            time.sleep(1.0)
            got = causes.look(rank)
            assert got.cause == expected, (quota, got)
            assert not got.hardware, got  # a CPU quota is the job's setting, not the node's hardware
            if quota is not None:
                assert "CPU cgroup throttled" in got.evidence and " periods)" in got.evidence, got
            else:
                assert "not throttled" in got.evidence and "own work between collectives" in got.evidence, got


def _fake_v2(tmp_path: Path, pid: int, throttled_usec: int, nr_throttled: int) -> str:
    """A procfs root whose mountinfo has a cgroup2 mount at tmp_path/cg, where `pid` is in /job."""
    procfs, group = tmp_path / "proc", tmp_path / "cg" / "job"
    (procfs / "self").mkdir(parents=True, exist_ok=True)
    (procfs / str(pid)).mkdir(exist_ok=True)
    group.mkdir(parents=True, exist_ok=True)
    (procfs / "self" / "mountinfo").write_text(
        f"30 24 0:26 / {tmp_path / 'cg'} rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
    )
    (procfs / str(pid) / "cgroup").write_text("0::/job\n")
    (group / "cgroup.procs").write_text(f"{pid}\n")
    (group / "cpu.stat").write_text(
        f"usage_usec 100\nuser_usec 50\nsystem_usec 50\nnr_periods 100\n"
        f"nr_throttled {nr_throttled}\nthrottled_usec {throttled_usec}\n"
    )
    return str(procfs)


def test_cgroup_v2_counters_growing_between_looks_are_throttled_and_still_ones_are_not(tmp_path):
    pid, clock = os.getpid(), [100.0]
    cgroups._mounts_cache.clear()
    procfs = _fake_v2(tmp_path, pid, 0, 0)
    causes = Causes(procfs, clock=lambda: clock[0])
    rank = _rank(pid)
    assert causes.look(rank).cause == "unknown"
    clock[0] += 10
    _fake_v2(tmp_path, pid, 2_000_000, 40)  # 2 s throttled in 10 s
    got = causes.look(rank)
    assert got.cause == "throttled" and "throttled 2.00 s in 10 s (40 of" in got.evidence, got
    clock[0] += 10  # no more throttling since: looked at, nothing holds it down, its own work is slower
    still = causes.look(rank)
    assert still.cause == "compute" and "CPU cgroup not throttled over 10 s" in still.evidence, still
    cgroups._mounts_cache.clear()


def test_an_unverified_rank_is_never_looked_at(tmp_path):
    pid, clock = os.getpid(), [100.0]
    cgroups._mounts_cache.clear()
    procfs = _fake_v2(tmp_path, pid, 0, 0)
    causes = Causes(procfs, clock=lambda: clock[0])
    rank = _rank(pid, verified=False)
    causes.look(rank)
    clock[0] += 10
    _fake_v2(tmp_path, pid, 5_000_000, 90)
    got = causes.look(rank)
    assert got.cause == "unknown" and "not a verified rank" in got.evidence
    cgroups._mounts_cache.clear()


def _clock_events(*active: tuple[str, str, float]):
    from sidecar.collectors.gpu import CLOCK_EVENT

    family = CLOCK_EVENT.family()
    for gpu, reason, value in active:
        family.add_metric([gpu, reason], value)
    return [family]


def test_a_gpu_it_holds_with_its_clocks_held_down_is_throttled_and_an_idle_one_is_not(tmp_path):
    from types import SimpleNamespace

    from sidecar.ranks.straggler_cause import gpus_of

    families = _clock_events(
        ("0", "hw_thermal_slowdown", 1), ("0", "sw_power_cap", 0), ("1", "gpu_idle", 1), ("2", "hw_slowdown", 1)
    )
    collector = SimpleNamespace(rank_gpus={("job", 1): {"0"}, ("job", 0): {"1"}})
    of = gpus_of(lambda: families, collector)
    assert of(("job", 1)) == {"0": ["hw_thermal_slowdown"]} and of(("job", 0)) == {"1": []}
    assert of(("job", 7)) is None and gpus_of(lambda: families, None)(("job", 1)) is None
    pid = os.getpid()
    cgroups._mounts_cache.clear()
    causes = Causes(_fake_v2(tmp_path, pid, 0, 0))
    hot = causes.look(_rank(pid), of(("job", 1)))  # even on a first look: the GPU's reason holds now
    assert hot.cause == "throttled" and hot.evidence == "GPU 0 clocks held down (hw_thermal_slowdown)", hot
    assert hot.hardware, hot  # a GPU's clocks held down: the node's hardware (exclusion may follow)
    idle = causes.look(_rank(pid), of(("job", 0)))
    assert idle.cause == "unknown" and "its GPUs' clocks not held down" in idle.evidence, idle
    cgroups._mounts_cache.clear()
