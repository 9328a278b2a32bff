"""NVML calls per GPU per collector round, counted at pynvml's symbol lookup, so the same count
works over the real libnvidia-ml (bench/gpu_check.py) and over the fake one (the benchmarks).

    python -m bench.nvml_calls          # 8 fake GPUs with 18 NVLinks: healthy, then a field failing

A round reads the fast fields; every nvml.HEALTH_SECONDS a round also reads the health fields.
The steady state per round is fast + health x interval / HEALTH_SECONDS.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sidecar.collectors import nvml as nvml_session  # noqa: E402
from sidecar.collectors.base import PartialFailure  # noqa: E402
from sidecar.collectors.gpu import GpuCollector  # noqa: E402


class _Counted:
    """A C function pointer that counts its calls (and passes `restype` through)."""

    def __init__(self, fn: Any, name: str, calls: Counter):
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_calls", calls)

    def __call__(self, *args: Any) -> Any:
        self._calls[self._name] += 1
        return self._fn(*args)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._fn, name, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


class CallCounter:
    """`with CallCounter(pynvml) as counter:` ... `counter.calls` by C symbol."""

    def __init__(self, nv: ModuleType):
        self.nv: Any = sys.modules[nv.nvmlInit.__module__]  # pynvml itself, also under the fake library module
        self.calls: Counter[str] = Counter()
        self._lookup: Any = None

    def __enter__(self) -> CallCounter:
        self._lookup = lookup = self.nv._nvmlGetFunctionPointer
        calls = self.calls

        def counting(name: str) -> Any:
            return _Counted(lookup(name), name, calls)

        self.nv._nvmlGetFunctionPointer = counting
        return self

    def __exit__(self, *exc: object) -> None:
        self.nv._nvmlGetFunctionPointer = self._lookup

    def total(self) -> int:
        return sum(self.calls.values())


@dataclass
class RoundCost:
    gpus: int
    fast_calls: float  # per GPU, a round between health reads
    health_calls: float  # per GPU, a round that also reads the health fields
    fast_ms: float  # wall time per GPU
    health_ms: float

    def steady_calls(self, interval: float) -> float:
        every = max(1.0, nvml_session.HEALTH_SECONDS / interval)
        return self.fast_calls + (self.health_calls - self.fast_calls) / every

    def line(self, interval: float) -> str:
        return (
            f"NVML calls per GPU per round: {self.fast_calls:.1f} (fast round), {self.health_calls:.1f} "
            f"(round with the {nvml_session.HEALTH_SECONDS:.0f}-s health read), steady state "
            f"{self.steady_calls(interval):.1f} at a {interval:g} s interval; "
            f"round time per GPU {self.fast_ms:.2f} ms fast, {self.health_ms:.2f} ms with health"
        )


def measure(module_name: str, rounds: int = 5) -> RoundCost:
    """Run a GPU collector on `module_name` (pynvml, or the fake library module) and count."""
    collector = GpuCollector(module_name, list, xid_events=False)
    try:
        if not collector.session.start():
            raise RuntimeError(collector.session.broken or "no NVIDIA GPUs")
        nv = collector.session.nv
        assert nv is not None  # start() succeeded
        gpus = collector.session.count
        collector.collect()  # the first round: static facts and the health read
        fast, fast_s = _rounds(collector, nv, rounds, health=False)
        health, health_s = _rounds(collector, nv, rounds, health=True)
        n = max(1, gpus) * rounds
        return RoundCost(gpus, fast / n, health / n, fast_s * 1000 / n, health_s * 1000 / n)
    finally:
        collector.close()


def _rounds(collector: GpuCollector, nv: ModuleType, rounds: int, health: bool) -> tuple[int, float]:
    session = collector.session
    saved = session.health_seconds
    session.health_seconds = 0.0 if health else 3600.0
    try:
        with CallCounter(nv) as counter:
            start = time.perf_counter()
            for _ in range(rounds):
                try:
                    collector.collect()
                except PartialFailure:  # a lost GPU: still a round
                    pass
            return counter.total(), time.perf_counter() - start
    finally:
        session.health_seconds = saved


def fake_machine(spec: dict) -> RoundCost:
    from sidecar.testing import fake_nvml_lib

    fake_nvml_lib.configure(spec)
    quiet = logging.getLogger("sidecar.collectors")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the failing fields' one log line is not a figure
    try:
        return measure("sidecar.testing.fake_nvml_lib")
    finally:
        quiet.setLevel(level)
        fake_nvml_lib.uninstall()


HEALTHY = {"gpu_count": 8, "gpu": {"nvlink_links": 18, "processes": [{"pid": 1, "used_memory_bytes": 1}]}}
FAILING = {
    "gpu_count": 8,
    "gpu": {
        "nvlink_links": 18,
        "processes": [{"pid": 1, "used_memory_bytes": 1}],
        "errors": {"nvmlDeviceGetTotalEnergyConsumption": "not_ready", "nvmlDeviceGetRemappedRows": "no_permission"},
    },
}


def report(interval: float) -> list[str]:
    healthy, failing = fake_machine(HEALTHY), fake_machine(FAILING)
    return [
        "nvml (8 fake GPUs, real pynvml): " + healthy.line(interval),
        "  with energy NOT_READY and remapped rows NO_PERMISSION on every GPU, every round: " + failing.line(interval),
    ]


if __name__ == "__main__":
    for line in report(interval=5.0):
        print(line)
