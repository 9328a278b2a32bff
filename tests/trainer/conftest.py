"""Fixtures of the trainer's tests: the reference run (helpers: tests/trainer/helpers.py)."""

from __future__ import annotations

import pytest

from tests.trainer.helpers import Run, torchrun


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Run:
    """The uninterrupted 2-rank run every fault-injected run must match bit for bit."""
    run = torchrun(tmp_path_factory.mktemp("reference"))
    assert run.returncode == 0, run.log[-3000:]
    return run
