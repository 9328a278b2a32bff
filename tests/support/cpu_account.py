"""CPU time per test, for finding where the suite's work goes (issue 33): with
`SUITE_CPU_DIR=<dir>` set, each pytest process (each xdist worker) moves itself into a cgroup v1
`cpuacct` group of its own, so every process a test starts (sidecars, torchrun and its workers,
Prometheus) is counted with it, reaped or not; a worker runs one test at a time, so the group's
usage across a test's setup, call and teardown is that test's (a process a test leaks is charged
to the tests after it). One JSON line per test is appended to `<dir>/<worker>.jsonl`: give each run
a fresh directory; `python scripts/suite_cpu.py <dir>` sums them. Off (and free) when unset."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class CpuAccount:
    def __init__(self, out_dir: Path, worker: str) -> None:
        self.group = CPUACCT / f"sidecar-suite-{os.getpid()}"
        try:
            self.group.mkdir(exist_ok=True)
            (self.group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as e:
            raise pytest.UsageError(f"SUITE_CPU_DIR needs a cpuacct group of its own (root): {e}") from None
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out = (out_dir / f"{worker}.jsonl").open("a")

    def usage(self) -> float:
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item):
        cpu, wall = self.usage(), time.monotonic()
        yield
        cpu, wall = self.usage() - cpu, time.monotonic() - wall
        record = {"test": item.nodeid, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3)}
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.out.close()
        root = CPUACCT / "cgroup.procs"
        try:  # back to the root so the group can go; processes a test leaked keep it alive
            root.write_text(str(os.getpid()))
            self.group.rmdir()
        except OSError:
            pass


def register(config: pytest.Config) -> None:
    out = os.environ.get("SUITE_CPU_DIR")
    if not out:
        return
    if not CPUACCT.is_dir():
        raise pytest.UsageError(f"SUITE_CPU_DIR needs cgroup v1 cpuacct at {CPUACCT}")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    config.pluginmanager.register(CpuAccount(Path(out), worker), "cpu-account")
