"""The mixin's one settings object (`_config`): what an operator tunes in the rules and dashboards.

`MixinConfig()` holds the defaults, which render the files shipped in `alerts/` and `dashboards/`;
`load(path)` reads a YAML (or JSON) file that overrides any subset of them:

    thresholds: {rank_stalled_for: 5m, goodput_low_ratio: 0.7}
    selectors: {sidecar_targets: 'job="gpu-sidecars"'}
    runbook_base_url: https://wiki.example.com/sidecar/runbook
    cluster_label: k8s_cluster
    dashboards: {refresh: 1m}
    scale: {shards: 4, store_url: http://vm.example:8428}

An unknown key or a value of the wrong type raises `MixinConfigError`, whose message names the
file and the key. `commented_yaml()` is the full file with every default and what it means
(`sidecar deploy-gen --print-config`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from sidecar.collectors.xid import HARDWARE_XIDS

# Where the runbook is published; each alert links to `#<alertname in lower case>`.
RUNBOOK_BASE_URL = "https://github.com/training-sidecar/training-sidecar/blob/main/docs/runbook.md"

DURATION = re.compile(r"(\d+(ms|s|m|h|d|w|y))+")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

# name -> (default, what it means). A default that is text matching DURATION is a PromQL duration,
# a number a number; `xid_critical` is a PromQL regex of XID codes.
THRESHOLD_DOCS: dict[str, tuple[float | str, str]] = {
    # --- watchdog and progress
    "rank_stalled_for": ("2m", "a stall the watchdog has not cleared within this pages (SidecarRankStalled)"),
    "job_hung_for": ("1m", "`for` of SidecarJobHungOnRank and SidecarCollectiveStuck"),
    "goodput_low_ratio": (0.8, "the job spent less than this share of the last hour on productive steps"),
    "goodput_low_for": ("30m", "`for` of SidecarJobGoodputLow"),
    "no_progress_seconds": (1800, "no rank of the job advanced its step for this long (SidecarJobNotProgressing)"),
    "storm_killed_per_hour": (3, "watchdog kills of one job per hour that count as a storm"),
    "restarts_per_hour": (3, "worker-group restarts of one job per hour, any cause (SidecarJobRestartLoop)"),
    "exit_window": ("15m", "a rank exit of a given reason keeps its alert this long"),
    # --- kills a healthy job did not need
    "false_alarms_per_hour": (3, "stalls of one job that ended by themselves within the window: its floor is too low"),
    "false_alarm_window": ("1h", "the window of SidecarJobFalseAlarms"),
    "would_kill_window": ("10m", "a stall the observe-only watchdog would have killed keeps its alert this long"),
    # --- collectives (the ranks' Flight Recorder records)
    "collective_still_for": ("2m", "no member of a process group enqueued or completed a collective this long: a hang"),
    "collective_record_stale_seconds": (30, "a rank's collective record this old stopped coming"),
    "verdict_window": ("1h", "a stall verdict (sidecar_stall_verdicts_total) keeps its alert this long"),
    # --- training signals
    "grad_norm_factor": (10, "grad norm above this multiple of its median over the last hour"),
    "lr_jump_factor": (2, "learning rate above this multiple of its maximum over the last hour"),
    "throughput_drop_ratio": (0.7, "it/s below this share of its average over the last hour"),
    "straggler_lateness_seconds": (0.05, "a rank's lateness to its collectives above this floor ..."),
    "straggler_lateness_step_ratio": (0.1, "... and this share of the job's median step time is a straggler"),
    "straggler_for": ("10m", "`for` of SidecarStragglerRank"),
    "checkpoint_max_age_seconds": (7200, "newest checkpoint older than this while the job trains"),
    "progress_recent_seconds": (600, '"the job trains": some rank advanced within this long'),
    # --- checkpoint filesystem
    "disk_predict_hours": (4, "free space predicted to run out within this many hours ..."),
    "disk_filling_free_ratio": (0.25, "... and less than this share is free now (SidecarCheckpointDiskFillingUp)"),
    "disk_almost_full_free_ratio": (0.05, "less than this share free pages (SidecarCheckpointDiskAlmostFull)"),
    # --- GPU
    "xid_critical": (
        "|".join(str(x) for x in sorted(HARDWARE_XIDS)),
        "XIDs whose documented recovery is a GPU reset or node reboot (NVIDIA's XID catalogue), `|`-separated",
    ),
    "xid_window": ("1h", "an XID keeps its alert this long"),
    "thermal_margin_celsius": (3, "temperature within this of the slowdown threshold"),
    "nvlink_errors_per_second": (1, "NVLink CRC/replay/recovery errors per second"),
    "pcie_replays_per_second": (0.1, "PCIe replays per second"),
    "pcie_busy_ratio": (0.5, "link generation is judged only while the GPU is this busy (it downshifts at idle)"),
    # --- network
    "ib_errors_per_10m": (10, "symbol + receive errors per InfiniBand port in 10 minutes"),
    "nic_errors_per_second": (1, "NIC receive + transmit errors per second"),
    "nic_carrier_changes_per_15m": (2, "NIC carrier changes in 15 minutes (flapping)"),
}

# Selectors of the series that depend on how Prometheus scrapes the sidecars, not on the sidecars.
SELECTOR_DOCS: dict[str, tuple[str, str]] = {
    # The ServiceMonitor's `jobLabel` keeps job="sidecar" whatever the Service is named (a kustomize
    # namePrefix included), and the bare-metal scrape job is named so (deploy/baremetal/prometheus.yml).
    "sidecar_targets": ('job="sidecar"', "the sidecars' scrape targets, for `up` (SidecarDown)"),
}


def _threshold_defaults() -> dict[str, float | str]:
    return {k: v for k, (v, _) in THRESHOLD_DOCS.items()}


def _selector_defaults() -> dict[str, str]:
    return {k: v for k, (v, _) in SELECTOR_DOCS.items()}


@dataclass(frozen=True)
class DashboardSettings:
    """The dashboards' own settings (what each means: DASHBOARD_DOCS)."""

    refresh: str = "30s"
    time_from: str = "now-6h"
    tags: tuple[str, ...] = ("training-sidecar",)
    datasource_regex: str = ""
    folder: str = "Training"


