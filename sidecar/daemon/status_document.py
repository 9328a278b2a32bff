"""The `/v1/status` document (docs/architecture/wire-protocol.md): the node at a glance, built from the
settings, the rank registry, the collectors' latest families and the watchdog.

Hardware facts are read back out of the families the collectors already produced (by
sample name and labels), so the JSON and `/metrics` can never disagree.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import socket
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import Metric

from sidecar import __version__
from sidecar.collectors.base import CollectorRunner
from sidecar.config import Settings
from sidecar.exits.tracker import ExitTracker
from sidecar.fitness import Fitness
from sidecar.jobview import straggler_incidents, stragglers
from sidecar.jobview.golive import shown as golive_shown
from sidecar.jobview.reporter import Reporter
from sidecar.problems import Kind, Problem, merged, restart_trap
from sidecar.ranks import lateness, slurmjob
from sidecar.ranks.model import Rank
from sidecar.ranks.registry import Registry
from sidecar.watchdog.machine import Watchdog

UNHEALTHY_RANK_STATES = ("suspect", "stalled", "remediating")
INCIDENTS_SHOWN = 5
# InfiniBand port states (sysfs `state`: "4: ACTIVE").
IB_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}


class Samples:
    """The samples of a set of metric families, looked up by sample name and labels."""

    def __init__(self, families: Iterable[Metric]):
        self._by_name: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in families:
            for s in family.samples:
                self._by_name[s.name].append((s.labels, s.value))

    def all(self, name: str) -> list[tuple[dict[str, str], float]]:
        return self._by_name.get(name, [])

    def value(self, name: str, **labels: str) -> float | None:
        """The first sample of `name` whose labels include `labels`, or None."""
        for have, value in self.all(name):
            if all(have.get(k) == v for k, v in labels.items()):
                return finite(value)
        return None

    def total(self, name: str, **labels: str) -> float | None:
        """The sum over every sample of `name` matching `labels`; None when there are none."""
        values = [v for have, v in self.all(name) if all(have.get(k) == w for k, w in labels.items())]
        return sum(values) if values else None

    def label_values(self, name: str, label: str) -> list[str]:
        return sorted({have[label] for have, _ in self.all(name) if label in have})


def finite(value: Any) -> Any:
    """JSON has no NaN or infinity: report them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


@functools.lru_cache(maxsize=1)
def os_name() -> str:
    try:
        with open("/etc/os-release") as f:
            for line in f:
                key, _, value = line.strip().partition("=")
                if key == "PRETTY_NAME":
                    return value.strip('"')
    except OSError:
        pass
    return platform.system()


def _gpu_sort_key(gpu: str) -> tuple[int, str]:
    return (int(gpu), gpu) if gpu.isdigit() else (1 << 30, gpu)


# ---------------------------------------------------------------- sections


def node_section(settings: Settings, s: Samples) -> dict:
    versions = s.all("sidecar_versions_info")
    labels = versions[0][0] if versions else {}
    return {
        "name": settings.node_name,
        "hostname": socket.gethostname(),
        "kernel": labels.get("kernel") or platform.release(),
        "os": labels.get("os") or os_name(),
        "cpu_utilization_ratio": s.value("sidecar_node_cpu_utilization_ratio"),
        "memory_total_bytes": _int(s.value("sidecar_node_memory_total_bytes")),
        "memory_available_bytes": _int(s.value("sidecar_node_memory_available_bytes")),
        # absolute (a relative setting names a directory from the sidecar's own), None when unset
        "checkpoint_dir": os.path.abspath(settings.checkpoint_dir) if settings.checkpoint_dir else None,
        "diag_dir": str(settings.diagnostics_dir),  # where its incidents are (`sidecar incidents` reads it)
        "checkpoint_avail_bytes": _int(s.value("sidecar_checkpoint_filesystem_avail_bytes")),
        "gpu_source": settings.collectors.gpu_source,  # "dcgm": dcgm-exporter reads the GPUs, not this daemon
        "driver_version": labels.get("driver_version") or None,
        "cuda_version": labels.get("cuda_version") or None,
    }


def gpus_section(s: Samples) -> list[dict]:
    info = {labels["gpu"]: labels for labels, _ in s.all("sidecar_gpu_info") if "gpu" in labels}
    gpus = set(info) | set(s.label_values("sidecar_gpu_utilization_ratio", "gpu"))
    out = []
    for gpu in sorted(gpus, key=_gpu_sort_key):
        meta = info.get(gpu, {})
        out.append(
            {
                "gpu": gpu,
                "name": meta.get("name"),
                "uuid": meta.get("uuid"),
                "utilization_ratio": s.value("sidecar_gpu_utilization_ratio", gpu=gpu),
                "memory_used_bytes": _int(s.value("sidecar_gpu_memory_used_bytes", gpu=gpu)),
                "memory_total_bytes": _int(s.value("sidecar_gpu_memory_total_bytes", gpu=gpu)),
                "temperature_celsius": s.value("sidecar_gpu_temperature_celsius", gpu=gpu),
                "slowdown_temperature_celsius": s.value("sidecar_gpu_slowdown_temperature_celsius", gpu=gpu),
                "power_watts": s.value("sidecar_gpu_power_watts", gpu=gpu),
                "clock_events": sorted(
                    labels["reason"]
                    for labels, v in s.all("sidecar_gpu_clock_event_active")
                    if labels.get("gpu") == gpu and v == 1 and "reason" in labels
                ),
                "ecc_uncorrected": _int(s.value("sidecar_gpu_ecc_errors_total", gpu=gpu, type="uncorrected")),
                "xid_total": _int(s.total("sidecar_gpu_xid_errors_total", gpu=gpu)) or 0,
            }
        )
    return out


