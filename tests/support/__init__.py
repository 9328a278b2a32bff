"""Helpers shared by the tests: the one settings builder, free ports, processes started in
their own session and always killed (with their children) at teardown, HTTP readiness waits."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from harness.processes import (
    free_port,  # noqa: F401  (the tests' own: each worker's range, tests/conftest.py)
    start_logged,
)
from sidecar.config import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
# The suite's warm agents fork their workers from a process that imported torch (harness/zygote_ranks.py);
# the tests of the restart paths (the user's own scripts: plain, HF, Lightning, the README's, attach)
# have torchrun start them as it does on a cluster, new interpreters.
COLD_RANKS = {"SIDECAR_TEST_COLD_RANKS": "1"}
PYTHON = sys.executable
# Prefix for a rank whose CPU use a test relies on (the watchdog spares a busy rank only while it
# gets 20% of a core): ahead of the other test workers' processes on a loaded 2-core machine, where
# a rank at the default priority got less and was judged by its CPU alone. With the kernel's
# autogroups (sched_autogroup_enabled, on here) a nice value only ranks a process within its
# session's group, and each session (every sidecar and job the tests start with a session of their
# own) shares the CPUs as one: at nice -10 alone a spinning rank got 18% of a core beside the suite.
# So the rank gets a session of its own (setsid execs in place: the pid is the rank's) whose group
# is niced too. Root lowers niceness; anyone else runs it at the default (nice says so and runs it).
CPU_FIRST = [
    "setsid",
    "sh",
    "-c",
    'echo -10 > /proc/self/autogroup 2>/dev/null; exec nice -n -10 "$@"',
    "cpu-first",
]


def make_settings(tmp_path: Path, *presets: Mapping[str, Any], **overrides: Any) -> Settings:
    """Typed settings for a test, from no file and no environment: the diagnostics directory
    and the socket under `tmp_path`, then each preset (an area's defaults, such as
    `tests.daemon.helpers.DAEMON`), then `overrides`. Keys name settings by their dotted
    path; as keywords `__` stands for the dot: `limits__max_jobs=3` or `**{"limits.max_jobs": 3}`."""
    values: dict[str, Any] = {"diag_dir": str(tmp_path / "diag"), "socket": str(tmp_path / "sidecar.sock")}
    for preset in presets:
        values.update(preset)
    values.update({key.replace("__", "."): value for key, value in overrides.items()})
    return load_settings(overrides=values, environ={})


def kill_tree(proc: subprocess.Popen | int, timeout: float = 10.0) -> None:
    """SIGTERM a process and all its descendants, then SIGKILL what is left."""
    pid = proc if isinstance(proc, int) else proc.pid
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGCONT)
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout)
    if isinstance(proc, subprocess.Popen):
        with contextlib.suppress(Exception):
            proc.wait(timeout=timeout)


@contextlib.contextmanager
def spawned(
    cmd: Sequence[str], log_path: Path, env: dict | None = None, cwd: Path | None = None
) -> Iterator[subprocess.Popen]:
    """Start `cmd` in a new session with output to `log_path`; kill its tree on exit."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    proc = start_logged(cmd, full_env, cwd or ROOT, log_path)
    try:
        yield proc
    finally:
        kill_tree(proc)


def wait_until(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET an http://host:port/path URL; (status, body), or (0, b"") when unreachable."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    if u.hostname is None:
        raise ValueError(f"no host in {url}")
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("GET", u.path + (("?" + u.query) if u.query else ""))
        resp = conn.getresponse()
        return resp.status, resp.read()
    except OSError:
        return 0, b""
    finally:
        conn.close()


def http_json(url: str, timeout: float = 5.0):
    status, body = http_get(url, timeout)
    if status != 200:
        raise RuntimeError(f"GET {url} -> {status}: {body[:200]!r}")
    return json.loads(body)


def tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


class Sidecar:
    """A real `sidecar run` process on a free port and a private socket."""

    def __init__(self, workdir: Path, *settings: str, env: dict | None = None, name: str = "sidecar"):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.socket = str(self.workdir / f"{name}.sock")
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.workdir / f"{name}.log"
        self.settings = list(settings)
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self._cm: contextlib.AbstractContextManager[subprocess.Popen] | None = None

    def command(self) -> list[str]:
        cmd = [
            PYTHON,
            "-m",
            "sidecar",
            "run",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--socket",
            self.socket,
            "--set",
            f"diag_dir={self.workdir / 'diag'}",
            "--set",
            "collectors.interval_seconds=1",
            # Tests read /metrics right after what they changed: every scrape renders.
            "--set",
            "metrics_reuse_seconds=0",
        ]
        for s in self.settings:
            cmd += ["--set", s]
        return cmd

    def start(self, timeout: float = 30.0) -> Sidecar:
        self._cm = spawned(self.command(), self.log, env=self.env)
        self.proc = self._cm.__enter__()
        try:
            wait_until(
                lambda: self.proc.poll() is not None or http_get(self.url + "/readyz")[0] == 200,
                timeout,
                what=f"sidecar ready on {self.url}",
            )
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with {self.proc.returncode}:\n{tail(self.log)}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._cm is not None:
            cm, self._cm = self._cm, None
            cm.__exit__(None, None, None)

    def status(self) -> dict:
        return http_json(self.url + "/v1/status")

    def metrics(self) -> str:
        status, body = http_get(self.url + "/metrics")
        assert status == 200, status
        return body.decode()

    def hook_env(self) -> dict:
        return {"SIDECAR_SOCKET": self.socket}

    def __enter__(self) -> Sidecar:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
