"""Helpers of the operator-side tests: running the `sidecar` CLI as operators do (a
subprocess, stdout piped), and registering ranks on a live sidecar over its Unix socket."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from sidecar.commands.client import UnixHTTPConnection
from sidecar.preflight import cli
from tests.support import ROOT, Sidecar, wait_until

CLI_TIMEOUT = 180  # generous: only catches hangs on a loaded machine


def run_cli(*args: str, env: dict | None = None, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess:
    """`sidecar ARGS...` with stdout and stderr piped (so: plain text, no terminal)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        timeout=timeout,
    )


def post(socket_path: str, path: str, body: dict) -> tuple[int, dict]:
    conn = UnixHTTPConnection(socket_path, timeout=10)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


class Rank:
    """A registered rank whose process is a `sleep` child of the test, so the sidecar's peer
    check (the connecting process is the rank or its ancestor) holds and nothing the
    watchdog might do can reach the test process itself."""

    def __init__(self, sidecar: Sidecar, job_id: str, rank: int, versions: dict | None = None):
        self.sidecar, self.job_id, self.rank = sidecar, job_id, rank
        self.proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
        try:
            status, answer = post(
                sidecar.socket,
                "/v1/register",
                {
                    "job_id": job_id,
                    "rank": rank,
                    "local_rank": rank,
                    "world_size": 8,
                    "local_world_size": 8,
                    "restart_count": 0,
                    "pid": self.proc.pid,
                    "step": None,
                    "phase": None,
                    "versions": versions or {},
                    "hooks_version": "0.1.0",
                },
            )
            assert status == 200, answer
        except BaseException:
            self.close()
            raise
        self.step = 0

    def push_step(self, loss: float = 2.5) -> None:
        import time

        self.step += 1
        status, answer = post(
            self.sidecar.socket,
            "/v1/push",
            {
                "job_id": self.job_id,
                "rank": self.rank,
                "pid": self.proc.pid,
                "dropped": 0,
                "items": [
                    {
                        "type": "step",
                        "step": self.step,
                        "time": time.time(),
                        "metrics": {"loss": loss, "grad_norm": 0.8, "step_time_seconds": 0.1},
                    }
                ],
            },
        )
        assert status == 200, answer

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def rank_state(sidecar: Sidecar, rank: int) -> str | None:
    for r in sidecar.status()["ranks"]:
        if r["rank"] == rank:
            return r["state"]
    return None


def wait_for_state(sidecar: Sidecar, rank: int, state: str, timeout: float = 60.0) -> None:
    wait_until(lambda: rank_state(sidecar, rank) == state, timeout, interval=0.2, what=f"rank {rank} to be {state}")


def preflight_args(**over) -> argparse.Namespace:
    """The namespace `sidecar preflight` would parse, with overrides."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in over.items():
        setattr(args, key, value)
    return args
