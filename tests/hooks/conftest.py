"""Fixtures for the hooks' tests: a real sidecar, background ranks, a hung sidecar."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hooks.helpers import TOKEN, HungServer, RankProcess
from tests.support import Sidecar


@pytest.fixture
def hung_server(tmp_path: Path) -> Iterator[HungServer]:
    server = HungServer(tmp_path / "hung.sock")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """One real sidecar shared by a module's tests; each test uses its own job id. Its push
    API needs TOKEN over TCP, and it allows one custom metric name per job."""
    with Sidecar(
        tmp_path_factory.mktemp("sidecar"),
        "watchdog.observe_only=true",
        "limits.max_custom_metrics=1",
        env={"SIDECAR_TOKEN": TOKEN},
    ) as s:
        yield s


@pytest.fixture
def ranks() -> Iterator[list[RankProcess]]:
    """Background ranks started by a test (append them); all killed at teardown."""
    started: list[RankProcess] = []
    try:
        yield started
    finally:
        for r in started:
            r.kill()
