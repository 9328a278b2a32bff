"""The demo workload: a small MLP classifier with dropout and a synthetic dataset in which
sample i is computed from (seed, i) alone, so any subset can be regenerated in any order."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset


class TeacherDataset(Dataset):
    """Gaussian inputs labelled by a fixed random linear "teacher": learnable, cheap, deterministic.
    The teacher (the task) is the same for every seed; the seed picks the samples, so seed + 1 is a
    held-out set of the same task."""

    def __init__(self, seed: int, size: int = 4096, features: int = 32, classes: int = 8) -> None:
        self.seed, self.size, self.features = seed, size, features
        self.teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(20261202))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        # One generator per sample: the sample depends on (seed, index) only, never on who asks or when.
        gen = torch.Generator().manual_seed((self.seed + 1) * 1_000_003 + index)
        x = torch.randn(self.features, generator=gen)
        return x, (x @ self.teacher).argmax()


class MLP(nn.Module):
    def __init__(
        self, features: int = 32, hidden: int = 64, classes: int = 8, layers: int = 2, dropout: float = 0.1
    ) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        width = features
        for _ in range(layers):
            blocks.append(nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout)))
            width = hidden
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(width, classes)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.blocks(inputs)), targets)


def build_model(**kwargs) -> nn.Module:
    return MLP(**kwargs)


def build_dataset(seed: int, **kwargs) -> Dataset:
    return TeacherDataset(seed, **kwargs)
