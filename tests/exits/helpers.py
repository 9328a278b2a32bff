"""Helpers of the exit tests: the rank stand-in (tests/exits/exit_rank.py) that dies in chosen
ways, the sidecar's settings for them, and what the sidecar decided about each exit."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

from sidecar.commands.client import UnixHTTPConnection
from tests.support import PYTHON, ROOT, Sidecar, spawned, tail, wait_until

RANK = str(ROOT / "tests" / "exits" / "exit_rank.py")


SETTINGS = (
    "watchdog.check_interval_seconds=0.25",
    "hooks_flush_interval_seconds=0.5",
    "remediation.py_spy=false",
    "remediation.dump_wait_seconds=0.5",
    "remediation.grace_seconds=2",
    "watchdog.floor_seconds=60",
    "exits.group_seconds=20",
)


HANG_SETTINGS = SETTINGS + ("watchdog.floor_seconds=3",)


TIMEOUT = 120.0  # generous: the machine is shared


def rank_env(sidecar: Sidecar, job_id: str, rank: int = 0, world: int = 1) -> dict:
    return {
        **sidecar.hook_env(),
        "TORCHELASTIC_RUN_ID": job_id,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "PYTHONPATH": str(ROOT),
    }


class Rank:
    """One exit_rank.py process in its own session; killed (with its tree) at teardown."""

    def __init__(self, tmp_path: Path, env: dict, mode: str, *args: str, name: str = "rank"):
        self.ready, self.go = tmp_path / f"{name}.ready", tmp_path / f"{name}.go"
        self.log = tmp_path / f"{name}.log"
        self._cm = spawned(
            [PYTHON, RANK, "--mode", mode, "--ready", str(self.ready), "--go", str(self.go), *args], self.log, env=env
        )
        self.proc = self._cm.__enter__()

    def wait_ready(self) -> Rank:
        wait_until(lambda: self.ready.exists() or self.proc.poll() is not None, TIMEOUT, what="rank ready")
        assert self.proc.poll() is None, f"rank exited early:\n{tail(self.log)}"
        return self

    def start_fatal(self) -> None:
        self.go.touch()

    def wait(self, timeout: float = TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank still running:\n{tail(self.log)}") from None

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


def exits_of(sidecar: Sidecar, job_id: str) -> list[dict]:
    """The job's decided exits, from its exit incidents and the status document."""
    found = []
    for incident in incidents(sidecar, "exit"):
        if incident["job_id"] == job_id:
            found += incident["exits"]
    return found


def incidents(sidecar: Sidecar, kind: str | None = None) -> list[dict]:
    directory = sidecar.workdir / "diag" / "incidents"
    out = []
    for p in sorted(directory.glob("*.json")):
        with contextlib.suppress(ValueError, OSError):
            record = json.loads(p.read_text())
            if kind is None or record.get("kind", "stall") == kind:
                out.append(record)
    return out


def counted(sidecar: Sidecar, job_id: str, name: str = "sidecar_rank_exits_total") -> dict[str, float]:
    """A counter of the job (sidecar_rank_exits_total), by reason."""
    out = {}
    for line in sidecar.metrics().splitlines():
        if line.startswith(name + "{") and f'job_id="{job_id}"' in line:
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def wait_for_exit(
    sidecar: Sidecar,
    job_id: str,
    reason: str | None = None,
    rank: int | None = None,
    timeout: float = 60.0,
    restart: int | None = None,
) -> dict:
    """The first counted exit of the job (of that rank, with that reason) once decided."""

    def decided():
        try:
            recent = sidecar.status()["exits"]["recent"]
        except Exception:
            return None
        for e in recent:
            if (
                e["job_id"] == job_id
                and (rank is None or e["rank"] == rank)
                and (reason is None or e["reason"] == reason)
                and (restart is None or e.get("restart_count") == restart)
            ):
                return e
        return None

    try:
        exit_ = wait_until(decided, timeout, interval=0.2, what=f"an exit of {job_id} ({reason})")
    except TimeoutError:
        raise AssertionError(
            f"no exit {reason} of {job_id}; status exits: {sidecar.status().get('exits')}\n{tail(sidecar.log, 30)}"
        ) from None
    if exit_.get("incident"):
        # decided before its incident is on disk (the tracker writes it off the event loop): a
        # caller reads the incident next, so wait for the file to hold this exit
        wait_until(lambda: _filed(sidecar, exit_), 30, interval=0.1, what=f"exit incident {exit_['incident']}")
    return exit_


def _filed(sidecar: Sidecar, exit_: dict) -> bool:
    path = sidecar.workdir / "diag" / "incidents" / f"{exit_['incident']}.json"
    try:
        record = json.loads(path.read_text())
    except (ValueError, OSError):
        return False
    exits = record.get("exits", [])
    full = len(exits) >= 32  # sidecar/exits/incidents.py MAX_INLINE_EXITS: later exits are only counted
    return full or any(e.get("rank") == exit_["rank"] and e.get("time") == exit_["time"] for e in exits)


def register(sidecar: Sidecar, job_id: str, pid: int, rank: int = 0) -> dict:
    """Register `pid` as a launcher does (this test process is its parent): a rank without hooks."""
    body = {"job_id": job_id, "rank": rank, "local_rank": rank, "world_size": 1, "local_world_size": 1, "pid": pid}
    conn = UnixHTTPConnection(sidecar.socket, 10)
    try:
        conn.request("POST", "/v1/register", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        assert resp.status == 200, answer
        return answer
    finally:
        conn.close()
