"""Processes that outlived SIGKILL: the outcome `unkillable`, what each one is doing, and the
watch until they are gone.

Remediation (remediation.py) hands over the ranks and group members still alive after the grace,
SIGKILL and `remediation.kill_wait_seconds`. `Unkillable.record` reads what the kernel says of
each (sidecar/host/stuck.py: state, wait channel, kernel stack, freezer cgroup, GPU device files)
and the GPU memory NVML lists for it (`gpu_memory`, fed by the GPU collector where it runs),
writes it into the incident (its `unkillable` list and an `unkillable` event) and keeps watching:
`check`, called on every watchdog tick, records in the incident when the last of them is gone
(`unkillable_gone`) and saves it again. Until then `findings` makes the node unfit
(sidecar/fitness.py): the next job started here would find its GPUs or its processes held.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.fitness import Finding, Reason
from sidecar.host import stuck
from sidecar.incidents.store import Incident

log = logging.getLogger(__name__)

MAX_DESCRIBED = 64  # processes of one incident whose facts (kernel stacks included) are recorded
MAX_WATCHED = 1024  # processes of one incident watched until they go (a liveness check each per tick)
OUTCOME = "unkillable"

# What remediation hands over of each process left: its pid, who it is ("rank 3", "pid 77 of
# rank 3's group") and whether it still runs (the same identity check remediation used).
Left = tuple[int, str, Callable[[], bool]]
GpuMemory = Callable[[], dict[int, dict[str, int]]]  # pid -> {gpu: bytes}, from NVML's process lists


@dataclass
class _Watch:
    incident: Incident
    pids: list[int]  # every process remediation gave up on
    left: list[Left]  # those still alive, as last checked
    since: float  # Unix time remediation gave up on them
    why: str  # the first one's facts, for the finding


class Unkillable:
    def __init__(self) -> None:
        self._watches: list[_Watch] = []
        self.gpu_memory: GpuMemory | None = None  # the daemon wires the GPU collector's

    async def record(self, incident: Incident, left: list[Left]) -> str:
        """Describe the processes `left` in `incident`, watch them until they go; the outcome."""
        loop = asyncio.get_running_loop()
        memory = self._memory()
        described = []
        for pid, who, _ in left[:MAX_DESCRIBED]:
            facts = await loop.run_in_executor(None, stuck.describe, pid)
            facts.gpu_memory_bytes = memory.get(pid, {})
            described.append({"who": who, **facts.as_dict()})
        pids = [pid for pid, _, _ in left]
        incident.unkillable = described
        incident.event("unkillable", pids=pids)
        first = described[0] if described else {"who": "?", "pid": "?", "why": "?"}
        self._watches.append(
            _Watch(
                incident,
                pids,
                list(left[:MAX_WATCHED]),
                time.time(),
                f"{first['who']} (pid {first['pid']}): {first['why']}",
            )
        )
        log.error(
            "job %s: %d process(es) alive after SIGKILL, node unfit until they go: %s",
            incident.job_id,
            len(left),
            "; ".join(f"{d['who']} (pid {d['pid']}): {d['why']}" for d in described[:3]),
        )
        return OUTCOME

    def _memory(self) -> dict[int, dict[str, int]]:
        if self.gpu_memory is None:
            return {}
        try:
            return self.gpu_memory()
        except Exception:  # the GPU collector's state must never stop a remediation
            log.exception("reading GPU memory per process failed")
            return {}

    def check(self, save: Callable[[Incident], None]) -> None:
        """Forget the processes that are gone; an incident whose last one went records when."""
        for watch in list(self._watches):
            alive = [entry for entry in watch.left if _still_alive(entry)]
            if alive:
                watch.left = alive
                continue
            self._watches.remove(watch)
            watch.incident.event(
                "unkillable_gone", gone_after_seconds=round(time.time() - watch.since, 3), pids=watch.pids
            )
            save(watch.incident)
            log.warning("job %s: the processes that outlived SIGKILL are gone", watch.incident.job_id)

    def findings(self) -> list[Finding]:
        """What keeps the node unfit; read from other threads too (/metrics renders in its own)."""
        now = time.time()
        return [
            Finding(
                Reason.UNKILLABLE,
                f"{len(w.left)} process(es) of job {w.incident.job_id} alive after SIGKILL for {now - w.since:.0f}s "
                f"({w.why}; incident {w.incident.id})",
                tuple(pid for pid, _, _ in w.left),
            )
            for w in list(self._watches)
        ]


def _still_alive(entry: Left) -> bool:
    try:
        return entry[2]()
    except Exception:  # a liveness check that fails says nothing: keep watching
        log.exception("checking whether pid %d still runs failed", entry[0])
        return True
