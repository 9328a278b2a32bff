"""Fixtures of the operator-side tests (helpers: tests/ops/helpers.py)."""

from __future__ import annotations

import pytest

from tests.ops.helpers import Rank
from tests.support import Sidecar


@pytest.fixture
def ranks():
    """Ranks a test registers; their processes are killed at teardown."""
    made: list[Rank] = []

    def make(sidecar: Sidecar, job_id: str, rank: int, versions: dict | None = None) -> Rank:
        r = Rank(sidecar, job_id, rank, versions)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()
