"""What the hooks learn from the process environment: who this rank is (torchrun's variables),
where the sidecar listens, and the switches an operator can flip without touching code.

Every variable read by the hooks is listed here, so this file is their reference:

| variable | meaning |
| --- | --- |
| `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE` | set by torchrun; identify the rank |
| `TORCHELASTIC_RUN_ID` | the job id (default `"default"`) |
| `TORCHELASTIC_RESTART_COUNT` | how often torchrun restarted the worker group |
| `TORCHELASTIC_MAX_RESTARTS` | set by torchrun: its `--max-restarts`; with the restart count, whether a killed worker group would be restarted. No `TORCHELASTIC_RUN_ID` means no launcher: nothing restarts the rank |
| `SIDECAR_SOCKET` | the sidecar's Unix socket (preferred transport) |
| `SIDECAR_URL` | `http://HOST:PORT` of the sidecar, used when `SIDECAR_SOCKET` is not set |
| `SIDECAR_TOKEN` | bearer token sent with every request (needed when the sidecar listens beyond loopback) |
| `SIDECAR_STACK_SIGNAL` | signal that dumps this rank's Python stacks (`SIGUSR2` default; `off` disables) |
| `SIDECAR_FLUSH_INTERVAL` | seconds between batches sent to the sidecar (default: what the sidecar says at registration, 2 s unless configured; 0.5 before that) |
| `SIDECAR_HOOKS_DISABLED` | `1` makes every hook a no-op |
| `SIDECAR_POD_NAMESPACE`, `SIDECAR_POD_NAME`, `SIDECAR_CONTAINER_NAME` | the rank's pod (Kubernetes downward API): `namespace`, `pod`, `container` labels on its series; unset means no label |
| `SLURM_JOB_ID`, `SLURM_JOB_ACCOUNT`, `SLURM_JOB_PARTITION` | set by Slurm: with `SLURM_JOB_ID` set, the registration's `slurm` carries the account and partition (`slurm_account`, `slurm_partition` labels, docs/slurm.md); the user is not read: the sidecar names the uid it verified |
| `TORCHELASTIC_USE_AGENT_STORE` | set by torchrun; `True` means the workers share the agent's store across restarts (`distributed.py`) |
| `SIDECAR_ATTACH` | `1` with `autoattach/` on PYTHONPATH attaches every torchrun worker (`attach.py`) |
| `SIDECAR_ATTACHED_PID` | set by the attach switch in the attached process; its children do not attach again |
| `SIDECAR_ATTEMPT_STORE` | `0` turns off the per-attempt store namespace of `trainer_hooks.distributed` |
| `SIDECAR_COLLECTIVES` | `0` leaves PyTorch's Flight Recorder off and sends no collective record (`collectives.py`); otherwise the hooks set `TORCH_FR_BUFFER_SIZE=64` before the process group forms, unless it is set already |
| `TORCH_FR_BUFFER_SIZE` | torch's own: the Flight Recorder's ring size; the user's value wins (`0` turns the recorder and the collective record off) |
| `SIDECAR_INFER_PHASES` | `0` stops the hooks from inferring phases nobody declared: evaluation after `model.eval()`, data loader waits, torch.save/load, compile (`pauses.py`) |
| `SIDECAR_JOB_VIEW` | `0` stops the hooks from telling their sidecar where the job's coordinating sidecar is (`jobview.py`) |
| `SIDECAR_WARM` | `1`: `python -m trainer_hooks.launch` starts the workers warm, as `--warm` does (`launch.py`, `warm.py`) |
| `SIDECAR_RDZV_POLL_SECONDS` | read by `python -m trainer_hooks.launch`'s agent: the rendezvous' wait between two reads of its state (default 0.1; 1 is torch's pace; `rendezvous.py`) |
| `SIDECAR_OBSERVE_ONLY` | `1` asks the sidecar to detect, count and report this job's stalls but never kill its ranks (registration `observe_only`; the sidecar honours it unless its `watchdog.allow_job_observe_only` is off); `Monitor(observe_only=...)` wins |

The on/off switches (`SIDECAR_COLLECTIVES`, `SIDECAR_INFER_PHASES`, `SIDECAR_JOB_VIEW`) are read by
`switched_on`: `0`, `false`, `no` or `off` (any case, spaces around) turn the feature off; unset or
anything else leaves it on.
"""

from __future__ import annotations

import logging
import platform
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from trainer_hooks.wire import POD_LABEL_RULES, PROTOCOL_VERSION, SLURM_LABEL_RULES

log = logging.getLogger("trainer_hooks")

