"""A preflight check's `Result` and outcomes, what every check is given (`Context`), and the
exit status the results make."""

from __future__ import annotations

import argparse
import threading
from dataclasses import dataclass, field

from sidecar.config import Settings
from sidecar.preflight.facts import NvmlFacts, read_nvml

PASS, SKIP, WARN, FAIL = "PASS", "SKIP", "WARN", "FAIL"
SEVERITY = {PASS: 0, SKIP: 0, WARN: 1, FAIL: 2}


@dataclass
class Result:
    check: str
    outcome: str
    detail: str
    hint: str = ""


@dataclass
class Context:
    args: argparse.Namespace
    settings: Settings
    _nvml: NvmlFacts | None = None
    _nvml_lock: threading.Lock = field(default_factory=threading.Lock)

    def nvml(self) -> NvmlFacts:
        """NVML's facts, read once and shared by the GPU checks (which run in parallel)."""
        with self._nvml_lock:
            if self._nvml is None:
                self._nvml = read_nvml(self.settings.collectors.nvml_module)
            return self._nvml


def exit_code(results: list[Result], strict: bool) -> int:
    worst = max((SEVERITY[r.outcome] for r in results), default=0)
    return 1 if worst == 2 or (strict and worst == 1) else 0
