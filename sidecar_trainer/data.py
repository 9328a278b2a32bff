"""Deterministic data order that survives restarts.

Each epoch is a permutation of the dataset seeded by (seed, epoch). An optimizer step takes the
next `global_batch_size` indices of it; rank r's micro-batch m of the step is a fixed slice of
those. The position in the data is therefore two numbers, (epoch, steps into the epoch), and does
not depend on the world size: a checkpoint records it and a resumed run starts right there.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


@dataclass
class DataPosition:
    epoch: int = 0
    step_in_epoch: int = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch}

    @classmethod
    def from_state_dict(cls, state: dict) -> DataPosition:
        return cls(int(state["epoch"]), int(state["step_in_epoch"]))


class StepBatchSampler(Sampler[list[int]]):
    """Micro-batches of one rank for one epoch, from step `start_step` of that epoch on."""

    def __init__(
        self,
        dataset_size: int,
        seed: int,
        epoch: int,
        start_step: int,
        global_batch: int,
        micro_batch: int,
        rank: int,
        world_size: int,
    ) -> None:
        self.steps = dataset_size // global_batch
        if self.steps == 0:
            raise ValueError(f"dataset of {dataset_size} samples is smaller than one global batch ({global_batch})")
        self.seed, self.epoch, self.start_step = seed, epoch, start_step
        self.size, self.global_batch, self.micro = dataset_size, global_batch, micro_batch
        self.rank, self.world = rank, world_size

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 100_003 + self.epoch))
        accum = self.global_batch // (self.micro * self.world)
        for step in range(self.start_step, self.steps):
            base = step * self.global_batch
            for m in range(accum):
                lo = base + (m * self.world + self.rank) * self.micro
                yield order[lo : lo + self.micro].tolist()

    def __len__(self) -> int:
        return (self.steps - self.start_step) * (self.global_batch // (self.micro * self.world))


class StepBatches:
    """Yields, step after step, the list of micro-batches this rank trains on, and the data position
    after that step. Crosses epoch boundaries on its own; a fresh DataLoader starts each epoch."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        seed: int,
        global_batch: int,
        micro_batch: int,
        accum: int,
        rank: int,
        world_size: int,
        num_workers: int,
        delay_seconds: float,
        position: DataPosition,
    ) -> None:
        self.dataset, self.seed = dataset, seed
        self.global_batch, self.micro, self.accum = global_batch, micro_batch, accum
        self.rank, self.world = rank, world_size
        self.num_workers, self.delay = num_workers, delay_seconds
        self.position = DataPosition(position.epoch, position.step_in_epoch)
        self.steps_per_epoch = len(dataset) // global_batch  # type: ignore[arg-type]
        if self.steps_per_epoch == 0:
            raise ValueError(f"dataset of {len(dataset)} samples is smaller than one global batch ({global_batch})")  # type: ignore[arg-type]
        self._it: Iterator | None = None

    def _loader(self) -> Iterator:
        sampler = StepBatchSampler(
            len(self.dataset),  # type: ignore[arg-type]
            self.seed,
            self.position.epoch,
            self.position.step_in_epoch,
            self.global_batch,
            self.micro,
            self.rank,
            self.world,
        )
        # The generator keeps the DataLoader from drawing its worker seed from the global RNG, which
        # would shift the dropout stream of an uninterrupted run against a resumed one.
        gen = torch.Generator().manual_seed(self.seed * 7919 + self.position.epoch)
        return iter(
            DataLoader(
                self.dataset,
                batch_sampler=sampler,
                num_workers=self.num_workers,
                generator=gen,
                persistent_workers=False,
            )
        )

    def next_step(self) -> tuple[list, DataPosition]:
        """The micro-batches of the next step, and the position once it is done."""
        if self.delay:
            time.sleep(self.delay)
        if self.position.step_in_epoch >= self.steps_per_epoch:
            self.position = DataPosition(self.position.epoch + 1, 0)
            self._it = None
        if self._it is None:
            self._it = self._loader()
        batches = [next(self._it) for _ in range(self.accum)]
        self.position = DataPosition(self.position.epoch, self.position.step_in_epoch + 1)
        return batches, DataPosition(self.position.epoch, self.position.step_in_epoch)
