"""One job of bench_field_pauses: a real sidecar, a real `torchrun --standalone` job (2 ranks, gloo)
of one integration's script, the environment its pauses need (bench/field/environment.py), and
what the watchdog did: its log lines ("rank J/R (pid P): healthy -> suspect: ...", "-> stalled",
"busy, not hung", "false alarm: rank R progressed again by itself") and its incidents, as
/v1/status lists them (polled every second) and as their records on disk (the timeline's
`sigterm`). Every process it starts is stopped on the way out, on an error or Ctrl-C too.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from bench.field.environment import Cgroups, SlowStorage
from harness.job import PYTHON, SidecarClient, wait_for
from harness.processes import Processes, free_port

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CHECKPOINT_BYTES = 4_200_000  # the loop's state_dict as torch.save writes it (one 1024 x 1024 layer)
SLACK_SECONDS = 3.0  # an event this long after a pause ended is still the pause's (the rank's return)


@dataclass
class Setting:
    name: str
    floor_seconds: float | None  # None: the shipped default (watchdog.floor_seconds 30)
    pause_seconds: float


@dataclass
class Spec:
    integration: str  # a key of COMMANDS
    setting: Setting
    pauses: list[str] = field(default_factory=list)  # the schedule, in order
    hangs: list[str] = field(default_factory=list)  # attempt i hangs with hangs[i]
    steps: int = 60  # steps before each pause (about 4 s: past the hooks' first pushes)
    timeout: float = 900.0


@dataclass
class Event:
    time: float
    what: str  # suspect | stalled | healthy (back from either) | busy | false_alarm
    rank: int


@dataclass
class Result:
    spec: Spec
    records: list[dict]
    events: list[Event]
    incidents: list[dict]  # the full records of the stall incidents, oldest first
    returncode: int | None
    wall_seconds: float
    workdir: Path

    def windows(self) -> list[tuple[int, str, float, float]]:
        """(index, kind, start, end) of each pause that began; one cut short ends at start + its length."""
        starts = {r["index"]: r for r in self.records if r["kind"] == "pause"}
        ends = {r["index"]: r["time"] for r in self.records if r["kind"] == "pause_end"}
        return [(i, r["pause"], r["time"], ends.get(i, r["time"] + r["seconds"])) for i, r in sorted(starts.items())]


def _script(integration: str) -> list[str]:
    if integration == "attach":
        return ["-m", "trainer_hooks.attach", str(HERE / "train_attach.py")]
    return [str(HERE / f"train_{integration}.py")]


INTEGRATIONS = ("monitor", "attach", "hf", "lightning")
# The pauses each integration makes: the frameworks pause in their own evaluation loop (their callbacks
# declare it); the user's own loop pauses in every way.
KINDS = {"hf": ("eval",), "lightning": ("eval",)}


def sidecar_command(setting: Setting, workdir: Path, port: int, sock: str) -> list[str]:
    """The shipped defaults but for where it writes and the storm cap (a bench kills more often
    than production: every kill must be seen); the lowered setting also sets the floor."""
    sets = {
        "diag_dir": workdir / "diag",
        "checkpoint_dir": workdir / "ckpt",
        "remediation.max_per_window": 1000,
        "remediation.max_per_window_node": 1000,
    }
    if setting.floor_seconds is not None:
        sets["watchdog.floor_seconds"] = setting.floor_seconds
    cmd = [PYTHON, "-m", "sidecar", "run", "--listen", f"127.0.0.1:{port}", "--socket", sock]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def append(path: Path, **fields) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"time": time.time(), **fields}) + "\n")


def read_records(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


class Environment:
    """Acts on the ranks' requests: starves or freezes the last rank for a pause, SIGSTOPs a rank
    inside its collective; each action and its undoing recorded in the job's log."""

    def __init__(self, log: Path, cgroups: Cgroups | None):
        self.log, self.cgroups = log, cgroups
        self.due: list[tuple[float, Callable[[], None], bool]] = []  # (when, action, an undoing)
        self._seen = 0

    def poll(self) -> None:
        records = read_records(self.log)
        for r in records[self._seen :]:
            if r["kind"] == "pause_request":
                self._pause(r)
            elif r["kind"] == "hang_request":  # inside its all-reduce by now, or about to be
                self.due.append((time.monotonic() + 0.3, functools.partial(self._stop, r), False))
        self._seen = len(records)
        now = time.monotonic()
        for item in [d for d in self.due if d[0] <= now]:
            self.due.remove(item)
            item[1]()

    def _pause(self, r: dict) -> None:
        pid, kind = r["pid"], r["pause"]
        if self.cgroups is None:
            return
        on = self.cgroups.starve(pid) if kind == "cpu_starved" else self.cgroups.freeze(pid)
        if not on:
            return
        append(self.log, kind="pause", pause=kind, index=r["index"], seconds=r["seconds"], rank=r["rank"], pid=pid)

        def undo() -> None:
            assert self.cgroups is not None
            if kind == "cpu_starved":
                self.cgroups.feed(pid)
            else:
                self.cgroups.thaw(pid)
            append(self.log, kind="pause_end", pause=kind, index=r["index"], rank=r["rank"])

        self.due.append((time.monotonic() + r["seconds"], undo, True))

    def _stop(self, r: dict) -> None:
        with contextlib.suppress(OSError):
            os.kill(r["pid"], signal.SIGSTOP)
            append(self.log, kind="hang", hang=r["hang"], rank=r["rank"], attempt=r["attempt"])

    def finish(self) -> None:
        for _, action, undoing in self.due:  # thaw and feed what is still held
            if undoing:
                with contextlib.suppress(Exception):
                    action()
        self.due.clear()


