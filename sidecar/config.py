"""The sidecar's settings: one typed object, from a YAML file, `SIDECAR_*` environment
variables and flags (flag > env > file > default), validated at start.

Every field carries its documentation in `metadata["help"]`; `sidecar config-doc`
(sidecar/commands/config_doc.py) writes docs/configuration.md from it. Environment names are
`SIDECAR_<FIELD>` for top-level fields and `SIDECAR_<SECTION>_<FIELD>` for sections
(`SIDECAR_WATCHDOG_FLOOR_SECONDS`). A bad setting raises `ConfigError`, which `sidecar run` turns
into exit status 2 and one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import socket
import typing
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sidecar.settings_tree import SettingsTree
from trainer_hooks import wire

DEFAULT_PORT = 9402
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"
DEFAULT_SOCKET = "/run/sidecar/sidecar.sock"
ENV_PREFIX = "SIDECAR_"
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")

# The hardware collectors there are, name -> the module that implements it: the one list the
# settings (`collectors.enabled` and its default), the collector factory
# (sidecar/collectors/factory.py) and the metrics reference read. Each module defines `NAME`,
# `METRICS` and `build(context)`. In build order: the node collector reads the GPU collector's
# driver versions, so gpu comes first.
COLLECTORS: dict[str, str] = {
    "gpu": "sidecar.collectors.gpu",
    "nic": "sidecar.collectors.nic",
    "process": "sidecar.collectors.process",
    "node": "sidecar.collectors.node",
}


class ConfigError(ValueError):
    """A setting is invalid. The message names the setting and what is wrong, on one line."""


def doc(text: str, **kw: Any) -> dict:
    return {"help": text, **kw}


def _fail(name: str, problem: str) -> typing.NoReturn:
    raise ConfigError(f"setting {name}: {problem}")


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        _fail(name, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


PEER_URL = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):\d{1,5}/?")


def check_url(url: str) -> str | None:
    """Why `url` cannot be a coordinator's address (None when it can): `http(s)://HOST:PORT` and
    nothing else, no user, path or query."""
    if not isinstance(url, str) or len(url) > 240 or not PEER_URL.fullmatch(url):
        return "expected http://HOST:PORT"
    port = urllib.parse.urlsplit(url).port
    if port is None or not 0 < port < 65536:
        return "port out of range"
    return None


def parse_hostport(value: str, name: str = "listen") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not (0 <= int(port) <= 65535):
        _fail(name, f"expected HOST:PORT, got {value!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


@dataclass
class CollectorSettings:
    interval_seconds: float = field(
        default=5.0,
        metadata=doc(
            "How often the hardware collectors (gpu, nic, process, node) sample, in seconds. "
            "`/metrics` always serves the latest sample and never waits on hardware."
        ),
    )
    enabled: list[str] = field(
        default_factory=lambda: list(COLLECTORS),
        metadata=doc(f"Collectors to run. Known: {', '.join(COLLECTORS)}. Training metrics are always on."),
    )
    nvml_module: str = field(
        default="pynvml",
        metadata=doc(
            "Python module that provides NVML (nvidia-ml-py's `pynvml`). Without a GPU, "
            "`sidecar.testing.fake_nvml_lib` is pynvml over a fake libnvidia-ml and "
            "`sidecar.testing.fake_nvml` a lighter stand-in (both read the spec in SIDECAR_FAKE_NVML)."
        ),
    )
    sysfs_root: str = field(
        default="/sys", metadata=doc("Root of sysfs, read for NICs and InfiniBand ports (`/host/sys` in a container).")
    )
    procfs_root: str = field(default="/proc", metadata=doc("Root of procfs (`/host/proc` in a container)."))
    nic_exclude: str = field(
        default=r"^(lo|veth.*|docker.*|br-.*|cali.*|flannel.*|cni.*|virbr.*|ifb.*|dummy.*)$",
        metadata=doc("Regular expression of network interfaces not to export (virtual ones by default)."),
    )
    max_nics: int = field(default=64, metadata=doc("Most network interfaces exported (bounds series)."))
    xid_events: bool = field(
        default=True,
        metadata=doc(
            "Wait for NVML XID events in a dedicated thread and count them per GPU and XID. With gpu_source "
            "`dcgm` the thread still runs (no GPU metrics), so exits after an XID are still `gpu_error`."
        ),
    )
    gpu_source: str = field(
        default="sidecar",
        metadata=doc(
            "Where the cluster's GPU metrics come from: `sidecar` (this daemon's NVML collector) or `dcgm` "
            "(NVIDIA dcgm-exporter, as the GPU Operator runs it): then the gpu collector is off, whatever "
            "`enabled` says (only its XID event thread and NVML's process lists stay, for the exit reason "
            "`gpu_error`), and load alerts/gpu-source/dcgm.rules.yml instead of sidecar.rules.yml (docs/dcgm.md)."
        ),
    )

    expected_gpus: int = field(
        default=0,
        metadata=doc(
            "GPUs this node has (0: no check). Fewer usable GPUs than this (one fell off the bus, a container "
            "without `runtimeClassName` or NVIDIA_VISIBLE_DEVICES), or no usable NVML at all, makes the node "
            "unfit (sidecar_node_fit 0) instead of a healthy node without GPUs. Needs the gpu collector (or, "
            "with gpu_source `dcgm`, its NVML session). On Kubernetes set it per node from a node label: "
            "docs/operator-guide.md#expected-gpus."
        ),
    )
    gpu_held_budget_bytes: int = field(
        default=0,
        metadata=doc(
            "GPU memory, over all GPUs, that processes left over from gone ranks (seen in a rank's process tree "
            "holding GPU memory, still holding it after the rank is gone: a data-loader worker that outlived its "
            "trainer) may hold before the node is unfit (`gpu_held`). Processes never seen in a rank's tree are "
            "not judged."
        ),
    )
    gpu_held_grace_seconds: float = field(
        default=60.0,
        metadata=doc(
            "How long leftover processes may hold GPU memory beyond gpu_held_budget_bytes before the node is "
            "unfit (a process that frees a large GPU context takes seconds to exit)."
        ),
    )

    def __post_init__(self) -> None:
        _positive("collectors.interval_seconds", self.interval_seconds)
        _positive("collectors.expected_gpus", self.expected_gpus, allow_zero=True)
        _positive("collectors.gpu_held_budget_bytes", self.gpu_held_budget_bytes, allow_zero=True)
        _positive("collectors.gpu_held_grace_seconds", self.gpu_held_grace_seconds, allow_zero=True)
        if self.expected_gpus and "gpu" not in self.enabled:
            _fail("collectors.expected_gpus", "needs the gpu collector in collectors.enabled to count the GPUs")
        if self.gpu_source not in ("sidecar", "dcgm"):
            _fail("collectors.gpu_source", f"expected sidecar or dcgm, got {self.gpu_source!r}")
        known = set(COLLECTORS)
        unknown = sorted(set(self.enabled) - known)
        if unknown:
            _fail("collectors.enabled", f"unknown collector(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        _positive("collectors.max_nics", self.max_nics)

    def check_host_paths(self) -> None:
        """On the node that runs the collectors (not where a settings file is merely checked),
        the roots must exist: psutil reads every process through procfs_root."""
        for name in ("sysfs_root", "procfs_root"):
            if not os.path.isdir(getattr(self, name)):
                _fail(f"collectors.{name}", f"{getattr(self, name)!r} is not a directory")


@dataclass
class LimitSettings:
    max_body_bytes: int = field(default=1 << 20, metadata=doc("Largest accepted request body (413 beyond)."))
    max_items_per_push: int = field(default=10_000, metadata=doc("Most items in one `/v1/push`."))
    max_jobs: int = field(default=16, metadata=doc("Most distinct jobs registered at once (429 beyond)."))
    max_ranks_per_job: int = field(default=1024, metadata=doc("Most ranks of one job registered on this node."))
    max_custom_metrics: int = field(
        default=wire.MAX_CUSTOM_METRICS,
        metadata=doc("Most distinct custom metric names per job (429 beyond; the well-known ones never count)."),
    )
    max_phases: int = field(default=wire.MAX_PHASES, metadata=doc("Most distinct phase names per job."))
    max_ranks: int = field(
        default=2048, metadata=doc("Most ranks registered at once on this node, all users together (429 beyond).")
    )
    max_jobs_per_user: int = field(
        default=4,
        metadata=doc(
            "Most jobs with live ranks one uid may have registered at once (root: only the node-wide "
            "limits.max_jobs). Ranks registered over TCP without a visible caller count as one user."
        ),
    )
    max_ranks_per_user: int = field(
        default=256, metadata=doc("Most live ranks of one uid (root: only limits.max_ranks).")
    )
    max_custom_metrics_per_user: int = field(
        default=64,
        metadata=doc("Most distinct custom metric names over all jobs of one uid (root: only the per-job limit)."),
    )
    max_phases_per_user: int = field(
        default=32, metadata=doc("Most distinct phase names over all jobs of one uid (root: only the per-job limit).")
    )
    max_series: int = field(
        default=3000,
        metadata=doc(
            "Most series `/metrics` answers, all sources together (docs/scale.md). Hardware series are "
            "bounded by the hardware; per-rank series (training, watchdog, process) and custom metrics "
            "beyond the budget are left out, counted in sidecar_metrics_series_dropped."
        ),
    )
    gone_retention_seconds: float = field(
        default=600.0, metadata=doc("How long a finished or dead rank stays in the registry (and in `/metrics`).")
    )
    job_reservation_seconds: float = field(
        default=300.0,
        metadata=doc(
            "After a job's last live rank is gone, its job_id stays reserved this long for the uid its ranks "
            "ran as: its next restart attempt registers again, another user gets 403 job_owned. Recorded in "
            "the diagnostics directory, so a restarted sidecar reserves every job it had for this long from "
            "its start (docs/security.md, Ownership). 0: no reservations."
        ),
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _positive(f"limits.{f.name}", getattr(self, f.name), allow_zero=f.name == "job_reservation_seconds")


@dataclass
class WatchdogSettings:
    enabled: bool = field(default=True, metadata=doc("Run the progress watchdog."))
    observe_only: bool = field(
        default=False, metadata=doc("Detect, record and alert on stalls but never signal a process.")
    )
    check_interval_seconds: float = field(
        default=0.5,
        metadata=doc(
            "How often rank states are evaluated; a rank about to reach its suspect threshold or its timeout "
            "is evaluated when it does, not up to an interval later."
        ),
    )
    startup_timeout_seconds: float = field(
        default=900.0,
        metadata=doc("Budget from registration to the first step (imports, rendezvous, data loading, first compile)."),
    )
    floor_seconds: float = field(
        default=30.0,
        metadata=doc(
            "Lowest training-step timeout. The effective timeout is multiplier x the step-time quantile, "
            "clamped to [floor_seconds, ceiling_seconds]."
        ),
    )
    ceiling_seconds: float = field(default=1800.0, metadata=doc("Highest training-step timeout."))
    multiplier: float = field(default=8.0, metadata=doc("Effective timeout = multiplier x step-time quantile."))
    quantile: float = field(default=0.99, metadata=doc("Quantile of recent step times the timeout follows."))
    window: int = field(default=200, metadata=doc("How many recent step times the quantile is taken over."))
    suspect_ratio: float = field(
        default=0.5, metadata=doc("A rank is SUSPECT once this share of its timeout has passed without progress.")
    )
    phase_timeouts: dict[str, float] = field(
        default_factory=lambda: {
            "startup": 900.0,
            "checkpoint_save": 1800.0,
            "checkpoint_load": 1800.0,
            "eval": 3600.0,
            "compile": 3600.0,
            "data_load": 1800.0,
        },
        metadata=doc("Budget per declared phase, in seconds; a phase declared with its own timeout uses that."),
    )
    default_phase_timeout_seconds: float = field(
        default=1800.0, metadata=doc("Budget of a declared phase that names no timeout and is not in phase_timeouts.")
    )
    busy_is_alive: bool = field(
        default=True,
        metadata=doc(
            "Before a rank past its timeout is declared stalled, look for evidence of life: its process's CPU time "
            "grew by at least 20% of one core since it turned suspect AND its main thread's Python stack moved "
            "(one of several looks, between suspect and deadline and at the deadline, differs from the first by more "
            "than a line of the same innermost function; a still stack is trusted after 4 looks). Such a rank is "
            "busy, not hung: it stays suspect, is checked again every floor_seconds, and is stalled anyway once "
            "ceiling_seconds have passed since its progress; its job's stall (peers waiting for it) is not acted on "
            "meanwhile, on any node. Only ranks a verified caller registered are read. A hang without CPU "
            "(SIGSTOP, a lock, a collective) or with a still stack (a busy loop) is stalled at its timeout as before."
        ),
    )
    allow_job_observe_only: bool = field(
        default=True,
        metadata=doc(
            "Honour a job's own request (`observe_only: true` at registration, the hooks' SIDECAR_OBSERVE_ONLY) to "
            "have its stalls detected, counted and reported but never killed. Off: the request is ignored (logged)."
        ),
    )

    def __post_init__(self) -> None:
        for name in (
            "check_interval_seconds",
            "startup_timeout_seconds",
            "floor_seconds",
            "ceiling_seconds",
            "multiplier",
            "default_phase_timeout_seconds",
        ):
            _positive(f"watchdog.{name}", getattr(self, name))
        if self.ceiling_seconds < self.floor_seconds:
            _fail(
                "watchdog.ceiling_seconds",
                f"must be >= watchdog.floor_seconds ({self.ceiling_seconds} < {self.floor_seconds})",
            )
        if not 0 < self.quantile <= 1:
            _fail("watchdog.quantile", f"must be in (0, 1], got {self.quantile}")
        if not 0 < self.suspect_ratio < 1:
            _fail("watchdog.suspect_ratio", f"must be in (0, 1), got {self.suspect_ratio}")
        _positive("watchdog.window", self.window)
        for phase, budget in self.phase_timeouts.items():
            _positive(f"watchdog.phase_timeouts.{phase}", float(budget))


@dataclass
class RemediationSettings:
    dump_stacks: bool = field(
        default=True,
        metadata=doc("Ask hung ranks for their Python stacks (the hooks' faulthandler signal) before killing."),
    )
    py_spy: bool = field(default=True, metadata=doc("Also run `py-spy dump` on hung ranks when it is installed."))
    dump_wait_seconds: float = field(default=2.0, metadata=doc("How long to wait for stack dumps."))
    grace_seconds: float = field(default=10.0, metadata=doc("Wait between SIGTERM and SIGKILL."))
    kill_wait_seconds: float = field(
        default=10.0,
        metadata=doc(
            "After SIGKILL, how long to wait for the ranks and their group members to be gone. A process still "
            "alive then is `unkillable` (uninterruptible sleep in a driver, frozen, ...): the incident says what "
            "each one is doing, and the node is unfit (sidecar_node_fit 0) until they are gone."
        ),
    )
    max_per_window: int = field(
        default=3,
        metadata=doc(
            "Most remediations per window of the jobs of one uid; past it the watchdog only alerts "
            "about that user's stalls (restart-storm cap). Another user's jobs keep their own."
        ),
    )
    max_per_window_node: int = field(
        default=8,
        metadata=doc(
            "Most remediations per window on this node, all users together (the storm cap's ceiling); "
            "never below max_per_window, so raising that one alone (a single-user node) raises both."
        ),
    )
    window_seconds: float = field(default=3600.0, metadata=doc("The storm cap's window."))
    kill_without_restart: bool = field(
        default=False,
        metadata=doc(
            "Kill a hung worker group even when nothing would restart it (the ranks say: no launcher, as for a "
            "plain `python` rank, or torchrun's --max-restarts used up). Off: such a stall is recorded, alerted "
            "and its stacks dumped, but its processes are left alive (outcome `not_killed_no_restart`), since "
            "the kill would only turn the hang into a failed job. On: fail fast and free the GPUs; also the "
            "choice where something the ranks cannot see restarts them (a pod restart policy)."
        ),
    )

    def __post_init__(self) -> None:
        _positive("remediation.dump_wait_seconds", self.dump_wait_seconds, allow_zero=True)
        _positive("remediation.grace_seconds", self.grace_seconds, allow_zero=True)
        _positive("remediation.kill_wait_seconds", self.kill_wait_seconds, allow_zero=True)
        _positive("remediation.max_per_window", self.max_per_window, allow_zero=True)
        _positive("remediation.max_per_window_node", self.max_per_window_node, allow_zero=True)
        _positive("remediation.window_seconds", self.window_seconds)


@dataclass
class ExitSettings:
    gpu_error_window_seconds: float = field(
        default=60.0,
        metadata=doc(
            "A rank that dies within this many seconds after an XID on a GPU it was using exited with "
            "reason `gpu_error` (a hardware XID) or `gpu_app_fault` (any other: 13, 31, 43, ...)."
        ),
    )
    group_seconds: float = field(
        default=30.0,
        metadata=doc(
            "Rank exits of one job within this many seconds of the first share its exit incident (torchrun "
            "stops the other workers when one dies)."
        ),
    )

    def __post_init__(self) -> None:
        _positive("exits.gpu_error_window_seconds", self.gpu_error_window_seconds)
        _positive("exits.group_seconds", self.group_seconds, allow_zero=True)


@dataclass
class JobViewSettings:
    enabled: bool = field(
        default=True,
        metadata=doc(
            'Share the job\'s picture with the other nodes of each job (docs/architecture.md, "The job view"): '
            "one culprit, one job incident, and only the culprit's node kills. Off: every node judges its own "
            "ranks alone."
        ),
    )
    advertise_url: str = field(
        default="",
        metadata=doc(
            "Where the other nodes' sidecars reach this one (`http://HOST:PORT`), told to the ranks so that "
            "rank 0 can name its node's sidecar as the job's coordinator. Empty: from `listen` (a wildcard "
            "address is replaced by the hostname). The DaemonSet sets it from the pod's host IP."
        ),
    )
    report_interval_seconds: float = field(
        default=5.0,
        metadata=doc(
            "How often a node reports each job to its coordinator while nothing is wrong (at once, and then "
            "long-polled, while a rank is suspect or stalled). It bounds how late a lost node is noticed."
        ),
    )
    verdict_wait_seconds: float = field(
        default=3.0,
        metadata=doc(
            "How long a stalled node waits for the job's verdict and for every node's stack dumps before it "
            "acts on what it knows; also how long the coordinator waits for the stacks at the job's lowest "
            "step before it names the rank with the oldest progress."
        ),
    )
    launcher_grace_seconds: float = field(
        default=30.0,
        metadata=doc(
            "A node whose ranks only wait for a culprit on another node leaves them to torchrun's "
            "re-rendezvous (the culprit's node kills its group, every agent then restarts its own) for this "
            "long, then kills them itself."
        ),
    )
    lost_after_seconds: float = field(
        default=15.0,
        metadata=doc(
            "A node of a job that has not reported for this long is lost (named when every rank that still "
            "reports waits). Keep it above 2 x report_interval_seconds."
        ),
    )
    max_nodes: int = field(default=4096, metadata=doc("Most nodes of one job a coordinator keeps (429 beyond)."))
    forget_after_seconds: float = field(
        default=120.0,
        metadata=doc(
            "A job no rank of which has been registered on this node for this long is forgotten by its "
            "coordinator here: its reports, incidents and key (a restart's gap is far shorter)."
        ),
    )
    max_ranks: int = field(
        default=16384,
        metadata=doc(
            "Most ranks a coordinator keeps in the reports of every job it coordinates together (429 beyond); "
            "each job's own are bounded by its world size. About 2 KiB each: 16384 is ~32 MiB."
        ),
    )

    def __post_init__(self) -> None:
        for name in ("report_interval_seconds", "verdict_wait_seconds", "launcher_grace_seconds"):
            _positive(f"job_view.{name}", getattr(self, name), allow_zero=name != "report_interval_seconds")
        _positive("job_view.max_nodes", self.max_nodes)
        _positive("job_view.max_ranks", self.max_ranks)
        _positive("job_view.forget_after_seconds", self.forget_after_seconds)
        if self.lost_after_seconds < 2 * self.report_interval_seconds:
            _fail(
                "job_view.lost_after_seconds",
                f"must be at least 2 x job_view.report_interval_seconds ({self.lost_after_seconds} < "
                f"{2 * self.report_interval_seconds:g})",
            )
        if self.advertise_url:
            why = check_url(self.advertise_url)
            if why is not None:
                _fail("job_view.advertise_url", f"{why}, got {self.advertise_url!r}")


@dataclass
class Settings:
    node_name: str = field(
        default="",
        metadata=doc(
            "This node's name in incidents, `/v1/status`, `sidecar status` and the job view shared with the "
            "other nodes of a job (empty: the hostname). The DaemonSet sets it from `spec.nodeName`. Letters, "
            "digits, `.`, `_` and `-`, at most 253 characters."
        ),
    )
    listen: str = field(
        default=DEFAULT_LISTEN,
        metadata=doc(
            "TCP address (HOST:PORT) for `/metrics`, health, status and, as a fallback, the push API. "
            "Port 0 picks a free port (printed at start)."
        ),
    )
    socket: str = field(
        default=DEFAULT_SOCKET, metadata=doc("Unix socket for the hooks (and `sidecar status`). Empty disables it.")
    )
    socket_mode: str = field(
        default="0660",
        metadata=doc(
            "Permissions of the Unix socket, octal. Training processes need write access; 0660 plus "
            "socket_group lets a group of users push, 0666 lets anyone on the node."
        ),
    )
    socket_group: str = field(default="", metadata=doc("Group that owns the Unix socket (empty: unchanged)."))
    token_file: str = field(
        default="",
        metadata=doc(
            "File holding the bearer token the push API requires when TCP listens beyond loopback "
            "(or set SIDECAR_TOKEN). Never a flag: flags show in `ps`."
        ),
    )
    checkpoint_dir: str = field(
        default=".", metadata=doc("The training checkpoint directory; its filesystem's free space is exported.")
    )
    diag_dir: str = field(
        default="",
        metadata=doc("Where stack dumps and incidents go (empty: `diag/` next to the socket, or ./sidecar-diag)."),
    )
    metrics_reuse_seconds: float = field(
        default=0.5,
        metadata=doc(
            "A `/metrics` answer rendered less than this many seconds ago is answered again (0: render "
            "every scrape). Far below any scrape interval, it bounds what scraping in a loop costs the "
            "sidecar: at most one rendering per interval."
        ),
    )
    incident_file_mode: str = field(
        default="0600",
        metadata=doc(
            "Permissions of incident files, octal. Incidents quote stack dumps and job details, so by "
            "default only the sidecar's user reads them; 0640 with incident_group lets a group read them. "
            "Never writable or executable by group or others."
        ),
    )
    incident_group: str = field(
        default="", metadata=doc("Group that owns incident files (empty: the sidecar's group).")
    )
    incident_retention_count: int = field(
        default=1000,
        metadata=doc(
            "Incident records kept in the diagnostics directory (json, txt and Flight Recorder dumps of one "
            "incident count once); the oldest go first, checked at most once a minute; 0: no limit. A record "
            "written in the last 10 minutes is never removed (it may still be updated)."
        ),
    )
    incident_retention_megabytes: float = field(
        default=512.0,
        metadata=doc(
            "Most disk the incident records may use (the default diagnostics directory is on tmpfs: memory); "
            "the oldest go first; 0: no limit."
        ),
    )
    incident_retention_days: float = field(
        default=30.0, metadata=doc("Incident records older than this are removed; 0: kept whatever their age.")
    )
    log_level: str = field(default="info", metadata=doc("debug, info, warning or error."))
    hooks_flush_interval_seconds: float = field(
        default=2.0,
        metadata=doc(
            "How often the hooks post their buffer, told to each rank at registration (a rank's "
            "SIDECAR_FLUSH_INTERVAL wins). Each push is a request the sidecar pays for (about half of "
            "its CPU with 8 ranks at 1 s); a healthy rank's progress reaches the watchdog up to this "
            "late, so watchdog.floor_seconds must be at least twice it plus the check interval."
        ),
    )
    listen_retry_seconds: float = field(
        default=30.0,
        metadata=doc(
            "At start, how long to keep trying to listen on `listen` while its port is taken (a process that "
            "bound it while the sidecar was down), once a second, logging who holds it; then exit with "
            "status 1. 0: fail at once."
        ),
    )
    idle_timeout_seconds: float = field(
        default=30.0,
        metadata=doc(
            "A connection that has not completed a request within this many seconds (idle keep-alive "
            "connections and half-sent requests alike) is closed, and a request body must arrive within "
            "it (408). Above the Prometheus scrape interval, so scrapes can reuse their connection."
        ),
    )
    collectors: CollectorSettings = field(default_factory=CollectorSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    watchdog: WatchdogSettings = field(default_factory=WatchdogSettings)
    remediation: RemediationSettings = field(default_factory=RemediationSettings)
    exits: ExitSettings = field(default_factory=ExitSettings)
    job_view: JobViewSettings = field(default_factory=JobViewSettings)

    def __post_init__(self) -> None:
        if not self.node_name:
            self.node_name = socket.gethostname()
        if not NODE_NAME.fullmatch(self.node_name):
            _fail("node_name", f"expected letters, digits, '.', '_' or '-' (at most 253), got {self.node_name!r}")
        parse_hostport(self.listen)
        try:
            mode = int(str(self.socket_mode), 8)
        except ValueError:
            _fail("socket_mode", f"expected an octal mode like 0660, got {self.socket_mode!r}")
        else:
            if not 0 <= mode <= 0o777:
                _fail("socket_mode", f"out of range: {self.socket_mode!r}")
        try:
            incident_mode = int(str(self.incident_file_mode), 8)
        except ValueError:
            _fail("incident_file_mode", f"expected an octal mode like 0600, got {self.incident_file_mode!r}")
        if not 0 <= incident_mode <= 0o777 or incident_mode & 0o133:
            _fail(
                "incident_file_mode",
                f"must not let group or others write, nor anyone execute "
                f"(0600, 0640 or 0644), got {self.incident_file_mode!r}",
            )
        _positive("incident_retention_count", self.incident_retention_count, allow_zero=True)
        _positive("incident_retention_megabytes", self.incident_retention_megabytes, allow_zero=True)
        _positive("incident_retention_days", self.incident_retention_days, allow_zero=True)
        _positive("metrics_reuse_seconds", self.metrics_reuse_seconds, allow_zero=True)
        _positive("hooks_flush_interval_seconds", self.hooks_flush_interval_seconds)
        _positive("idle_timeout_seconds", self.idle_timeout_seconds)
        _positive("listen_retry_seconds", self.listen_retry_seconds, allow_zero=True)
        # Between two batches a healthy rank's progress looks up to one flush interval old.
        slack = 2 * self.hooks_flush_interval_seconds + self.watchdog.check_interval_seconds
        if self.watchdog.floor_seconds < slack:
            _fail(
                "watchdog.floor_seconds",
                f"must be at least 2 x hooks_flush_interval_seconds + "
                f"watchdog.check_interval_seconds ({self.watchdog.floor_seconds} < {slack:g}); "
                "lower the flush interval for short floors",
            )
        if self.log_level not in ("debug", "info", "warning", "error"):
            _fail("log_level", f"expected debug, info, warning or error, got {self.log_level!r}")

    @property
    def listen_host(self) -> str:
        return parse_hostport(self.listen)[0]

    @property
    def listen_port(self) -> int:
        return parse_hostport(self.listen)[1]

    @property
    def socket_mode_int(self) -> int:
        return int(str(self.socket_mode), 8)

    @property
    def incident_file_mode_int(self) -> int:
        return int(str(self.incident_file_mode), 8)

    def incident_group_id(self) -> int | None:
        """The gid of incident_group (ConfigError when there is no such group); None when unset."""
        if not self.incident_group:
            return None
        import grp

        try:
            return grp.getgrnam(self.incident_group).gr_gid
        except KeyError:
            raise ConfigError(f"setting incident_group: no group named {self.incident_group!r}") from None

    @property
    def diagnostics_dir(self) -> Path:
        if self.diag_dir:
            return Path(self.diag_dir)
        if self.socket:
            return Path(self.socket).parent / "diag"
        return Path("sidecar-diag")

    def push_token(self) -> str | None:
        """The bearer token, from SIDECAR_TOKEN or token_file; None when neither is set."""
        token = os.environ.get(ENV_PREFIX + "TOKEN", "").strip()
        if token:
            return token
        if self.token_file:
            try:
                token = Path(self.token_file).read_text().strip()
            except OSError as e:
                _fail("token_file", f"cannot read {self.token_file}: {e.strerror}")
            if not token:
                _fail("token_file", f"{self.token_file} is empty")
            return token
        return None

    @property
    def peer_url(self) -> str:
        """Where other nodes reach this sidecar (job_view.advertise_url, else from listen)."""
        if self.job_view.advertise_url:
            return self.job_view.advertise_url.rstrip("/")
        host = self.listen_host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return f"http://[{host}]:{self.listen_port}" if ":" in host else f"http://{host}:{self.listen_port}"

    def requires_token(self) -> bool:
        return self.listen_host not in ("127.0.0.1", "localhost", "::1")


# ---------------------------------------------------------------- loading

_TREE = SettingsTree(_fail, loader=yaml.BaseLoader, noun="setting")


def load_settings(
    config_file: str | None = None, overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Settings from file < env < overrides (dotted keys, e.g. {"watchdog.floor_seconds": 5})."""
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get(ENV_PREFIX + "CONFIG") or None
    # BaseLoader keeps every scalar a string, so the schema types it (`0660` stays an octal
    # mode instead of YAML 1.1's integer 432); environment values stay strings the same way.
    tree = _TREE.read_file(config_file, "config") if config_file else {}
    return _TREE.load(Settings, tree, _TREE.env_overrides(Settings, ENV_PREFIX, environ), overrides=overrides)


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by the commands that load settings."""
    parser.add_argument("--config", help="YAML settings file (also SIDECAR_CONFIG)")
    parser.add_argument("--listen", help=f"TCP HOST:PORT (default {DEFAULT_LISTEN}; also SIDECAR_LISTEN)")
    parser.add_argument("--socket", help=f"Unix socket path (default {DEFAULT_SOCKET}; also SIDECAR_SOCKET)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any setting by its dotted name, e.g. --set watchdog.floor_seconds=5",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    for item in getattr(args, "set", []) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"setting --set: expected KEY=VALUE, got {item!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        overrides[key.strip()] = value  # typed by the schema, not guessed by YAML
    for name in ("listen", "socket"):
        if getattr(args, name, None) is not None:
            overrides[name] = getattr(args, name)
    for flag, dotted in (("observe_only", "watchdog.observe_only"),):
        if getattr(args, flag, False):
            overrides[dotted] = True
    return load_settings(getattr(args, "config", None), overrides)
