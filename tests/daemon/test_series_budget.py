"""`/metrics` within limits.max_series (sidecar/daemon/exposition.py): per-rank series and custom
metrics beyond the budget are left out and counted, fairly across jobs, and the answer never
exceeds the budget. The load case with thousands of ranks is tests/security/test_bounded_cost.py."""

from __future__ import annotations

import os

from sidecar.daemon.exposition import fair_order, plan
from sidecar.ranks.protocol import Push, Registration, StepItem
from sidecar.ranks.registry import Registry
from sidecar.ranks.training_metrics import TrainingCollector
from tests.daemon.helpers import DAEMON, push_body, registration, step_item
from tests.support import make_settings


def samples(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def value(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in samples(text) if line.startswith(name + " ")))


def fill(registry: Registry, job: str, ranks: int, customs: int, pid: int) -> None:
    for rank in range(ranks):
        registry.register(
            Registration(job_id=job, rank=rank, local_rank=0, world_size=ranks, local_world_size=1, pid=pid),
            pid_start_time=None,
            peer_verified=True,
        )
        metrics = {"loss": 1.0, **{f"c{i}": float(i) for i in range(customs)}}
        registry.apply_push(Push(job, rank, pid, 0, [StepItem(1, 1.0, metrics)]))


def test_the_order_is_round_robin_over_jobs_live_ranks_first(tmp_path):
    registry = Registry(make_settings(tmp_path, DAEMON))
    fill(registry, "big", 5, 0, os.getpid())
    fill(registry, "small", 2, 0, os.getpid())
    registry.mark_gone(("big", 0), "exited")
    assert [r.key for r in fair_order(registry.ranks())] == [
        ("big", 1),
        ("small", 0),
        ("big", 2),
        ("small", 1),
        ("big", 3),
        ("big", 4),
        ("big", 0),
    ]


def test_a_plan_admits_ranks_then_their_custom_metrics_while_they_fit():
    order = [("a", 0), ("b", 0), ("a", 1)]
    cost = {("a", 0): (10, 5), ("b", 0): (10, 20), ("a", 1): (10, 0)}
    p = plan(order, cost, 36)
    assert p.ranks == {("a", 0), ("b", 0), ("a", 1)} and p.custom == {("a", 0), ("a", 1)}
    assert (p.dropped_ranks, p.dropped_series) == (0, 20)
    p = plan(order, cost, 15)
    assert p.ranks == {("a", 0)} and p.custom == {("a", 0)} and p.dropped_series == 40


def test_the_series_count_of_a_rank_matches_what_is_exported(tmp_path):
    registry = Registry(make_settings(tmp_path, DAEMON))
    fill(registry, "j", 1, 3, os.getpid())
    r = registry.get("j", 0)
    r.nonfinite["loss"] += 1
    families = list(TrainingCollector(registry).collect())
    exported = sum(1 for f in families for s in f.samples if s.labels.get("rank") == "0")
    own, custom = TrainingCollector.series(r)
    assert (own + custom, custom) == (exported, 3)


async def test_metrics_never_exceed_the_budget_and_count_what_they_leave_out(serve, child_pid):
    sidecar = await serve(limits__max_series=300, limits__max_custom_metrics=8)
    for job, ranks in (("big", 40), ("small", 2)):
        for rank in range(ranks):
            reply = await sidecar.post("/v1/register", registration(child_pid, job=job, rank=rank, world_size=64))
            assert reply.status == 200, reply.body
            metrics = {"loss": 1.0, **{f"custom_{i}": 1.0 for i in range(8)}}
            reply = await sidecar.post("/v1/push", push_body(child_pid, [step_item(1, **metrics)], job=job, rank=rank))
            assert reply.status == 200, reply.body
    text = await sidecar.metrics()
    assert len(samples(text)) <= 300
    assert value(text, "sidecar_metrics_series_dropped") > 0 and value(text, "sidecar_metrics_ranks_dropped") > 0
    assert value(text, "sidecar_metrics_series_limit") == 300
    assert 'sidecar_training_step{job_id="small",rank="1"}' in text  # fair: the small job keeps its ranks
    assert 'sidecar_rank_state{job_id="big",rank="39"' not in text
    openmetrics = await sidecar.request("GET", "/metrics", headers={"Accept": "application/openmetrics-text"})
    assert len([line for line in samples(openmetrics.body) if not line.startswith("# EOF")]) <= 300 + 30  # _created


async def test_under_the_budget_nothing_is_left_out(sidecar, child_pid):
    await sidecar.post("/v1/register", registration(child_pid))
    await sidecar.post("/v1/push", push_body(child_pid, [step_item(1, loss=1.0, custom_x=2.0)]))
    text = await sidecar.metrics()
    assert value(text, "sidecar_metrics_series_dropped") == 0
    assert 'sidecar_training_custom{job_id="run-42",name="custom_x",rank="0"} 2.0' in text


async def test_scrapes_in_a_loop_share_one_rendering(serve, child_pid):
    sidecar = await serve(metrics_reuse_seconds=30)
    await sidecar.post("/v1/register", registration(child_pid))
    first = await sidecar.metrics()
    await sidecar.post("/v1/push", push_body(child_pid, [step_item(7)]))
    assert await sidecar.metrics() == first  # rendered less than metrics_reuse_seconds ago
    assert 'sidecar_training_step{job_id="run-42",rank="0"} 7.0' not in first
