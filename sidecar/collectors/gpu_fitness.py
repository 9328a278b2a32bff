"""The GPU side of the node verdict (sidecar/fitness.py): GPUs gone, and GPU memory held by what
outlived its rank.

- Gone: with `collectors.expected_gpus` N > 0, NVML absent or broken is `nvml_unavailable` (not
  a healthy node without GPUs), and fewer than N usable GPUs (NVML lists fewer, or reports some
  lost) is `gpu_missing`.
- Held: a process that held GPU memory while it was in a live rank's process tree (the rank, a
  data-loader or compile worker) and still holds it once no live rank's tree contains it is left
  over. Left-over memory above `gpu_held_budget_bytes` for longer than `gpu_held_grace_seconds`
  is `gpu_held`, naming the pids. A process is known by its pid and start time (a reused pid is
  another process); processes never seen in a rank's tree (another workload, an unhooked job,
  anything before the sidecar started) are not judged.
- "Rank" here is a *verified* rank only (registry.verified_live_pids: the Unix socket's peer, or
  the process found holding its TCP connection). An unverified TCP registration names whatever
  pid it likes: were its pid taken, any local user could name another user's GPU process, then
  re-register the slot, and have the node drained for that process's memory, blaming its owner
  (security issue 28). So an unverified rank neither makes a process a member nor keeps a left-over
  one covered; its owners are not even handed to `observe`.

The GPU collector (or, where dcgm-exporter is the GPU source, `gpu_events.GpuEvents`) calls
`unavailable` or `observe` once a round from its executor thread; `findings` is what the last
round concluded and may be read from any thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import psutil

from sidecar.config import CollectorSettings
from sidecar.fitness import Finding, Reason

MAX_KNOWN = 4096  # GPU processes remembered as rank members (NVML lists are bounded by the GPUs' contexts)
MAX_NAMED = 5  # left-over processes a finding names (all of them are in its pids)
Processes = Iterable[tuple[str, list[tuple[int, int]]]]  # (gpu, [(pid, used bytes)]) per GPU


def create_time(pid: int) -> float | None:
    """With the pid, what names one process (psutil's start time); None when it is gone or a
    zombie (an exited process holds no GPU memory, whether or not NVML still lists it)."""
    try:
        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else p.create_time()
    except (psutil.Error, ValueError):
        return None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


class GpuFitness:
    def __init__(
        self,
        expected_gpus: int = 0,
        held_budget_bytes: int = 0,
        held_grace_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        start_time: Callable[[int], float | None] = create_time,
    ):
        self.expected = expected_gpus
        self.budget, self.grace = held_budget_bytes, held_grace_seconds
        self.clock, self.start_time = clock, start_time
        self._members: dict[int, tuple[float | None, str]] = {}  # pid -> (start time, whose tree it was in)
        self._left_since: dict[int, float] = {}  # left-over pid -> when it was first seen left over
        self._findings: tuple[Finding, ...] = ()

    @classmethod
    def for_settings(cls, cfg: CollectorSettings) -> GpuFitness:
        return cls(cfg.expected_gpus, cfg.gpu_held_budget_bytes, cfg.gpu_held_grace_seconds)

    def findings(self) -> list[Finding]:
        return list(self._findings)

    def unavailable(self, why: str) -> None:
        """NVML could not be used this round (absent or broken): nothing is known of the GPUs."""
        self._members.clear()
        self._left_since.clear()
        self._findings = (
            (
                Finding(
                    Reason.NVML_UNAVAILABLE,
                    f"NVML unavailable on a node that expects {self.expected} GPUs: {why} (check the driver with "
                    "nvidia-smi; in a container, runtimeClassName and NVIDIA_VISIBLE_DEVICES)",
                ),
            )
            if self.expected
            else ()
        )

    def observe(self, count: int, lost: list[str], processes: Processes, owners: dict[int, tuple[str, int]]) -> None:
        """One round: `count` GPUs listed by NVML, `lost` of them unusable, each GPU's compute
        processes, and the verified live ranks' process trees (pid -> (job_id, rank)); never an
        unverified rank's (its pid is only a claim)."""
        found = [self._missing(count, lost)] if self.expected else []
        found += self._held(processes, owners)
        self._findings = tuple(f for f in found if f is not None)

    def _missing(self, count: int, lost: list[str]) -> Finding | None:
        usable = count - len(lost)
        if usable >= self.expected:
            return None
        why = f"NVML lists {count}" + (f", lost: GPU {', '.join(lost)}" if lost else "")
        return Finding(
            Reason.GPU_MISSING,
            f"{usable} of {self.expected} expected GPUs usable ({why}): a GPU fell off the bus (Xid 79) or is "
            "hidden from the sidecar",
        )

    def _held(self, processes: Processes, owners: dict[int, tuple[str, int]]) -> list[Finding]:
        now = self.clock()
        listed: set[int] = set()
        held: dict[int, dict[str, int]] = {}
        for gpu, entries in processes:
            for pid, used in entries:
                listed.add(pid)
                owner = owners.get(pid)
                if owner is not None:
                    if pid not in self._members and len(self._members) < MAX_KNOWN:
                        self._members[pid] = (self.start_time(pid), f"rank {owner[1]} of job {owner[0]}")
                elif pid in self._members:
                    per_gpu = held.setdefault(pid, {})
                    per_gpu[gpu] = per_gpu.get(gpu, 0) + used
        for pid in [p for p in self._members if p not in listed]:
            del self._members[pid]  # it freed its GPU memory (or exited)
        for pid in list(held):
            if self.start_time(pid) != self._members[pid][0]:  # exited, its pid reused
                del held[pid], self._members[pid]
        self._left_since = {pid: self._left_since.get(pid, now) for pid in held}
        overdue = {pid: per_gpu for pid, per_gpu in held.items() if now - self._left_since[pid] >= self.grace}
        total = sum(sum(per_gpu.values()) for per_gpu in overdue.values())
        if not overdue or total <= self.budget:
            return []
        named = [
            f"pid {pid} (was in {self._members[pid][1]}'s tree) "
            + ", ".join(f"{_gib(n)} on GPU {gpu}" for gpu, n in sorted(per_gpu.items()))
            for pid, per_gpu in sorted(overdue.items())[:MAX_NAMED]
        ]
        more = f" and {len(overdue) - MAX_NAMED} more" if len(overdue) > MAX_NAMED else ""
        return [
            Finding(
                Reason.GPU_HELD,
                f"{_gib(total)} of GPU memory held by {len(overdue)} process(es) whose rank is gone: "
                f"{'; '.join(named)}{more}",
                tuple(sorted(overdue)),
            )
        ]
