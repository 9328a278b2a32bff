"""Why a straggler is late, from evidence on its own node (issue 30, item 2): `throttled` when the
CPU cgroup of its process throttles it (cpu.stat's `nr_throttled` and `throttled_time` (v1, ns) /
`throttled_usec` (v2) growing between two looks) or a GPU its processes hold reports a clock-event
reason that costs throughput (the GPU collector's `sidecar_gpu_clock_event_active`: power cap, HW
slowdown, thermal, power brake); `compute` when its node was looked at (two looks at its CPU
cgroup's counters) and nothing holds it down: a straggler enters each collective late, so its own
work between two collectives (compute, data loading, the host code) takes longer than its peers';
`unknown` while it cannot be looked at (not verified, no counters yet). A GPU's clocks held down are
a cause in the hardware (`Cause.hardware`), a CPU quota is the job's own setting: only the first
can mark the node for exclusion at the job's next restart (straggler_incidents.py, opt-in).

Not told apart yet: `link` (a rank that enters on time while the collectives of every group it is a
member of take longer) needs each collective's completion time, which the hooks do not send.

Only a verified rank is looked at (registered over the Unix socket by its own process or an
ancestor, `peer_verified`): an unverified registration names whatever pid it likes. The cgroup is
opened as sidecar/host/cgroups.py opens one (no name trusted, the process listed in it), and the
process must still be the registered one afterwards. A first look only takes the counters: the
cause needs two looks (throttling since the last look, not since the cgroup was made).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric

from sidecar.host import cgroups, procs
from sidecar.ranks.model import Rank, RankKey

SCAN_EVERY_SECONDS = 1.0  # the GPU samples are scanned once per look at the ranks (every few seconds), not per rank
THROTTLED_SHARE = 0.05  # throttled time above this share of the wall time between two looks: `throttled`
CLOCK_EVENT_SAMPLE = "sidecar_gpu_clock_event_active"
# clock-event reasons that hold a busy GPU's clocks down (gpu_idle, sync_boost and the clock settings do not)
SLOWING_REASONS = frozenset(
    {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
)
GpuReasons = Mapping[str, Iterable[str]]  # gpu -> its active slowing reasons


@dataclass(frozen=True)
class CpuStat:
    periods: int
    throttled: int  # periods throttled
    throttled_seconds: float
    at: float  # monotonic


@dataclass(frozen=True)
class Cause:
    cause: str  # "throttled", "compute" or "unknown"
    evidence: str  # in words, for people
    hardware: bool = False  # the cause is in the node's hardware (a GPU's clocks held down), not the job's settings


def cpu_stat(pid: int, started: float | None, procfs: str = "/proc", clock: Callable[[], float] = time.monotonic):
    """The throttling counters of `pid`'s CPU cgroup, or None (no cgroup, no cpu.stat, not the process)."""
    found = cgroups.cgroup_of(pid, "cpu", procfs)
    if found is None:
        return None
    try:
        text = found.read("cpu.stat")
    finally:
        found.close()
    if text is None or not procs.is_same_process(pid, started):
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            values[name] = int(value)
    if "nr_throttled" not in values:
        return None
    if "throttled_usec" in values:  # v2
        seconds = values["throttled_usec"] / 1e6
    else:  # v1
        seconds = values.get("throttled_time", 0) / 1e9
    return CpuStat(values.get("nr_periods", 0), values["nr_throttled"], seconds, clock())


