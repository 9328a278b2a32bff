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
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sidecar.config_base import (  # noqa: F401  (re-exported: the rest of the tree imports them from here)
    COLLECTORS,
    DEFAULT_LISTEN,
    DEFAULT_SOCKET,
    ENV_PREFIX,
    NODE_NAME,
    ConfigError,
    _fail,
    _positive,
    check_url,
    doc,
    parse_hostport,
)
from sidecar.config_sections import (  # noqa: F401  (re-exported)
    CollectorSettings,
    ExitSettings,
    JobViewSettings,
    LimitSettings,
    MetricsSettings,
    RemediationSettings,
    WatchdogSettings,
)
from sidecar.settings_tree import SettingsTree


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
        default=".",
        metadata=doc(
            "The training checkpoint directory; its filesystem's size and free space are exported. A relative "
            "path is taken from the directory the sidecar runs in (`sidecar status` shows it resolved). Empty: "
            "none (no checkpoint series; `sidecar status` says `not set`)."
        ),
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
            "Most disk the incident records may use; the oldest go first; 0: no limit. The default diagnostics "
            "directory is on tmpfs: memory, counted against the sidecar's memory limit (the DaemonSet's 1Gi, the "
            "unit's MemoryMax=1G), which must exceed this and the daemon's own (under 100 MiB)."
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
    metrics: MetricsSettings = field(default_factory=MetricsSettings)

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
