"""Processes the demo, the benchmarks and the tests start: each in its own session with its output
in a log file, and all of them (with everything they started, torchrun's workers included) killed on the way out."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

import psutil

from harness import zygote

PORTS_ENV = "DEMO_PORTS"  # "LOW-HIGH": take free ports from this range, in turn
_turn = random.randrange(1 << 16)  # where this process starts in the range (its children start elsewhere)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process to bind a moment later. The kernel's pick
    (port 0) may hand the same port to someone else in that moment: with DEMO_PORTS=LOW-HIGH set
    (a range below the ephemeral ports, one per concurrent run: the test suite gives each worker
    its own) ports come from that range in turn instead, never twice to two runs."""
    span = os.environ.get(PORTS_ENV)
    if span:
        global _turn
        low, high = (int(x) for x in span.split("-"))
        for _ in range(high - low):
            port, _turn = low + _turn % (high - low), _turn + 1
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_logged(cmd: Sequence[str], env: dict[str, str], cwd: str | Path, log_path: str | Path) -> subprocess.Popen:
    """`cmd` in a session of its own, its output appended to `log_path`: forked warm where the test
    suite set that up for it (a torchrun agent, a sidecar: harness/zygote.py), else a new process."""
    proc = zygote.spawn(cmd, env, cwd, log_path)
    if proc is None:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(cwd), start_new_session=True
            )
    return proc


class Processes:
    """A context manager owning the processes it started."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.started: list[subprocess.Popen] = []

    def start(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = start_logged(cmd, full_env, Path(__file__).resolve().parent.parent, self.log(name))
        self.started.append(proc)
        return proc

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def stop(self, proc: subprocess.Popen, timeout: float = 10.0) -> None:
        """SIGTERM the process, its group and its descendants (torchrun's workers live in their
        own sessions), then SIGKILL whatever is left."""
        try:
            tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, sig)
            for p in tree:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(signal.SIGCONT)
                    p.send_signal(sig)
            _, tree = psutil.wait_procs(tree, timeout=timeout if sig == signal.SIGTERM else 5)
            if not tree:
                break
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)

    def close(self) -> None:
        for proc in reversed(self.started):
            self.stop(proc)
        self.started.clear()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
