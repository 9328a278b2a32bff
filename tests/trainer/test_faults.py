"""Fault injection fires on the configured rank, step and attempt only."""

from __future__ import annotations

from sidecar_trainer.config import FaultConfig
from sidecar_trainer.faults import FaultInjector


def injector(rank=1, restart_count=0, generation=1, **cfg) -> FaultInjector:
    return FaultInjector(
        FaultConfig(**{"kind": "sleep", "rank": 1, "at_step": 3, "sleep_seconds": 0, **cfg}),
        rank=rank,
        restart_count=restart_count,
        generation=generation,
    )


def test_a_fault_is_armed_only_on_its_rank():
    assert injector(rank=1).armed and not injector(rank=0).armed


def test_a_fault_fires_only_in_the_first_attempt_by_default():
    assert not injector(restart_count=1).armed
    assert injector(restart_count=1, only_first_attempt=False).armed


def test_a_fault_fires_at_its_step_only(caplog):
    inj = injector()
    for step in (1, 2, 3, 4):
        inj.before_allreduce(step)
    assert caplog.text.count("fault injection: sleep on rank 1 at step 3") == 1


def test_the_checkpoint_fault_targets_the_first_save_at_or_after_its_step():
    inj = injector(kind="sigkill_in_checkpoint", at_step=12)
    assert inj.checkpoint_interrupt(10) is None
    assert callable(inj.checkpoint_interrupt(15))


def test_a_fetch_passes_through_when_no_fault_is_due():
    assert injector(kind="dataloader").fetch(2, lambda: "batches") == "batches"


def test_a_later_generation_counts_as_a_restart_even_where_the_restart_count_is_still_zero():
    assert not injector(restart_count=0, generation=2).armed