DASHBOARD_DOCS = {
    "refresh": "the dashboards' auto-refresh interval",
    "time_from": "the start of their default time range (to now)",
    "tags": "their tags; the dashboards link to each other by them",
    "datasource_regex": 'a regex narrowing the data sources offered in "Data source" ("" = every Prometheus)',
    "folder": "the Grafana folder of the dashboard ConfigMaps (annotation grafana_folder, sidecar deploy-gen)",
}


@dataclass(frozen=True)
class ScaleSettings:
    """The cluster-scale stack (deploy/scale/, sidecar/mixin/scale.py; what each means: SCALE_DOCS)."""

    shards: int = 2
    scrape_interval: str = "15s"
    evaluation_interval: str = "15s"
    targets_file: str = "/etc/sidecar-scale/targets/*.yml"
    store_url: str = "http://127.0.0.1:8428"
    alertmanager_url: str = "http://127.0.0.1:9093"


SCALE_DOCS = {
    "shards": "scraping shards (Prometheus agents or vmagents); shard N keeps the targets whose hashmod of "
    "__address__ is N",
    "scrape_interval": "how often each shard scrapes each sidecar",
    "evaluation_interval": "how often the global ruler (vmalert) evaluates the rules",
    "targets_file": "the file_sd files (a glob) that list every sidecar as host:port; every shard reads them all",
    "store_url": "the scale-out store (victoria-metrics): shards remote-write to it, the ruler queries it",
    "alertmanager_url": "where the ruler sends its alerts",
}


