"""The settings' sections (`collectors`, `limits`, `watchdog`, `remediation`, `exits`, `job_view`, `metrics`):
one dataclass each, every field documented in its metadata and checked in `__post_init__`
(sidecar/config.py holds the top-level `Settings` that gathers them, and the loading)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from sidecar.config_base import COLLECTORS, _fail, _positive, check_url, doc
from trainer_hooks import wire


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
            "than a line of the same innermost function; a still stack is trusted after 7 looks). Such a rank is "
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

    golive_steps: int = field(
        default=50,
        metadata=doc(
            "The go-live checks (`sidecar status`, `/v1/status` golive, sidecar_job_golive_check) judge a new "
            "job's loss over its first this many steps: a loss that did not fall over them is a warning."
        ),
    )
    golive_imbalance_ratio: float = field(
        default=0.2,
        metadata=doc(
            "The go-live checks warn when a rank's GPU memory or throughput differs from the median of the job's "
            "other ranks on this node by more than this share (0.2: 20%): the sign of memory-saving or "
            "gradient-accumulation settings that differ between ranks."
        ),
    )

    def __post_init__(self) -> None:
        if not 2 <= self.golive_steps <= 100_000:
            _fail("watchdog.golive_steps", f"must be in [2, 100000], got {self.golive_steps}")
        if not 0 < self.golive_imbalance_ratio <= 10:
            _fail("watchdog.golive_imbalance_ratio", f"must be in (0, 10], got {self.golive_imbalance_ratio}")
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
            "Share the job's picture with the other nodes of each job (docs/architecture/job-view.md): "
            "one culprit, one job incident, and only the culprit's node kills. Off: every node judges its own "
            "ranks alone."
        ),
    )
    advertise_url: str = field(
        default="",
        metadata=doc(
            "Where the other nodes' sidecars reach this one (`http://HOST:PORT`), told to the ranks so that "
            "rank 0 can name its node's sidecar as the job's coordinator. Empty: from `listen` (a wildcard "
            "address is replaced by the hostname, port 0 by the port bound). The DaemonSet sets it from the "
            "pod's host IP."
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
    crash_loop_repeats: int = field(
        default=2,
        metadata=doc(
            "A crash loop: a job whose restarts met the same verdict at the same step (the same rank hung or "
            "crashed there, or the same desync) this many times after its first is ended, not restarted again: "
            "every node tells its ranks of the job to exit 93, and `python -m trainer_hooks.launch` then exits "
            "93 (do not requeue; plain torchrun restarts them until --max-restarts, each exiting at once, and "
            "exits 1). A fresh launch (restart 0 from a new torchrun) starts over. At most 15; 0: never."
        ),
    )
    straggler_exclude_after_seconds: float = field(
        default=0.0,
        metadata=doc(
            "Opt-in. A rank of this node that has been its job's straggler this long with a cause in the node's "
            "hardware (a GPU's clocks held down by power, thermal or HW slowdown; a CPU quota never counts) "
            "marks the node for exclusion at the job's next restart: node fitness `straggler`, so `sidecar "
            "status --check node` answers unfit (node-problem-detector's condition; the bare-metal launcher's "
            "LEAVE_IF_UNFIT). Nothing is killed. 0: never (the default)."
        ),
    )
    straggler_exclude_hold_seconds: float = field(
        default=3600.0,
        metadata=doc(
            "How long a node marked for exclusion stays marked after its straggler episode ends (a node left "
            "out of the job names no straggler any more)."
        ),
    )
    cluster_key_file: str = field(
        default="",
        metadata=doc(
            "Opt-in: a file (root's, mode 0600) holding a secret every node of the cluster shares (at least 32 "
            "characters). Peer requests are then signed with the job's key bound to it: the job's key alone, "
            "which anyone who can read the job's c10d store may learn, no longer signs (docs/security.md). "
            "Every node of a job needs the same file; empty: the job's key alone."
        ),
    )
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
            "Most ranks a coordinator keeps in the reports of every job it coordinates together; each job's own "
            "are bounded by its world size. When full, shared fairly: equal parts per owner (uid), then per job; "
            "a job past its part is refused (429) or, when another needs room, dropped. About 2 KiB each: "
            "16384 is ~32 MiB."
        ),
    )

    def cluster_key(self) -> bytes | None:
        """The cluster secret of `cluster_key_file`, or None when unset; ConfigError when unusable."""
        if not self.cluster_key_file:
            return None
        try:
            with open(self.cluster_key_file, "rb") as f:
                st = os.fstat(f.fileno())
                secret = f.read(4096).strip()
        except OSError as e:
            _fail("job_view.cluster_key_file", f"cannot read {self.cluster_key_file}: {e.strerror}")
        if st.st_uid != os.geteuid():
            _fail("job_view.cluster_key_file", f"{self.cluster_key_file} is not this user's (uid {os.geteuid()})")
        if st.st_mode & 0o077:
            _fail("job_view.cluster_key_file", f"{self.cluster_key_file} is readable by others: chmod 600 it")
        if len(secret) < 32:
            _fail("job_view.cluster_key_file", f"{self.cluster_key_file} holds fewer than 32 characters")
        return secret

    def __post_init__(self) -> None:
        for name in ("report_interval_seconds", "verdict_wait_seconds", "launcher_grace_seconds"):
            _positive(f"job_view.{name}", getattr(self, name), allow_zero=name != "report_interval_seconds")
        _positive("job_view.max_nodes", self.max_nodes)
        _positive("job_view.max_ranks", self.max_ranks)
        if not 0 <= self.crash_loop_repeats <= 15:
            _fail("job_view.crash_loop_repeats", f"expected 0 to 15, got {self.crash_loop_repeats}")
        _positive("job_view.forget_after_seconds", self.forget_after_seconds)
        _positive("job_view.straggler_exclude_after_seconds", self.straggler_exclude_after_seconds, allow_zero=True)
        _positive("job_view.straggler_exclude_hold_seconds", self.straggler_exclude_hold_seconds, allow_zero=True)
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
class MetricsSettings:
    slurm_labels: bool = field(
        default=True,
        metadata=doc(
            "Put a Slurm job's `slurm_job_id`, `slurm_user`, `slurm_account` and `slurm_partition` on its ranks' "
            "series and its own series (docs/slurm.md#the-jobs-owner-on-its-series-and-incidents); they add no "
            "series. Off: none on the series; `/v1/status` and the incidents keep them."
        ),
    )
