"""Every random stream a rank draws from, captured and restored as plain tensors and lists (so a
checkpoint loads with `torch.load(weights_only=True)`)."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_rank(seed: int, rank: int) -> None:
    """Distinct, reproducible streams per rank (dropout masks differ between ranks, as they should)."""
    stream = seed * 1_000_003 + rank
    random.seed(stream)
    np.random.seed(stream % 2**32)
    torch.manual_seed(stream)


def capture() -> dict:
    version, state, gauss = random.getstate()
    legacy = np.random.get_state()
    assert isinstance(legacy, tuple)  # legacy=True, the default: (name, keys, pos, has_gauss, cached)
    name, keys, pos, has_gauss, cached = legacy
    out = {
        "python": [version, list(state), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore(state: dict) -> None:
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