def nics_section(s: Samples) -> list[dict]:
    devices = set(s.label_values("sidecar_network_up", "device")) | set(
        s.label_values("sidecar_network_receive_bytes_total", "device")
    )
    out = []
    for dev in sorted(devices):
        up = s.value("sidecar_network_up", device=dev)
        errors = [s.value(f"sidecar_network_{d}_errs_total", device=dev) for d in ("receive", "transmit")]
        out.append(
            {
                "device": dev,
                "up": None if up is None else up == 1,
                "speed_bytes": _int(s.value("sidecar_network_speed_bytes", device=dev)),
                "receive_bytes_total": _int(s.value("sidecar_network_receive_bytes_total", device=dev)),
                "transmit_bytes_total": _int(s.value("sidecar_network_transmit_bytes_total", device=dev)),
                "errors_total": None if all(e is None for e in errors) else int(sum(e or 0 for e in errors)),
            }
        )
    return out


def infiniband_section(s: Samples) -> list[dict]:
    ports = sorted(
        {
            (labels["device"], labels["port"])
            for labels, _ in s.all("sidecar_infiniband_port_state_id")
            if "device" in labels and "port" in labels
        }
    )
    out = []
    for dev, port in ports:
        state = _int(s.value("sidecar_infiniband_port_state_id", device=dev, port=port))
        up = s.value("sidecar_infiniband_port_up", device=dev, port=port)
        out.append(
            {
                "device": dev,
                "port": port,
                "up": (state == 4) if up is None else up == 1,
                "state": IB_STATES.get(state, str(state)) if state is not None else None,
                "rate_bytes_per_second": _int(
                    s.value("sidecar_infiniband_rate_bytes_per_second", device=dev, port=port)
                ),
            }
        )
    return out


def rank_entry(r: Rank, watchdog: Watchdog, now: float) -> dict:
    state = watchdog.rank_state(r)
    timeout = watchdog.timeout_for(r)
    m = r.metrics
    return {
        "job_id": r.job_id,
        "rank": r.rank,
        "local_rank": r.local_rank,
        "world_size": r.world_size,
        "pid": r.pid,
        "uid": r.owner_uid,  # the uid its process runs as (None: an unverified TCP caller)
        "slurm_job_id": r.slurm_job_id,  # the Slurm job whose cgroup holds it (None: not a Slurm job's)
        "slurm": slurmjob.facts(r),  # its Slurm job, user, account, partition (ranks/slurmjob.py); None: no Slurm
        "state": state,
        "step": r.step,
        "step_time_seconds": finite(m.get("step_time_seconds")),
        "iterations_per_second": finite(m.get("iterations_per_second")),
        "loss": finite(m.get("loss")),
        "grad_norm": finite(m.get("grad_norm")),
        "lr": finite(m.get("lr")),
        "phase": r.phase,
        "last_progress_age_seconds": round(max(0.0, now - r.last_progress), 3),
        "timeout_seconds": finite(timeout),
        "restart_count": r.restart_count,
        "dropped": r.dropped,
        "exit_reason": r.exit_reason,
        "restart_safe": r.restart_safe,
        "observe_only": r.observe_only,  # its job asked that its stalls be observed, never killed (honoured)
    }


def rank_problem(entry: dict) -> Problem:
    phase = f" in phase {entry['phase']}" if entry["phase"] else ""
    timeout = f" (timeout {entry['timeout_seconds']:.0f}s)" if entry["timeout_seconds"] is not None else ""
    return Problem(
        Kind.RANK,
        f"rank {entry['job_id']}/{entry['rank']} {entry['state']}{phase}: no progress for "
        f"{entry['last_progress_age_seconds']:.0f}s{timeout}",
        entry["job_id"],
        entry["rank"],
    )


def restart_trap_problems(ranks: list[dict]) -> list[Problem]:
    """One problem per job with a rank whose process group would not come back after a restart."""
    unsafe: dict[str, list[int]] = defaultdict(list)
    for e in ranks:
        if e["restart_safe"] is False:
            unsafe[e["job_id"]].append(e["rank"])
    return [restart_trap(job_id, job_ranks) for job_id, job_ranks in sorted(unsafe.items())]


# What a verdict's culprit says that is a stack frame: another user's innermost frame (the code it
# runs, its paths), which `/v1/status` must not carry, being every local user's to read, over the
# socket and loopback TCP alike (issue 28, row 7). Root reads it with `sidecar incidents --job`.
FRAME_KEYS = frozenset({"stack_top", "frames", "stack", "stack_head"})


