"""A torchrun job in its own pid namespace (a training pod without `hostPID`), the sidecar
outside it: the ranks register with the pids they see, the sidecar maps them to host pids
through NSpid, and a hang is detected, its stacks captured, the group killed, torchrun (inside
the namespace) restarts it and the run ends with the uninterrupted run's parameters."""

from __future__ import annotations

import pytest

from tests.security.namespaces import UNSHARE, needs_namespaces
from tests.support import Sidecar, spawned
from tests.watchdog import jobs
from tests.watchdog.test_end_to_end import assert_recovered

pytestmark = pytest.mark.slow


def test_a_hang_in_a_job_in_its_own_pid_namespace_is_remediated_and_resumed_exactly(tmp_path, reference_digest):
    needs_namespaces()
    with Sidecar(tmp_path, *jobs.SIDECAR_SETTINGS) as sidecar:
        command = [
            UNSHARE,
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            *jobs.spec(fault="sleep").command(tmp_path),
        ]
        with spawned(command, tmp_path / "torchrun.log", env=sidecar.hook_env()) as proc:
            result = jobs.finish(proc, tmp_path / "torchrun.log")
        incident = assert_recovered(result, reference_digest, sidecar)
        # The ranks were known by their host pids: those are what was signalled.
        (culprit,) = [r for r in incident["ranks"] if r["rank"] == 1]
        sigterm = next(e for e in incident["timeline"] if e["event"] == "sigterm")
        assert culprit["pid"] > 1 and -culprit["pid"] in sigterm["pids"], (culprit, sigterm)
        assert "unverified" not in (tmp_path / "sidecar.log").read_text()
        assert "in its namespace" in (tmp_path / "sidecar.log").read_text()