@dataclass(frozen=True)
class MixinConfig:
    thresholds: Mapping[str, float | str] = field(default_factory=_threshold_defaults)
    selectors: Mapping[str, str] = field(default_factory=_selector_defaults)
    runbook_base_url: str = RUNBOOK_BASE_URL
    # The label a multi-cluster setup adds (Thanos/Mimir external labels): rules aggregate by it,
    # dashboards select with it (`$cluster`).
    cluster_label: str = "cluster"
    dashboards: DashboardSettings = field(default_factory=DashboardSettings)
    scale: ScaleSettings = field(default_factory=ScaleSettings)

    def window(self, key: str) -> str:
        """A threshold that is a PromQL duration ("1h")."""
        value = self.thresholds[key]
        if not isinstance(value, str):
            raise TypeError(f"threshold {key} is a number, not a duration")
        return value

    def number(self, key: str) -> float:
        """A threshold that is a number (drawn on dashboards as well)."""
        value = self.thresholds[key]
        if isinstance(value, str):
            raise TypeError(f"threshold {key} is text, not a number")
        return value


DEFAULT = MixinConfig()


class MixinConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the key."""


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _threshold(key: str, value: object, fail) -> float | str:
    default = THRESHOLD_DOCS[key][0]
    if key == "xid_critical":
        if not isinstance(value, str) or not re.fullmatch(r"\d+(\|\d+)*", value):
            fail(f"thresholds.{key}", f"expected XID codes separated by |, like '48|79', got {value!r}")
        return str(value)
    if isinstance(default, str):
        if not isinstance(value, str) or not DURATION.fullmatch(value):
            fail(f"thresholds.{key}", f"expected a Prometheus duration like 5m, got {value!r}")
        return str(value)
    if not _is_number(value) or value < 0:  # type: ignore[operator]
        fail(f"thresholds.{key}", f"expected a number of at least 0, got {value!r}")
    return value  # type: ignore[return-value]


def _section(data: object, name: str, fail) -> dict:
    if not isinstance(data, dict):
        fail(name, f"expected a mapping, got {type(data).__name__}")
    return data  # type: ignore[return-value]


def _unknown(keys, known, prefix: str, fail) -> None:
    for key in keys:
        if key not in known:
            fail(f"{prefix}{key}", f"unknown key (known: {', '.join(known)})")


def from_mapping(data: object, source: str = "config") -> MixinConfig:
    """A MixinConfig with the defaults overridden by `data` (a parsed config file)."""

    def fail(key: str, problem: str) -> None:
        raise MixinConfigError(f"{source}: {key}: {problem}")

    if data is None:
        return MixinConfig()
    if not isinstance(data, dict):
        raise MixinConfigError(f"{source}: expected a mapping of settings, got {type(data).__name__}")
    top = [f.name for f in fields(MixinConfig)]
    _unknown(data, top, "", fail)
    cfg = MixinConfig()
    thresholds = dict(cfg.thresholds)
    given = _section(data.get("thresholds", {}), "thresholds", fail)
    _unknown(given, list(THRESHOLD_DOCS), "thresholds.", fail)
    thresholds.update({k: _threshold(k, v, fail) for k, v in given.items()})
    selectors = dict(cfg.selectors)
    given = _section(data.get("selectors", {}), "selectors", fail)
    _unknown(given, list(SELECTOR_DOCS), "selectors.", fail)
    for key, value in given.items():
        if not isinstance(value, str) or not value.strip() or "{" in value or "}" in value:
            fail(f"selectors.{key}", f"expected PromQL label matchers like 'job=\"sidecar\"', got {value!r}")
        selectors[key] = value.strip()
    runbook = data.get("runbook_base_url", cfg.runbook_base_url)
    if not isinstance(runbook, str) or not re.fullmatch(r"https?://\S+", runbook):
        fail("runbook_base_url", f"expected an http(s) URL, got {runbook!r}")
    label = data.get("cluster_label", cfg.cluster_label)
    if not isinstance(label, str) or not LABEL_NAME.fullmatch(label) or label.startswith("__"):
        fail("cluster_label", f"expected a Prometheus label name, got {label!r}")
    dash = _section(data.get("dashboards", {}), "dashboards", fail)
    _unknown(dash, list(DASHBOARD_DOCS), "dashboards.", fail)
    board = cfg.dashboards
    for key, value in dash.items():
        if key == "tags":
            if not isinstance(value, list) or not value or not all(isinstance(t, str) and t for t in value):
                fail("dashboards.tags", f"expected a non-empty list of tags, got {value!r}")
            value = tuple(value)
        elif not isinstance(value, str) or (key != "datasource_regex" and not value):
            fail(f"dashboards.{key}", f"expected text, got {value!r}")
        board = replace(board, **{key: value})
    return MixinConfig(thresholds, selectors, runbook, label, board, _scale(data.get("scale", {}), fail))


def _scale(data: object, fail) -> ScaleSettings:
    given = _section(data, "scale", fail)
    _unknown(given, list(SCALE_DOCS), "scale.", fail)
    scale = ScaleSettings()
    for key, value in given.items():
        if key == "shards":
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 256:
                fail("scale.shards", f"expected a whole number from 1 to 256, got {value!r}")
        elif key.endswith("_interval"):
            if not isinstance(value, str) or not DURATION.fullmatch(value):
                fail(f"scale.{key}", f"expected a Prometheus duration like 15s, got {value!r}")
        elif key.endswith("_url"):
            if not isinstance(value, str) or not re.fullmatch(r"https?://[^/\s]+:\d+", value):
                fail(f"scale.{key}", f"expected http(s)://HOST:PORT, got {value!r}")
        elif not isinstance(value, str) or not value.startswith("/"):
            fail(f"scale.{key}", f"expected an absolute path, got {value!r}")
        scale = replace(scale, **{key: value})
    return scale


def load(path: str | Path) -> MixinConfig:
    """The config of a YAML (or JSON) file; MixinConfigError names the file and the key."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise MixinConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise MixinConfigError(f"{path}{where}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}") from None
    return from_mapping(data, str(path))