_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: (.*)$")
_TRANSITION = re.compile(r"^rank \S+/(\d+) \(pid \d+\): (\w+) -> (suspect|stalled|healthy): ")
_BUSY = re.compile(r"^rank \S+/(\d+) \(pid \d+\): busy, not hung")
_FALSE_ALARM = re.compile(r"false alarm: rank (\d+) progressed again by itself")


def read_events(log: Path) -> list[Event]:
    """The watchdog's verdicts, from the sidecar's log lines."""
    events = []
    for line in log.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        when = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        text = m.group(2)
        if t := _TRANSITION.match(text):
            events.append(Event(when, t.group(3), int(t.group(1))))
        elif b := _BUSY.match(text):
            events.append(Event(when, "busy", int(b.group(1))))
        elif f := _FALSE_ALARM.search(text):
            events.append(Event(when, "false_alarm", int(f.group(1))))
    return events


def _next_pause(state: Path) -> int:
    try:
        return int(state.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _status_incidents(client: SidecarClient, into: dict[str, dict]) -> None:
    status = client.status() or {}
    for brief in status.get("incidents") or []:
        into[brief["id"]] = brief


def _full(briefs: dict[str, dict], diag: Path) -> list[dict]:
    """The incident records /v1/status listed (and any it did not, on disk), oldest first."""
    records = {}
    for path in sorted((diag / "incidents").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            r = json.loads(path.read_text())
            records[r["id"]] = r
    for brief in briefs.values():
        records.setdefault(brief["id"], brief)
    stalls = [r for r in records.values() if r.get("kind", "stall") == "stall"]  # not the exit incidents
    return sorted(stalls, key=lambda r: r["time"])


def run_job(spec: Spec, workdir: Path, cgroups_ok: bool) -> Result:
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "field.jsonl"
    seconds = spec.setting.pause_seconds
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "OMP_NUM_THREADS": "1",
        "FIELD_LOG": str(log),
        "FIELD_STATE": str(workdir / "state"),
        "FIELD_PAUSES": ",".join(spec.pauses),
        "FIELD_HANGS": ",".join(spec.hangs),
        "FIELD_PAUSE_SECONDS": str(seconds),
        "FIELD_STEPS": str(spec.steps),
        "FIELD_STORAGE": str(workdir / "storage"),
        "FIELD_WORKDIR": str(workdir),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "TOKENIZERS_PARALLELISM": "false",
    }
    restarts = len(spec.pauses) + len(spec.hangs) + 3
    started, rc = time.monotonic(), None
    briefs: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        procs = stack.enter_context(Processes(workdir))  # closed last: after the thaw below
        if "checkpoint" in spec.pauses:
            stack.enter_context(contextlib.closing(SlowStorage(workdir / "storage", 2, CHECKPOINT_BYTES / seconds)))
        cgroups = None
        if cgroups_ok and ({"cpu_starved", "dstate"} & set(spec.pauses)):
            cgroups = stack.enter_context(contextlib.closing(Cgroups(workdir.name)))
        environment = Environment(log, cgroups)
        stack.callback(environment.finish)
        port, sock = free_port(), str(workdir / "sidecar.sock")
        procs.start("sidecar", sidecar_command(spec.setting, workdir, port, sock))
        client = SidecarClient(port)
        if not wait_for(client.ready, 60):
            raise RuntimeError(f"sidecar did not start: {procs.log('sidecar').read_text()[-2000:]}")
        env["SIDECAR_SOCKET"] = sock
        cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        cmd += ["--max-restarts", str(restarts), *_script(spec.integration)]
        deadline, next_status = time.monotonic() + spec.timeout, 0.0
        for _ in range(len(spec.pauses) + 1):  # launched again while pauses remain (warmup ends a run)
            job = procs.start("job", cmd, env=env)
            while job.poll() is None and time.monotonic() < deadline:
                environment.poll()
                if time.monotonic() >= next_status:
                    _status_incidents(client, briefs)
                    next_status = time.monotonic() + 1.0
                time.sleep(0.1)
            rc = job.poll()
            if rc != 0 or _next_pause(workdir / "state") >= len(spec.pauses):
                break
        time.sleep(1.0)  # the last incident's writes
        _status_incidents(client, briefs)
    return Result(
        spec, read_records(log), read_events(workdir / "sidecar.log"), _full(briefs, workdir / "diag"), rc,
        time.monotonic() - started, workdir,
    )  # fmt: skip


if __name__ == "__main__":  # one job by hand: python -m bench.field.job monitor eval,eval
    r = run_job(Spec(sys.argv[1], Setting("lowered", 5.0, 8.0), sys.argv[2].split(",")), Path(sys.argv[3]), True)
    print(json.dumps([e.__dict__ for e in r.events], indent=1), r.returncode, f"{r.wall_seconds:.0f} s")