DEFAULT_SOCKET = "/run/sidecar/sidecar.sock"
DEFAULT_FLUSH_INTERVAL = 0.5
DEFAULT_STACK_SIGNAL = signal.SIGUSR2
_TRUE = ("1", "true", "yes", "on")
_OFF = ("", "0", "off", "none", "no", "false", "disabled")
_SWITCHED_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Launcher:
    """What restarts this rank's worker group when the sidecar kills it (the registration's
    `launcher`): torchrun's elastic agent with its restart budget, or nothing."""

    name: str  # one of wire.LAUNCHERS
    max_restarts: int | None = None  # torchrun's --max-restarts; None: torchrun did not say

    def as_wire(self) -> dict[str, object]:
        return {"name": self.name, "max_restarts": self.max_restarts}


NO_LAUNCHER = Launcher("none")


@dataclass(frozen=True)
class Identity:
    """Who this rank is, as the register request names it."""

    job_id: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    restart_count: int
    kubernetes: tuple[tuple[str, str], ...] = ()  # (label, value) of the rank's pod, from the downward API
    slurm: tuple[tuple[str, str], ...] | None = (
        None  # (key, value) of its Slurm job's account, partition; None: no Slurm
    )
    launcher: Launcher = NO_LAUNCHER
    observe_only: bool = False  # ask that the job's stalls be observed, never killed (wire.OBSERVE_ONLY)


@dataclass(frozen=True)
class Endpoint:
    """Where the sidecar listens: a Unix socket path, or a TCP host and port."""

    socket_path: str | None = None
    host: str | None = None
    port: int | None = None
    base_path: str = ""
    token: str | None = None

    @property
    def is_unix(self) -> bool:
        return self.socket_path is not None

    def describe(self) -> str:
        return f"unix:{self.socket_path}" if self.is_unix else f"http://{self.host}:{self.port}{self.base_path}"


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        log.warning("trainer_hooks: ignoring %s=%r (not an integer), using %s", name, raw, default)
        return default


def identity(
    environ: Mapping[str, str],
    job_id: str | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    local_world_size: int | None = None,
    restart_count: int | None = None,
    observe_only: bool | None = None,
) -> Identity:
    """Explicit arguments win; otherwise torchrun's variables (and SIDECAR_OBSERVE_ONLY); otherwise
    a single-process job."""
    rank = _int(environ, "RANK", 0) if rank is None else int(rank)
    world_size = _int(environ, "WORLD_SIZE", 1) if world_size is None else int(world_size)
    return Identity(
        job_id=str(job_id or environ.get("TORCHELASTIC_RUN_ID") or "default")[:128],
        rank=rank,
        local_rank=_int(environ, "LOCAL_RANK", rank) if local_rank is None else int(local_rank),
        world_size=world_size,
        local_world_size=(
            _int(environ, "LOCAL_WORLD_SIZE", world_size) if local_world_size is None else int(local_world_size)
        ),
        restart_count=(_int(environ, "TORCHELASTIC_RESTART_COUNT", 0) if restart_count is None else int(restart_count)),
        kubernetes=kubernetes(environ),
        slurm=slurm(environ),
        launcher=launcher(environ),
        observe_only=(
            environ.get("SIDECAR_OBSERVE_ONLY", "").strip().lower() in _TRUE
            if observe_only is None
            else bool(observe_only)
        ),
    )


def launcher(environ: Mapping[str, str]) -> Launcher:
    """torchrun's agent when torchrun started this process (it sets TORCHELASTIC_RUN_ID, and
    TORCHELASTIC_MAX_RESTARTS for its workers), else none: a plain `python` rank dies for good."""
    if not environ.get("TORCHELASTIC_RUN_ID", "").strip():
        return NO_LAUNCHER
    max_restarts = _int(environ, "TORCHELASTIC_MAX_RESTARTS", -1)
    return Launcher("torchrun", max_restarts if max_restarts >= 0 else None)


# Downward-API variables of the job examples -> label, with the label's most characters;
# Kubernetes' rules for the names are the wire contract's (the sidecar checks them again and
# refuses a registration that breaks them).
POD_VARIABLES = tuple(
    (variable, label, POD_LABEL_RULES[label][1])
    for variable, label in (
        ("SIDECAR_POD_NAMESPACE", "namespace"),
        ("SIDECAR_POD_NAME", "pod"),
        ("SIDECAR_CONTAINER_NAME", "container"),
    )
)