def _scalar(value: object) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).removesuffix("\n...\n").strip()


def commented_yaml(cfg: MixinConfig = DEFAULT) -> str:
    """A config file holding every setting of `cfg` with what it means: an operator's starting point."""
    out = [
        "# Settings of the training sidecar's Prometheus rules and Grafana dashboards (the defaults).",
        "# Keep only what you change: every key is optional. Render with",
        "# `sidecar deploy-gen --config THIS_FILE --write DIR` (docs/operator-guide.md).",
        "",
        "# Where docs/runbook.md is published; each alert's runbook_url is this plus #<alertname in lower case>.",
        f"runbook_base_url: {_scalar(cfg.runbook_base_url)}",
        "# The label a multi-cluster setup adds (Thanos/Mimir external labels): rules aggregate by it,",
        "# dashboards select with it ($cluster).",
        f"cluster_label: {_scalar(cfg.cluster_label)}",
        "# PromQL label matchers of series that depend on how Prometheus scrapes the sidecars.",
        "selectors:",
    ]
    for key, (_, doc) in SELECTOR_DOCS.items():
        out += [f"  # {doc}", f"  {key}: {_scalar(cfg.selectors[key])}"]
    out += ["# Alert thresholds (numbers) and windows (PromQL durations); the dashboards draw the same.", "thresholds:"]
    for key, (_, doc) in THRESHOLD_DOCS.items():
        out += [f"  # {doc}", f"  {key}: {_scalar(cfg.thresholds[key])}"]
    out += ["dashboards:"]
    for key, doc in DASHBOARD_DOCS.items():
        value = getattr(cfg.dashboards, key)
        out += [f"  # {doc}", f"  {key}: {_scalar(list(value) if isinstance(value, tuple) else value)}"]
    out += ["# The cluster-scale stack: sharded scrapers, the store, the global ruler (deploy/scale/).", "scale:"]
    for key, doc in SCALE_DOCS.items():
        out += [f"  # {doc}", f"  {key}: {_scalar(getattr(cfg.scale, key))}"]
    return "\n".join(out) + "\n"
