"""A sidecar and a torchrun job on this machine, as the demo and the recovery benchmark run
them: their command lines, the sidecar's status API, and the trainer's log read as events."""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

PYTHON = sys.executable


@dataclass
class SidecarSpec:
    floor_seconds: float = 3.0  # lowest step timeout: a hang is declared this long after the last step
    startup_timeout_seconds: float = 120.0  # imports and rendezvous on a loaded machine
    dump_wait_seconds: float = 2.0
    grace_seconds: float = 5.0
    observe_only: bool = False
    extra: list[str] = field(default_factory=list)  # more `--set KEY=VALUE` settings

    def command(self, workdir: Path, port: int, socket_path: str) -> list[str]:
        settings = {
            "diag_dir": str(workdir / "diag"),
            "checkpoint_dir": str(workdir / "ckpt"),
            "collectors.interval_seconds": 1,
            "watchdog.check_interval_seconds": 0.25,
            "hooks_flush_interval_seconds": 0.5,  # a short floor needs frequent pushes
            "watchdog.floor_seconds": self.floor_seconds,
            "watchdog.startup_timeout_seconds": self.startup_timeout_seconds,
            "watchdog.observe_only": str(self.observe_only).lower(),
            "remediation.dump_wait_seconds": self.dump_wait_seconds,
            "remediation.grace_seconds": self.grace_seconds,
        }
        cmd = [PYTHON, "-m", "sidecar", "run", "--listen", f"127.0.0.1:{port}", "--socket", socket_path]
        for key, value in settings.items():
            cmd += ["--set", f"{key}={value}"]
        for item in self.extra:
            cmd += ["--set", item]
        return cmd


@dataclass
class JobSpec:
    steps: int = 40
    nproc: int = 2  # ranks per node (torchrun agent)
    nnodes: int = 1  # torchrun agents in the rendezvous (several need rdzv_port)
    fault: str = "sleep"  # trainer faults.kind
    fault_rank: int = 1
    fault_step: int = 18
    checkpoint_every: int = 5
    step_delay_seconds: float = 0.1  # data.delay_seconds: steps slow enough to watch
    max_restarts: int = 3
    process_group_timeout_seconds: float | None = None  # parallel.timeout_seconds
    run_id: str = "demo"  # torchrun --rdzv-id: the job_id the sidecar shows
    checkpoint_dir: str = ""  # shared by every node; empty: <workdir>/ckpt
    extra: list[str] = field(default_factory=list)  # more trainer `--set section.field=value`
    # "torchrun", "warm": `python -m sidecar_trainer.launch`, torchrun whose workers are forked
    # from a process that imported torch once (sidecar_trainer/launch.py), or "hooks":
    # `python -m trainer_hooks.launch`, torchrun whose agent re-forms a multi-node job faster
    launcher: str = "torchrun"

    def command(self, workdir: Path, rdzv_port: int | None = None) -> list[str]:
        sets = {
            "train.steps": self.steps,
            "train.log_every_steps": 1,
            "checkpoint.dir": self.checkpoint_dir or str(workdir / "ckpt"),
            "checkpoint.every_steps": self.checkpoint_every,
            "data.delay_seconds": self.step_delay_seconds,
            "batch.global_batch_size": 16,
            "batch.micro_batch_size": 8,
            "faults.kind": self.fault,
            "faults.rank": self.fault_rank,
            "faults.at_step": self.fault_step,
        }
        if self.process_group_timeout_seconds is not None:
            sets["parallel.timeout_seconds"] = self.process_group_timeout_seconds
        cmd = [
            PYTHON,
            "-m",
            {"torchrun": "torch.distributed.run", "warm": "sidecar_trainer.launch", "hooks": "trainer_hooks.launch"}[
                self.launcher
            ],
            "--nnodes",
            str(self.nnodes),
            "--nproc-per-node",
            str(self.nproc),
            "--max-restarts",
            str(self.max_restarts),
            "--rdzv-id",
            self.run_id,
        ]
        cmd += (
            ["--standalone"]
            if rdzv_port is None
            else ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}"]
        )
        cmd += ["-m", "sidecar_trainer"]
        for key, value in sets.items():
            cmd += ["--set", f"{key}={value}"]
        for item in self.extra:
            cmd += ["--set", item]
        return cmd


class SidecarClient:
    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str, timeout: float = 3.0) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except OSError:
            return 0, b""

    def ready(self) -> bool:
        return self.get("/readyz")[0] == 200

    def status(self) -> dict | None:
        code, body = self.get("/v1/status")
        return json.loads(body) if code == 200 else None


# ---------------------------------------------------------------- the trainer's log


@dataclass
class LogEvent:
    kind: str  # rendezvous | fault | step | resumed | checkpoint | finished | startup
    time: float  # Unix time of the log line
    fields: dict


_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) trainer\[rank(\d+)\] \w+ (.*)$")
_PATTERNS = [
    ("rendezvous", re.compile(r"rendezvous done: world_size=(?P<world_size>\d+) .*restart_count=(?P<attempt>\d+)")),
    ("fault", re.compile(r"fault injection: (?P<kind>\w+) on rank (?P<rank>\d+) at step (?P<step>\d+)")),
    ("step", re.compile(r"step (?P<step>\d+)/(?P<steps>\d+) loss=(?P<loss>[\d.naif]+) .*it/s=(?P<its>[\d.]+)")),
    ("resumed", re.compile(r"resumed from step (?P<step>\d+)")),
    ("checkpoint", re.compile(r"checkpoint saved: step=(?P<step>\d+)")),
    ("finished", re.compile(r"training finished: step=(?P<step>\d+) params_sha256=(?P<sha256>\w+)")),
    # sidecar_trainer/startup.py: a milestone of a (re)start, at Unix time t
    (
        "startup",
        re.compile(r"startup: (?P<milestone>\w+) t=(?P<t>[\d.]+)(?: step=(?P<step>\d+))?(?: source=(?P<source>\w+))?"),
    ),
]


class TrainerLog:
    """Reads a torchrun log incrementally and yields the trainer's milestones."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._offset = 0
        self._partial = ""

    def poll(self) -> list[LogEvent]:
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
        except OSError:
            return []
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        events = []
        for line in lines:
            m = _LINE.match(line.strip())
            if not m:
                continue
            stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for kind, pattern in _PATTERNS:
                found = pattern.search(m.group(3))
                if found:
                    fields = {k: _number(v) for k, v in found.groupdict().items() if v is not None}
                    fields["from_rank"] = int(m.group(2))
                    events.append(LogEvent(kind, stamp, fields))
                    break
        return events


def _number(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def load_incident(path: str) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def event_time(incident: dict, name: str) -> float | None:
    return next((e["time"] for e in incident.get("timeline", []) if e.get("event") == name), None)


def wait_for(predicate, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None
