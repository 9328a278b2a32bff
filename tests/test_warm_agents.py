"""The suite's warm torchrun agents and sidecars (harness/zygote.py) behave as ones started cold: an
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

from harness import zygote
from tests.support import COLD_RANKS, ROOT, Sidecar, spawned, wait_until

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


RANK = textwrap.dedent("""
    import atexit, json, os, signal, sys, threading, time
    forked = "torch" in sys.modules  # a warm worker is forked with torch imported
    hooks = "trainer_hooks" in sys.modules
    import numpy, torch
    ANNOTATED: int = 0  # a real type, as an interpreter compiles the script (no future flags of ours)
    out, attempt, rank = os.environ["OUT"], os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["LOCAL_RANK"]
    seen = {
        "forked": forked, "argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "name": __name__,
        "main": sys.modules["__main__"].__file__, "threads": torch.get_num_threads(),
        "session": os.getsid(0) == os.getpgid(0) == os.getpid(), "stdin": os.readlink("/proc/self/fd/0"),
        "signals": {s: str(signal.getsignal(getattr(signal, s))) for s in
                    ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGCHLD", "SIGPIPE", "SIGXFSZ")},
        "env": {k: os.environ.get(k) for k in ("MARK", "RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS")},
        "write_through": sys.stdout.write_through, "hooks": hooks, "annotation": str(__annotations__["ANNOTATED"]),
        "draw": numpy.random.random(),  # numpy seeds its global generator at import: each worker its own
    }
    with open(os.path.join(out, f"seen-{attempt}-{rank}.json"), "w") as f:
        json.dump(seen, f)
    print(f"rank {rank} of attempt {attempt} says hello")
    atexit.register(lambda: open(os.path.join(out, f"atexit-{attempt}-{rank}"), "w").close())
    def late():
        time.sleep(0.3)
        open(os.path.join(out, f"thread-{attempt}-{rank}"), "w").close()
    threading.Thread(target=late).start()  # not a daemon: the interpreter joins it at its end
    if rank == "1":
        sys.exit(0)
    time.sleep(1.0)  # rank 1 ends first: torchrun signals no worker that is still running
    if attempt == "0":
        raise RuntimeError("attempt 0 fails")
    sys.exit(7)
""")


def ranks_run(tmp_path: Path, cold_ranks: bool) -> dict:
    """A warm agent's two workers, forked warm or started cold: what they saw, their output, the exit status."""
    out = tmp_path / ("cold" if cold_ranks else "warm")
    out.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", "--monitor-interval", "0.1", str(script), "a b", "--flag",
    ]  # fmt: skip
    env = {"OUT": str(out), "MARK": "m-2", "PYTHONPATH": str(ROOT), **(COLD_RANKS if cold_ranks else {})}
    with spawned(cmd, out / "agent.log", env=env, cwd=tmp_path) as proc:
        assert isinstance(proc, zygote.WarmProcess)
        code = proc.wait(timeout=60)
    seen = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("seen-*.json"))}
    ends = sorted(p.name for p in out.iterdir() if p.name.startswith(("atexit-", "thread-")))
    return {"code": code, "seen": seen, "ends": ends, "log": (out / "agent.log").read_text()}


def test_a_warm_agents_workers_forked_warm_see_do_and_end_as_new_interpreters(tmp_path):
    """harness/zygote_ranks.py: the same directory, arguments, sys.path, `__main__`, session, signals,
    environment and thread count (OMP_NUM_THREADS=1 from torchrun for two workers) as workers
    started cold; the same output, uncaught exception, exit status, restart, atexit and thread join."""
    warm, cold = ranks_run(tmp_path, cold_ranks=False), ranks_run(tmp_path, cold_ranks=True)
    assert warm["code"] == cold["code"] == 1, (warm["log"][-3000:], cold["log"][-3000:])
    assert sorted(warm["seen"]) == sorted(cold["seen"]) == ["seen-0-0", "seen-0-1", "seen-1-0", "seen-1-1"]
    draws = [w.pop("draw") for w in warm["seen"].values()]
    assert len(set(draws)) == len(draws), draws
    for key, w in warm["seen"].items():
        c = cold["seen"][key]
        assert (w.pop("forked"), c.pop("forked")) == (True, False), key
        c.pop("draw")
        assert w == c, key
        assert w["threads"] == 1 and w["env"]["OMP_NUM_THREADS"] == "1" and w["session"] and w["name"] == "__main__"
        assert w["argv"] == [str(tmp_path / "rank.py"), "a b", "--flag"] and w["path"][0] == str(tmp_path)
        assert not w["hooks"]  # nothing of the project's imported before the script imports it
        assert w["annotation"] == "<class 'int'>"
    expected = [f"{end}-{a}-{r}" for end in ("atexit", "thread") for a in "01" for r in "01"]
    assert warm["ends"] == cold["ends"] == expected
    for run_ in (warm, cold):
        assert "RuntimeError: attempt 0 fails" in run_["log"] and "exitcode  : 7" in run_["log"], run_["log"][-3000:]
        assert all(f"rank {r} of attempt {a} says hello" in run_["log"] for a in "01" for r in "01")
    assert "started cold" not in warm["log"] and "started cold" not in cold["log"]


DDP_END = textwrap.dedent("""
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(20):
        opt.zero_grad()
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
    print(f"rank {dist.get_rank()} trained", flush=True)  # one write: the two ranks share the agent's output
    dist.destroy_process_group()
""")