def jobs_section(reporter: Reporter | None) -> dict:
    """Per local multi-node job, its coordinator and verdict (sidecar/jobview/), the culprit
    without its stack frame: rank, node, step, phase, kind, reason and the collective only."""
    if reporter is None:
        return {}
    jobs = reporter.status()
    for view in jobs.values():
        verdict = view.get("verdict") if isinstance(view, dict) else None
        if isinstance(verdict, dict) and isinstance(verdict.get("culprit"), dict):
            verdict["culprit"] = {k: v for k, v in verdict["culprit"].items() if k not in FRAME_KEYS}
    return jobs


def collectors_section(runner: CollectorRunner, now_wall: float) -> dict:
    out = {}
    for name, r in runner.snapshot().items():
        ran = r.finished_at > 0
        out[name] = {
            "success": r.success if ran else None,
            "duration_seconds": round(r.duration_seconds, 6) if ran else None,
            "age_seconds": round(now_wall - r.finished_at, 3) if ran else None,
            "error": r.error,
        }
    return out


# ---------------------------------------------------------------- the document


def build_status(
    settings: Settings,
    registry: Registry,
    runner: CollectorRunner,
    watchdog: Watchdog,
    started: float,
    exits: ExitTracker | None = None,
    reporter: Reporter | None = None,
    fitness: Fitness | None = None,
    golive: dict | None = None,
    lateness_tracker: lateness.Tracker | None = None,
    crash_loops: dict | None = None,
) -> dict:
    now, now_wall = time.monotonic(), time.time()
    lateness_tracker = lateness_tracker or lateness.Tracker()  # the daemon's one, which /metrics reads
    s = Samples(runner.families())
    ranks = [rank_entry(r, watchdog, now) for r in sorted(registry.ranks(), key=lambda r: (r.job_id, r.rank))]
    collectors = collectors_section(runner, now_wall)

    # The watchdog words its own problems (stalled ranks with their timeout basis, the storm
    # cap); a rank in a bad state it did not mention still gets a line here.
    problems = merged(watchdog.problems(), [rank_problem(e) for e in ranks if e["state"] in UNHEALTHY_RANK_STATES])
    problems += [
        Problem(Kind.COLLECTOR, f"collector {name} failing: {c['error'] or 'last run failed'}", collector=name)
        for name, c in collectors.items()
        if c["success"] is False
    ]
    fitness = fitness or Fitness()
    problems += [Problem(Kind.NODE, f"node unfit ({f.reason.value}): {f.text}") for f in fitness.findings]
    problems += restart_trap_problems(ranks)
    crash_loops = crash_loops or {}
    problems += [
        Problem(Kind.CRASH_LOOP, f"job {job_id} ended: {e['reason']} (job incident {e['job_incident']}): its ranks "
                f"here exit {e['exit_code']}, it is not restarted again", job_id)
        for job_id, e in sorted(crash_loops.items())
    ]  # fmt: skip

    return {
        "version": __version__,
        "time": now_wall,
        "uptime_seconds": round(now - started, 3),
        "health": "degraded" if problems else "healthy",
        "problems": [p.text for p in problems],
        "fitness": fitness.as_dict(),  # the node verdict (sidecar/fitness.py): fit, reasons, findings
        "node": node_section(settings, s),
        "gpus": gpus_section(s),
        "nics": nics_section(s),
        "infiniband": infiniband_section(s),
        "ranks": ranks,
        "collectors": collectors,
        "watchdog": watchdog.status(),
        "incidents": watchdog.incidents(INCIDENTS_SHOWN),
        "exits": exits.status() if exits is not None else None,
        # The job view (sidecar/jobview/): per local multi-node job, its coordinator and verdict.
        "jobs": jobs_section(reporter),
        # Jobs ended on purpose for a crash loop (sidecar/jobview/crashloop.py): reason, job incident, exit code.
        "crash_loops": crash_loops,
        # Per job with ranks here, its go-live checks (sidecar/ranks/golive.py): ranks joined, first batch,
        # GPU memory and throughput balanced across its ranks here, loss falling over its first steps.
        # Judged over the whole job by its coordinator when fresh (judged_by, sidecar/jobview/golive.py).
        "golive": golive_shown(
            golive or {}, reporter.golive if reporter else None, reporter.coordinator if reporter else None
        ),
        # Per local job, who is late to its collectives: as its coordinator judged it over the whole
        # job, and as this node judges its own ranks (sidecar/jobview/stragglers.py). Never a kill.
        # A local straggler's cause (straggler_cause.py) comes from its open incident.
        "stragglers": straggler_incidents.with_causes(
            stragglers.status(
                settings.node_name,
                registry.ranks(),
                reporter.lateness if reporter is not None else lambda job_id: None,
                reporter.coordinator if reporter is not None else lambda job_id: None,
                lateness_tracker,
            ),
            watchdog.store.recent,
        ),
    }
