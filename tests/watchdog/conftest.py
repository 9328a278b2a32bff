"""Fixtures for the watchdog's unit-level tests: real processes standing in for ranks, a real
Registry, and a clock the test moves by hand (helpers: tests/watchdog/helpers.py)."""

from __future__ import annotations

import pytest

from tests.watchdog import helpers
from tests.watchdog.helpers import HUNG_RANK, FakeClock


@pytest.fixture
def clock():
    """A fake clock; the ranks the helpers register meanwhile start at its time, not the real
    clock's (under load the two drift apart between the fixture and the registration)."""
    fake = FakeClock()
    helpers.CURRENT_CLOCK = fake
    yield fake
    helpers.CURRENT_CLOCK = None


@pytest.fixture
def hung_rank(spawn, tmp_path):
    """Start a stand-in rank; returns (process, stack file)."""
    from tests.support import PYTHON, wait_until

    count = [0]

    def start(*flags: str):
        count[0] += 1
        path = tmp_path / f"rank{count[0]}.stacks"
        p = spawn([PYTHON, "-c", HUNG_RANK, str(path), *flags])
        wait_until(lambda: (tmp_path / (path.name + ".ready")).exists(), 30, what="stand-in rank ready")
        return p, path

    return start


@pytest.fixture(scope="session")
def reference_digest(tmp_path_factory, worker_id) -> str:
    """The parameters' digest of the uninterrupted 16-step run, computed once per test session
    (shared between xdist workers through a lock file)."""
    from filelock import FileLock

    from tests.watchdog import jobs

    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent  # the session's directory, shared by its workers
    with FileLock(str(root / "watchdog-reference.lock")):
        cached = root / "watchdog-reference.digest"
        if cached.exists():
            return cached.read_text()
        workdir = root / "watchdog-reference"
        result = jobs.run(jobs.spec(), workdir, env={"SIDECAR_SOCKET": str(workdir / "no-sidecar.sock")})
        assert result.returncode == 0 and result.digest, result.explain()
        cached.write_text(result.digest)
        return result.digest
