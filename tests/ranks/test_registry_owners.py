"""Ownership and per-owner quotas in the registry: a job belongs to the uid its live ranks run
as; jobs, ranks, custom metric names and phase names are counted per uid (root: only the
node-wide ceilings)."""

from __future__ import annotations

import time

import pytest

from sidecar.ranks.errors import JobOwned, LimitExceeded
from sidecar.ranks.protocol import PhaseItem, Push, Registration, StepItem
from sidecar.ranks.registry import Registry
from tests.support import make_settings

ALICE, MALLORY, ROOT = 1001, 1002, 0


@pytest.fixture
def registry(tmp_path) -> Registry:
    return Registry(
        make_settings(
            tmp_path,
            limits__max_jobs=6,
            limits__max_jobs_per_user=2,
            limits__max_ranks_per_user=3,
            limits__max_phases=4,
            limits__max_phases_per_user=5,
            limits__max_custom_metrics=4,
            limits__max_custom_metrics_per_user=5,
        )
    )


def register(registry, owner, job, rank=0, pid=None, **kw):
    pid = pid or 1000 + owner * 10 + rank + hash(job) % 7 * 100
    reg = Registration(job_id=job, rank=rank, local_rank=0, world_size=8, local_world_size=1, pid=pid, **kw)
    return registry.register(reg, pid_start_time=None, peer_verified=True, owner_uid=owner)


def push(registry, r, *items):
    return registry.apply_push(Push(r.job_id, r.rank, r.pid, 0, list(items)))


def test_a_job_belongs_to_its_owner_until_its_ranks_are_gone(registry):
    r = register(registry, ALICE, "a")
    with pytest.raises(JobOwned, match="belongs to uid 1001"):
        register(registry, MALLORY, "a", rank=1)
    with pytest.raises(JobOwned):
        register(registry, ROOT, "a", rank=0, restart_count=5)  # root's own process: not alice's job
    registry.mark_gone(r.key, "exited")
    with pytest.raises(JobOwned, match="reserved for uid 1001"):
        register(registry, MALLORY, "a")  # its next restart attempt may still come (ranks/ownership.py)
    registry.owners.clock = lambda: time.time() + 3600  # the reservation has ended
    assert register(registry, MALLORY, "a").owner_uid == MALLORY


def test_jobs_and_ranks_are_counted_per_user_and_root_only_node_wide(registry):
    register(registry, MALLORY, "m1")
    register(registry, MALLORY, "m2")
    with pytest.raises(LimitExceeded, match="max_jobs_per_user is 2"):
        register(registry, MALLORY, "m3")
    register(registry, MALLORY, "m2", rank=1)
    with pytest.raises(LimitExceeded, match="max_ranks_per_user is 3"):
        register(registry, MALLORY, "m2", rank=2)
    register(registry, ALICE, "a1")
    for i in range(3):
        register(registry, ROOT, f"r{i}")  # root: 3 jobs, past the per-user 2
    with pytest.raises(LimitExceeded, match="max_jobs is 6"):
        register(registry, ROOT, "r3")


def test_custom_metric_and_phase_names_are_counted_per_user(registry):
    m1, m2 = register(registry, MALLORY, "m1"), register(registry, MALLORY, "m2")
    push(registry, m1, StepItem(1, 1.0, {f"c{i}": 1.0 for i in range(4)}))
    with pytest.raises(LimitExceeded, match="max_custom_metrics_per_user is 5"):
        push(registry, m2, StepItem(1, 1.0, {"x": 1.0, "y": 2.0}))
    push(registry, m1, *[PhaseItem(f"p{i}", "start", 1.0) for i in range(4)])
    with pytest.raises(LimitExceeded, match="max_phases_per_user is 5"):
        push(registry, m2, PhaseItem("q1", "start", 1.0), PhaseItem("q2", "start", 1.0))
    a = register(registry, ALICE, "a1")  # alice has her own budget
    push(registry, a, StepItem(1, 1.0, {f"c{i}": 1.0 for i in range(4)}), PhaseItem("p", "start", 1.0))