class Causes:
    """Each looked-at rank's last counters, and its cause between two looks."""

    def __init__(self, procfs: str = "/proc", clock: Callable[[], float] = time.monotonic):
        self.procfs, self.clock = procfs, clock
        self._last: dict[RankKey, tuple[Rank, CpuStat]] = {}

    def look(self, rank: Rank, gpus: GpuReasons | None = None) -> Cause:
        """Its cause now: the CPU cgroup's throttling since the last look, and the slowing
        clock-event reasons of the GPUs its processes hold (`gpus`, None: not known)."""
        if not rank.peer_verified or rank.gone:
            return Cause("unknown", "not a verified rank: its process is not looked at")
        cpu = self._cpu(rank)
        slowed = [f"GPU {g} clocks held down ({', '.join(sorted(r))})" for g, r in sorted((gpus or {}).items()) if r]
        if cpu.cause == "throttled" or slowed:
            evidence = "; ".join(([cpu.evidence] if cpu.cause == "throttled" else []) + slowed)
            return Cause("throttled", evidence, hardware=bool(slowed))
        gpu_words = "; its GPUs' clocks not held down" if gpus else ""
        if cpu.cause == "compute":
            return Cause("compute", cpu.evidence + gpu_words + ": its own work between collectives is slower")
        return Cause("unknown", cpu.evidence + gpu_words)

    def _cpu(self, rank: Rank) -> Cause:
        now = cpu_stat(rank.pid, rank.pid_start_time, self.procfs, self.clock)
        if now is None:
            self._last.pop(rank.key, None)
            return Cause("unknown", "no CPU cgroup counters for its process")
        before = self._last.get(rank.key)
        self._last[rank.key] = (rank, now)
        if before is None or before[0] is not rank:
            return Cause("unknown", "CPU cgroup counters taken; throttling is judged from the next look")
        then = before[1]
        wall = now.at - then.at
        seconds = now.throttled_seconds - then.throttled_seconds
        periods = now.throttled - then.throttled
        if wall > 0 and periods > 0 and seconds / wall > THROTTLED_SHARE:
            return Cause(
                "throttled",
                f"CPU cgroup throttled {seconds:.2f} s in {wall:.0f} s ({periods} of "
                f"{now.periods - then.periods} periods)",
            )
        return Cause("compute", f"CPU cgroup not throttled over {wall:.0f} s")

    def forget(self, keep: set[RankKey]) -> None:
        for key in [k for k in self._last if k not in keep]:
            del self._last[key]


def all_gpu_reasons(families: Iterable[Metric]) -> dict[str, list[str]]:
    """gpu -> its active slowing clock-event reasons, for every GPU the families show."""
    out: dict[str, list[str]] = {}
    for family in families:
        for sample in family.samples:
            if sample.name != CLOCK_EVENT_SAMPLE or sample.value != 1:
                continue
            gpu, reason = sample.labels.get("gpu"), sample.labels.get("reason")
            if gpu is not None and reason in SLOWING_REASONS:
                out.setdefault(gpu, []).append(reason)
    return out


def gpu_reasons(families: Iterable[Metric], held: Iterable[str]) -> dict[str, list[str]]:
    """gpu -> its active slowing clock-event reasons, for the GPUs in `held` (a rank's)."""
    reasons = all_gpu_reasons(families)
    return {g: list(reasons.get(g, [])) for g in set(held)}


def gpus_of(
    families: Callable[[], Iterable[Metric]], collector: object | None
) -> Callable[[RankKey], dict[str, list[str]] | None]:
    """A rank's GPUs (the gpu collector's `rank_gpus`: the GPUs its verified processes held in the
    last round) with their slowing clock-event reasons; None without the collector or a GPU held."""

    scanned: dict[str, Any] = {"at": -SCAN_EVERY_SECONDS, "reasons": {}}

    def of(key: RankKey) -> dict[str, list[str]] | None:
        held = getattr(collector, "rank_gpus", {}).get(key) if collector is not None else None
        if not held:
            return None
        now = time.monotonic()
        if now - scanned["at"] >= SCAN_EVERY_SECONDS:  # one pass over the samples per look at the ranks
            scanned["at"], scanned["reasons"] = now, all_gpu_reasons(families())
        reasons: dict[str, list[str]] = scanned["reasons"]
        return {g: list(reasons.get(g, [])) for g in held}

    return of
