"""Helpers for the hooks' tests: a real rank process (tests/hooks/rank.py) run to completion
or in the background, a real socket server that accepts connections and never answers (a
hung sidecar), and readers of the sidecar's status and metrics."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from tests.support import PYTHON, ROOT, Sidecar, spawned, tail, wait_until

RANK_TIMEOUT = 60.0
TOKEN = "s3cret-token"  # the bearer token of the shared test sidecar's TCP push API


class HungServer:
    """Listens on a Unix socket, accepts every connection, reads nothing, answers nothing."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.connections = 0
        self._held: list[socket.socket] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(128)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            self._held.append(conn)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for conn in self._held:
            conn.close()
        self._thread.join(5)


def rank_command(result: Path, *args: str) -> list[str]:
    return [PYTHON, "-m", "tests.hooks.rank", "--result", str(result), *args]


def rank_env(sidecar: Sidecar | None, job_id: str, **extra: str) -> dict:
    env = {"TORCHELASTIC_RUN_ID": job_id, "RANK": "0", "WORLD_SIZE": "1", "PYTHONPATH": str(ROOT)}
    if sidecar is not None:
        env.update(sidecar.hook_env())
    env.update(extra)
    return env


def run_rank(tmp_path: Path, env: dict, *args: str, timeout: float = RANK_TIMEOUT) -> dict:
    """Run a rank to completion; its result."""
    result = tmp_path / f"rank-{len(list(tmp_path.glob('rank-*.json')))}.json"
    log = result.with_suffix(".log")
    with spawned(rank_command(result, *args), log, env=env) as proc:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank did not finish in {timeout}s:\n{tail(log)}")
    assert rc == 0, f"rank exited with {rc}:\n{tail(log)}"
    return json.loads(result.read_text())


class RankProcess:
    """A rank running in the background; `finish()` releases its --hold-until and returns its result."""

    def __init__(self, tmp_path: Path, env: dict, *args: str, name: str = "rank"):
        self.result = tmp_path / f"{name}.json"
        self.log = tmp_path / f"{name}.log"
        self.release = tmp_path / f"{name}.release"
        self.stop_file = tmp_path / f"{name}.stop"
        self.ready = tmp_path / f"{name}.ready"
        self._cm = spawned(
            rank_command(
                self.result,
                "--hold-until",
                str(self.release),
                "--run-until",
                str(self.stop_file),
                "--ready",
                str(self.ready),
                *args,
            ),
            self.log,
            env=env,
        )
        self.proc = self._cm.__enter__()
        wait_until(lambda: self.ready.exists() or self.proc.poll() is not None, RANK_TIMEOUT, what="rank start")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def finish(self, timeout: float = RANK_TIMEOUT) -> dict:
        self.stop_file.touch()
        self.release.touch()
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank did not finish in {timeout}s:\n{tail(self.log)}")
        finally:
            self.kill()
        assert rc == 0, f"rank exited with {rc}:\n{tail(self.log)}"
        return json.loads(self.result.read_text())

    def kill(self) -> None:
        if self._cm is not None:
            cm, self._cm = self._cm, None
            cm.__exit__(None, None, None)


def rank_status(sidecar: Sidecar, job_id: str, rank: int = 0) -> dict | None:
    """The rank's entry in the sidecar's /v1/status, or None."""
    try:
        status = sidecar.status()
    except (RuntimeError, OSError, ValueError):
        return None
    return next((r for r in status.get("ranks", []) if r["job_id"] == job_id and r["rank"] == rank), None)


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of one series in a Prometheus exposition, or None."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


def disabled_env(**extra: str) -> dict:
    env = {"SIDECAR_HOOKS_DISABLED": "1", "PYTHONPATH": str(ROOT)}
    env.update(extra)
    return env