def test_a_warm_worker_ends_with_its_ddp_model_alive_without_hanging(tmp_path):
    """A script that destroys its group and ends, its DDP model (the group's last owner) alive. Run in
    a module that runpy frees on return, the model went while the script's process was still
    running, and the gloo group's destructor waited, holding the GIL, for its thread that needed it:
    about half the workers hung. A new interpreter (and now a warm worker) keeps `__main__` to the end."""
    script = tmp_path / "ddp_end.py"
    script.write_text(DDP_END)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    for run_ in range(4):
        log = tmp_path / f"ddp-{run_}.log"
        with spawned(cmd, log, env={"PYTHONPATH": str(ROOT)}, cwd=tmp_path) as proc:
            assert isinstance(proc, zygote.WarmProcess)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"run {run_}: a worker hung at its end\n{log.read_text()[-2000:]}")
        text = log.read_text()
        assert code == 0 and "rank 0 trained" in text and "rank 1 trained" in text, text[-2000:]
        assert "started cold" not in text


ZOMBIE = textwrap.dedent("""
    import os, sys, time
    from harness import zygote, zygote_ranks
    zygote.IMPORTED_WITH.update(os.environ)
    zygote.BASE_PATH[:] = sys.path[1:]
    path, _ = zygote_ranks.start_server(sys.argv[1])
    script = os.path.join(sys.argv[1], "ends.py")
    with open(script, "w") as f:
        f.write("raise SystemExit(3)")
    files = {"stdout": None, "stderr": None}
    proc = zygote_ranks.spawn(path, [sys.executable, "-u", script], dict(os.environ), files, alive=lambda: True)
    assert isinstance(proc, zygote.WarmProcess), proc
    state = lambda: open(f"/proc/{proc.pid}/stat").read().rsplit(") ", 1)[1][0]
    deadline = time.monotonic() + 30
    while state() != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # time for a server that reaps at once to have done so
    os.killpg(proc.pid, 0)  # torchrun's close of a worker whose end it has not polled yet
    print("code", proc.wait(10), flush=True)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{proc.pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    print("reaped", not os.path.exists(f"/proc/{proc.pid}"))
""")


def test_a_worker_that_ended_stays_to_be_signalled_until_its_agent_reads_its_status(tmp_path):
    """torchrun closes a group by `killpg` of each worker its last poll saw running; a worker of its
    own that ended since is a zombie until the next poll, so the signal finds it. A rank server that
    reaped at once left no process group: torchrun's agent died of ProcessLookupError (a SIGKILLed
    worker in tests/trainer/test_resume.py, beside the suite)."""
    done = subprocess.run(
        [sys.executable, "-c", ZOMBIE, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["code", "3", "reaped", "True"], done.stdout + done.stderr


def test_what_a_warm_agent_cannot_fork_warm_starts_cold(tmp_path):
    from harness import zygote_ranks

    cmd = [sys.executable, "-u", str(tmp_path / "rank.py"), "x"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    zygote.IMPORTED_WITH.update(env)
    try:
        assert zygote_ranks.refusal(cmd, env) is None
        lazy = {**env, "OMP_NUM_THREADS": "1", "TORCHELASTIC_RESTART_COUNT": "3", "TORCH_FR_BUFFER_SIZE": "64"}
        assert zygote_ranks.refusal(cmd, lazy) is None
        assert zygote_ranks.refusal([sys.executable, "-u", "-m", "pkg.mod"], env) is None
        assert zygote_ranks.refusal(cmd, {**env, "TORCH_LOGS": "+dynamo"}) == "read at import: TORCH_LOGS"
        zygote.SET_BY_IMPORT["TORCHINDUCTOR_CACHE_DIR"] = "/tmp/torchinductor_x"  # torch._dynamo's import sets it
        assert zygote_ranks.refusal(cmd, {**env, "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_x"}) is None
        chosen = zygote_ranks.refusal(cmd, {**env, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"})
        assert chosen == "read at import: TORCHINDUCTOR_CACHE_DIR"
        assert zygote_ranks.refusal(cmd, {**env, "PYTHONHASHSEED": "3"}) == "read at import: PYTHONHASHSEED"
        zygote.IMPORTED_WITH["PYTORCH_JIT"] = "0"  # the server imported torch with it; the worker has none
        assert zygote_ranks.refusal(cmd, env) == "read at import: PYTORCH_JIT"
        del zygote.IMPORTED_WITH["PYTORCH_JIT"]
        assert zygote_ranks.refusal(cmd, {**env, "OMP_NUM_THREADS": "x"}) == "OMP_NUM_THREADS='x'"
        assert zygote_ranks.refusal(["/usr/bin/python3", *cmd[1:]], env).startswith("not ")  # PYTHON_EXEC
        assert zygote_ranks.refusal([sys.executable, cmd[2]], env).startswith("not ")  # no -u
        assert zygote_ranks.refusal([sys.executable, "-u", "-X", "dev", cmd[2]], env) == "interpreter option -X"
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text("")  # zero-code attach runs at an interpreter's start
        why = zygote_ranks.refusal(cmd, {**env, "PYTHONPATH": f"{ROOT}{os.pathsep}{site}"})
        assert why == f"{site} holds a site customisation (run at an interpreter's start)"
        attach = ROOT / "trainer_hooks" / "autoattach"
        assert zygote_ranks.refusal(cmd, {**env, "PYTHONPATH": str(attach)}) is not None
    finally:
        zygote.IMPORTED_WITH.clear()
        zygote.SET_BY_IMPORT.clear()


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
        "import sys; from harness import zygote; "
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
