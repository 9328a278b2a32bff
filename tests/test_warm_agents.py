"""The suite's warm torchrun agents and sidecars (demo/zygote.py) behave as ones started cold: an
agent's workers see the same directory, arguments and environment, the same restarts happen, the
same exit statuses come back, and SIGTERM ends an agent and its workers the same way; a sidecar
serves, takes its settings and ends on SIGTERM as a cold one does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from demo import zygote
from tests.support import ROOT, Sidecar, spawned, wait_until

pytestmark = pytest.mark.slow

WORKER = textwrap.dedent("""
    import json, os, sys, time
    out = os.environ["OUT"]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with open(os.path.join(out, f"attempt{attempt}.json"), "w") as f:
        json.dump({"cwd": os.getcwd(), "argv": sys.argv[1:], "mark": os.environ.get("MARK"),
                   "restart_count": attempt, "world": os.environ["WORLD_SIZE"]}, f)
    if sys.argv[1] == "sleep":
        time.sleep(600)
    sys.exit(3 if attempt == 0 or sys.argv[1] == "fail" else 0)
""")


def agent(tmp_path: Path, mode: str, name: str, launcher: tuple[str, ...] = ("torch.distributed.run",)) -> list[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return [
        sys.executable, "-m", *launcher, "--standalone", "--nproc-per-node", "1",
        "--max-restarts", "1", "--monitor-interval", "0.1", str(script), mode, name,
    ]  # fmt: skip


def run(tmp_path: Path, mode: str, warm: bool, launcher: tuple[str, ...] = ("torch.distributed.run",)) -> dict:
    """One agent's exit status, what its workers saw, and whether it was forked warm."""
    out = tmp_path / f"{mode}-{'warm' if warm else 'cold'}-{launcher[0]}"
    out.mkdir()
    env = {"OUT": str(out), "MARK": "m-1"}
    saved = os.environ.pop(zygote.ENV) if not warm else None
    try:
        with spawned(agent(tmp_path, mode, out.name, launcher), out / "agent.log", env=env, cwd=tmp_path) as proc:
            forked = isinstance(proc, zygote.WarmProcess)
            if mode == "sleep":
                wait_until(lambda: (out / "attempt0.json").exists(), 60, what="the worker started")
                worker = json.loads((out / "attempt0.json").read_text())
                proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=120)
    finally:
        if saved is not None:
            os.environ[zygote.ENV] = saved
    seen = [json.loads(p.read_text()) for p in sorted(out.glob("attempt*.json"))]
    for s in seen:
        assert s.pop("argv") == [mode, out.name] and Path(s.pop("cwd")) == tmp_path
    if mode == "sleep":
        assert worker  # the worker was up when the agent was signalled
    return {"code": code, "seen": seen, "forked": forked, "log": (out / "agent.log").read_text()}


def test_a_warm_agent_restarts_fails_and_ends_on_sigterm_as_a_cold_one(tmp_path):
    assert os.environ.get(zygote.ENV), "the suite starts its agents warm (tests/conftest.py)"
    for mode in ("restart", "fail", "sleep"):
        warm, cold = run(tmp_path, mode, warm=True), run(tmp_path, mode, warm=False)
        assert (warm["forked"], cold["forked"]) == (True, False)
        assert warm["code"] == cold["code"], (mode, warm["log"][-2000:], cold["log"][-2000:])
        assert warm["seen"] == cold["seen"], mode
        attempts = [s["restart_count"] for s in warm["seen"]]
        assert attempts == {"restart": [0, 1], "fail": [0, 1], "sleep": [0]}[mode], attempts
        assert warm["code"] == {"restart": 0, "fail": 1, "sleep": warm["code"]}[mode], warm["log"][-2000:]
        assert all(s["mark"] == "m-1" and s["world"] == "1" for s in warm["seen"])
    assert warm["code"] != 0  # SIGTERM: torchrun's own handling, the same warm and cold


