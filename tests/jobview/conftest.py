from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.jobview.clusters import SharedRuns


@pytest.fixture(scope="package")
def shared_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedRuns]:
    """Job runs that several tests judge (tests/jobview/clusters.py); whatever is still running
    when the package's tests end is stopped then."""
    runs = SharedRuns(tmp_path_factory)
    try:
        yield runs
    finally:
        runs.close()
