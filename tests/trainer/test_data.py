"""Data order: a function of (seed, epoch, step), not of the world size or of restarts."""

from __future__ import annotations

import torch

from sidecar_trainer.data import DataPosition, StepBatches
from sidecar_trainer.demo import TeacherDataset


def batches(world: int, rank: int, position: DataPosition | None = None, seed=0, size=96, global_batch=16, micro=4):
    return StepBatches(
        TeacherDataset(seed, size=size, features=4),
        seed=seed,
        global_batch=global_batch,
        micro_batch=micro,
        accum=global_batch // (micro * world),
        rank=rank,
        world_size=world,
        num_workers=0,
        delay_seconds=0,
        position=DataPosition() if position is None else position,
    )


def samples_of_step(world: int, steps: int) -> list[set]:
    """Per step, the set of input rows all ranks together train on."""
    loaders = [batches(world, r) for r in range(world)]
    out = []
    for _ in range(steps):
        rows = set()
        for loader in loaders:
            micro_batches, _ = loader.next_step()
            for x, _y in micro_batches:
                rows |= {tuple(row.tolist()) for row in x}
        out.append(rows)
    return out


def test_a_sample_depends_only_on_seed_and_index():
    a, b = TeacherDataset(3, size=10), TeacherDataset(3, size=10)
    assert torch.equal(a[7][0], b[7][0]) and not torch.equal(a[7][0], a[6][0])
    assert not torch.equal(a[7][0], TeacherDataset(4, size=10)[7][0])


def test_the_global_batch_of_each_step_does_not_depend_on_the_world_size():
    assert samples_of_step(world=1, steps=8) == samples_of_step(world=2, steps=8)


def test_ranks_train_on_disjoint_shards_of_the_global_batch():
    rank0, rank1 = batches(2, 0).next_step()[0], batches(2, 1).next_step()[0]
    rows0 = {tuple(r.tolist()) for x, _ in rank0 for r in x}
    rows1 = {tuple(r.tolist()) for x, _ in rank1 for r in x}
    assert len(rows0) == len(rows1) == 8 and not rows0 & rows1


def test_a_loader_started_at_a_saved_position_continues_exactly_across_epochs():
    straight = batches(2, 1)
    for _ in range(4):
        straight.next_step()
    saved = straight.position  # 96 samples / 16 per step = 6 steps per epoch

    resumed = batches(2, 1, position=DataPosition.from_state_dict(saved.state_dict()))
    for _ in range(5):  # into the next epoch, with its own permutation
        (expected, pos_a), (got, pos_b) = straight.next_step(), resumed.next_step()
        assert pos_a == pos_b
        assert all(
            torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(expected, got, strict=True)
        )
    assert resumed.position == DataPosition(epoch=1, step_in_epoch=3)
