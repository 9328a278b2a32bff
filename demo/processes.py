"""Processes the demo starts: each in its own session with its output in a log file, and all of
them (with everything they started, torchrun's workers included) killed on the way out."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """A context manager owning the processes it started."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.started: list[subprocess.Popen] = []

    def start(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(self.workdir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                list(cmd),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=Path(__file__).resolve().parent.parent,
                start_new_session=True,
            )
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