def test_the_projects_own_torchrun_runs_warm_as_it_runs_cold(tmp_path):
    """`trainer_hooks.launch --warm` (torchrun whose workers are forked functions) from the same
    server, importing the rest of what it needs in the child: the same restarts and exit statuses,
    the workers see the same directory, arguments and environment."""
    launcher = ("trainer_hooks.launch", "--warm")
    assert zygote.eligible([sys.executable, "-m", *launcher]) == "torch.distributed.run"
    assert zygote.eligible([sys.executable, "-m", "sidecar_trainer.launch"]) == "torch.distributed.run"
    for mode in ("restart", "fail"):
        warm, cold = run(tmp_path, mode, True, launcher), run(tmp_path, mode, False, launcher)
        assert (warm["forked"], cold["forked"]) == (True, False)
        assert warm["code"] == cold["code"] == {"restart": 0, "fail": 1}[mode], (
            warm["log"][-2000:],
            cold["log"][-2000:],
        )
        assert warm["seen"] == cold["seen"] and [s["restart_count"] for s in warm["seen"]] == [0, 1], mode


def test_what_the_server_cannot_honour_is_started_cold(tmp_path):
    cmd = agent(tmp_path, "restart", "x")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    module = "torch.distributed.run"
    assert zygote.refusal({"argv": cmd, "env": env}, module) is None
    assert zygote.refusal({"argv": cmd, "env": {**env, "LOGLEVEL": "DEBUG"}}, module) == "read at import: LOGLEVEL"
    hashed = {"argv": cmd, "env": {**env, "PYTHONHASHSEED": "1"}}
    assert zygote.refusal(hashed, module) == "read at import: PYTHONHASHSEED"
    assert zygote.refusal({"argv": cmd, "env": {**env, "PYTHONUNBUFFERED": ""}}, module) == "buffered output"
    netns = {"argv": ["ip", "netns", "exec", "n0", *cmd], "env": env}
    assert zygote.refusal(netns, module) == "not torch.distributed.run"
    assert zygote.refusal({"argv": cmd, "env": env}, "sidecar") == "not sidecar"
    assert zygote.eligible([sys.executable, "-m", "sidecar", "status"]) is None  # a command, not the daemon
    assert zygote.eligible([sys.executable, "-m", "sidecar", "run", "--listen", "x"]) == "sidecar"
    assert zygote.spawn(["runuser", "-u", "x", "--", *cmd], env, ROOT, tmp_path / "log") is None
    refused = zygote.spawn(cmd, {**env, "LOGLEVEL": "DEBUG"}, ROOT, tmp_path / "log")
    assert refused is None and not (tmp_path / "log").exists()


def test_a_warm_sidecar_serves_takes_its_settings_and_ends_on_sigterm_as_a_cold_one(tmp_path):
    seen = {}
    for warm in (True, False):
        saved = os.environ.pop(zygote.ENV) if not warm else None
        try:
            with Sidecar(tmp_path / str(warm), "node_name=warm-or-not") as sidecar:
                assert isinstance(sidecar.proc, zygote.WarmProcess) == warm
                status = sidecar.status()
                sidecar.proc.send_signal(signal.SIGTERM)
                code = sidecar.proc.wait(timeout=30)
        finally:
            if saved is not None:
                os.environ[zygote.ENV] = saved
        seen[warm] = (code, status["node"]["name"], sorted(status), sorted(status["node"]))
    assert seen[True] == seen[False], seen
    assert seen[True][:2] == (0, "warm-or-not"), seen


def test_a_warm_agent_that_outlives_the_wait_is_reported_running(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with spawned(agent(tmp_path, "sleep", "x"), tmp_path / "agent.log", env={"OUT": str(out)}) as proc:
        assert isinstance(proc, zygote.WarmProcess)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
        assert proc.poll() is None and Path(f"/proc/{proc.pid}").exists()
    assert proc.returncode is not None  # spawned killed its tree, and the server reported the exit


def test_only_the_process_that_set_the_servers_up_uses_them(tmp_path):
    """A test's own subprocess inherits ENV; one in a pid namespace of its own (tests/security's
    namespace cases) got its sidecar forked outside the namespace, which saw host pids. Only the
    process OWNER_ENV names (its pid and pid namespace) is served."""
    code = (
        "import sys; from demo import zygote; "
        "import os; env = {**os.environ, 'PYTHONUNBUFFERED': '1'}; "
        "print(zygote.spawn([sys.executable, '-m', 'sidecar', 'run', '--bad'], env, '.', sys.argv[1]))"
    )
    with Sidecar(tmp_path / "sc") as sidecar:  # this process's sidecar server is up
        assert isinstance(sidecar.proc, zygote.WarmProcess)
        out = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "log")], cwd=ROOT, capture_output=True, text=True
        )
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stdout + out.stderr
    assert os.environ[zygote.OWNER_ENV] == zygote.owner() and not (tmp_path / "log").exists()