def kubernetes(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The rank's pod labels from the set, non-empty, well-formed variables; others are left out."""
    out = []
    for variable, label, max_len in POD_VARIABLES:
        value = environ.get(variable, "").strip()
        if not value:
            continue
        if len(value) > max_len or not POD_LABEL_RULES[label][0].match(value):
            log.warning("trainer_hooks: ignoring %s=%r (not a Kubernetes %s name)", variable, value[:64], label)
            continue
        out.append((label, value))
    return tuple(out)


# Slurm's variables of the job's environment -> the registration's `slurm` key (wire.SLURM_LABEL_RULES;
# the sidecar checks them again and refuses a registration that breaks them).
SLURM_VARIABLES = (("SLURM_JOB_ACCOUNT", "account"), ("SLURM_JOB_PARTITION", "partition"))


def slurm(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...] | None:
    """The rank's Slurm account and partition from the set, well-formed variables (others are left
    out); None outside a Slurm job (no SLURM_JOB_ID): the registration then carries no `slurm`."""
    if not environ.get("SLURM_JOB_ID", "").strip():
        return None
    out = []
    for variable, key in SLURM_VARIABLES:
        value = environ.get(variable, "").strip()
        if not value:
            continue
        pattern, max_len, what = SLURM_LABEL_RULES[key]
        if len(value) > max_len or not pattern.match(value):
            log.warning("trainer_hooks: ignoring %s=%r (not %s)", variable, value[:64], what)
            continue
        out.append((key, value))
    return tuple(out)


def endpoint(
    environ: Mapping[str, str], socket_path: str | None = None, url: str | None = None, token: str | None = None
) -> Endpoint:
    """The sidecar's address: an explicit socket or URL, else SIDECAR_SOCKET, else SIDECAR_URL,
    else the default socket. A malformed URL falls back to the default socket (and says so)."""
    token = token if token is not None else (environ.get("SIDECAR_TOKEN", "").strip() or None)
    if socket_path is None and url is None:
        socket_path = environ.get("SIDECAR_SOCKET") or None
        if socket_path is None:
            url = environ.get("SIDECAR_URL") or None
    if socket_path is not None:
        return Endpoint(socket_path=socket_path, token=token)
    if url is not None:
        parts = urlsplit(url)
        try:
            port = parts.port or 80
        except ValueError:
            port = None
        if parts.scheme == "http" and parts.hostname and port:
            return Endpoint(host=parts.hostname, port=port, base_path=parts.path.rstrip("/"), token=token)
        log.warning(
            "trainer_hooks: cannot use sidecar URL %r (expected http://HOST:PORT); using the default socket %s",
            url,
            DEFAULT_SOCKET,
        )
    return Endpoint(socket_path=DEFAULT_SOCKET, token=token)


def switched_on(environ: Mapping[str, str], name: str) -> bool:
    """Whether the on/off switch `name` leaves its feature on: off at 0, false, no or off (any
    case); on when unset or anything else."""
    return str(environ.get(name, "1")).strip().lower() not in _SWITCHED_OFF


def disabled(environ: Mapping[str, str]) -> bool:
    return environ.get("SIDECAR_HOOKS_DISABLED", "").strip().lower() in _TRUE


def flush_interval(environ: Mapping[str, str]) -> float | None:
    """SIDECAR_FLUSH_INTERVAL in seconds, or None when unset or not a positive number."""
    raw = environ.get("SIDECAR_FLUSH_INTERVAL", "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < 3600:
        log.warning("trainer_hooks: ignoring SIDECAR_FLUSH_INTERVAL=%r (want seconds > 0)", raw)
        return None
    return value


def stack_signal(environ: Mapping[str, str]) -> int | None:
    """The stack-dump signal: SIDECAR_STACK_SIGNAL as a name (`SIGUSR2`, `USR1`) or number;
    `off` (or `0`, `none`) disables the dump. Default SIGUSR2."""
    raw = environ.get("SIDECAR_STACK_SIGNAL")
    if raw is None:
        return int(DEFAULT_STACK_SIGNAL)
    text = raw.strip().upper()
    if text.lower() in _OFF:
        return None
    if text.isdigit():
        return int(text)
    name = text if text.startswith("SIG") else "SIG" + text
    sig = getattr(signal, name, None)
    if isinstance(sig, signal.Signals):
        return int(sig)
    log.warning("trainer_hooks: unknown SIDECAR_STACK_SIGNAL=%r; stack dumps disabled", raw)
    return None


def versions() -> dict:
    """Versions worth knowing when debugging a job. torch/cuda/nccl only when the training
    process imported torch itself: the hooks never import it."""
    out = {"python": platform.python_version(), "hooks_protocol": str(PROTOCOL_VERSION)}
    torch = sys.modules.get("torch")
    if torch is None:
        return out
    try:
        out["torch"] = str(torch.__version__)
        cuda = getattr(getattr(torch, "version", None), "cuda", None)
        if cuda:
            out["cuda"] = str(cuda)
            nccl = torch.cuda.nccl.version()
            out["nccl"] = ".".join(str(p) for p in nccl) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # a partial import or a build without NCCL: report what we have
        pass
    return out
