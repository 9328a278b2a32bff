"""Fixtures every test area may use."""

from __future__ import annotations

import subprocess

import pytest

from tests.support import kill_tree


@pytest.fixture
def spawn():
    """Start real processes (standing in for ranks) in their own session, as torchrun starts
    workers; all killed, with their children, at teardown."""
    started: list[subprocess.Popen] = []

    def start(cmd: list[str] | None = None) -> subprocess.Popen:
        p = subprocess.Popen(cmd or ["sleep", "600"], start_new_session=True)
        started.append(p)
        return p

    yield start
    for p in started:
        kill_tree(p)


def pytest_configure(config: pytest.Config) -> None:
    from tests.cpu_account import register

    register(config)
