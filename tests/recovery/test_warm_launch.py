"""Warm restarts for any script (`python -m trainer_hooks.launch --warm`, issue 32 item 3): every
attempt's workers are forks of a server that imported torch once, and the script keeps the
semantics it has under plain torchrun (a new `__main__`, argv, sys.path[0], torchrun's
environment, exit status, CUDA untouched before the fork)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench.bench_cycles import warm_launcher
from bench.cycles.runner import run_cycles
from tests.support import PYTHON, ROOT, spawned, tail
from trainer_hooks import warm
from trainer_hooks.launch import torchrun_argv

PROBE = """
import sys
TORCH_BEFORE = "torch" in sys.modules  # the point of warm mode: already imported
import atexit, json, multiprocessing, os
import torch
import torch.distributed.rendezvous
import trainer_hooks.distributed
COUNTER = globals().get("COUNTER", 0) + 1  # fresh globals: 1 in every worker of every attempt
ANNOTATED: int = 0  # a real type: the script compiled as the interpreter compiles it
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = os.environ["PROBE_OUT"]
atexit.register(lambda: open(os.path.join(out, f"atexit-{attempt}-{rank}"), "w").close())
record = {
    "name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0],
    "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")},
    "counter": COUNTER, "cuda": torch.cuda.is_initialized(), "torch_before": TORCH_BEFORE,
    "main": sys.modules["__main__"].__dict__ is globals(),
    "attempt_store": trainer_hooks.distributed.installed(),  # what `import trainer_hooks` does under torchrun
    "annotation": str(__annotations__["ANNOTATED"]),
    "start_method": multiprocessing.get_start_method(),  # a DataLoader's workers start with it
}
with open(os.path.join(out, f"{attempt}-{rank}.json"), "w") as f:
    json.dump(record, f)
if attempt == 0 and rank == 1:
    sys.exit(1)  # fails the worker: torchrun restarts the group once
if attempt == 1:
    sys.exit()  # a success (torch's --run-path alone would wait forever for this worker's result)
"""

FAILING = """
import os, pathlib
env = os.environ
pathlib.Path(env["PROBE_OUT"], f"ran-{env['TORCHELASTIC_RESTART_COUNT']}-{env['RANK']}").touch()
raise ValueError("boom on every attempt")
"""


def clean_env() -> dict[str, str]:
    """This environment without torchrun's variables, PYTHONPATH the project."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "RANK", "LOCAL_RANK", "WORLD_"))}
    return {**keep, "PYTHONPATH": str(ROOT)}


def launch(tmp_path: Path, args: list[str], env: dict[str, str], timeout: float = 120) -> int:
    log = tmp_path / "launch.log"
    cmd = [PYTHON, "-m", "trainer_hooks.launch", *args]
    with spawned(cmd, log, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}, cwd=tmp_path) as proc:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not finish:\n{tail(log)}")


@pytest.mark.slow
def test_warm_workers_run_the_script_as_plain_torchrun_would_in_every_attempt(tmp_path: Path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "probe.py").write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    args = ["--warm", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "sub/probe.py", "--lr", "0.1"]
    rc = launch(tmp_path, args, {"PROBE_OUT": str(out)})
    explain = tail(tmp_path / "launch.log")
    assert rc == 0, explain
    seen = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(seen) == ["0-0", "0-1", "1-0", "1-1"], explain
    # what a fresh interpreter starts with (fork on Linux before 3.14): not the server's forkserver,
    # which re-imports the script in every DataLoader worker (an error without a __main__ guard)
    probe = [PYTHON, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"]
    plain = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
    for key, record in seen.items():
        attempt, rank = key.split("-")
        assert record == {
            "name": "__main__",
            "file": str(tmp_path / "sub" / "probe.py"),
            "argv": ["sub/probe.py", "--lr", "0.1"],
            "path0": str(tmp_path / "sub"),
            "env": {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": attempt},
            "counter": 1,
            "cuda": False,
            "torch_before": True,
            "main": True,
            "attempt_store": True,
            "annotation": "<class 'int'>",
            "start_method": plain,
        }, key
    assert sorted(p.name for p in out.glob("atexit-*")) == ["atexit-0-0", "atexit-0-1", "atexit-1-0", "atexit-1-1"]


@pytest.mark.slow
def test_a_module_that_raises_in_every_attempt_fails_the_warm_launcher_as_torchrun(tmp_path: Path):
    (tmp_path / "failing_probe.py").write_text(FAILING)
    out = tmp_path / "out"
    out.mkdir()
    args = ["--warm", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "-m", "failing_probe"]
    rc = launch(tmp_path, args, {"PROBE_OUT": str(out), "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    log = (tmp_path / "launch.log").read_text()
    assert rc == 1, tail(tmp_path / "launch.log")
    assert sorted(p.name for p in out.iterdir()) == ["ran-0-0", "ran-0-1", "ran-1-0", "ran-1-1"]
    assert "ValueError: boom on every attempt" in log


def test_the_warm_launcher_runs_torchrun_with_forkserver_workers_and_the_preload():
    forwarded, preload, path0 = torchrun_argv(
        ["--warm", "--preload", "json,csv", "--standalone", "--preload=json", "--nproc-per-node", "2"]
        + [str(ROOT / "bench" / "cycles" / "train_plain.py"), "--lr", "1"]
    )
    assert forwarded == [
        "--standalone",
        "--nproc-per-node",
        "2",
        "--run-path",
        "--start-method",
        "forkserver",
        warm.WORKER,
        str(ROOT / "bench" / "cycles" / "train_plain.py"),
        "--lr",
        "1",
    ]
    assert preload == [*warm.PRELOAD, "json", "csv"]
    assert path0 == str(ROOT / "bench" / "cycles")
    plain, preload, _ = torchrun_argv(["--standalone", "-m", "mod", "-x"])
    assert plain == ["--standalone", "-m", "mod", "-x"] and preload is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--warm", "--standalone", "no/such.py"], "no such script: no/such.py"),
        (["--warm", "--standalone", "-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
        (["--warm", "--preload", "json,no_such_preload", "--standalone", "x.py"], "no module named 'no_such_preload'"),
        (["--preload", "json", "--standalone", "x.py"], "--preload needs --warm"),
    ],
)
def test_the_warm_launcher_refuses_what_it_cannot_run_naming_it(tmp_path: Path, args: list[str], message: str):
    (tmp_path / "x.py").write_text("")
    done = subprocess.run(
        [PYTHON, "-m", "trainer_hooks.launch", *args], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_example_under_the_warm_launcher_comes_back_after_every_restart(tmp_path: Path):
    with warm_launcher():
        result = run_cycles("readme", tmp_path, cycles=2, launcher="warm", timeout=240)
    explain = f"{result.line()}\n{tail(result.log, 40)}"
    assert result.came_back == 2 and result.incidents >= 2, explain  # the sidecar ended every hung attempt
    assert result.finished and result.returncode == 0, explain


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("print('ran')", 0),
        ("import sys; sys.exit()", 0),  # torch's `--run-path` alone would leave the agent waiting
        ("import sys; sys.exit(0)", 0),
        ("import sys; sys.exit(3)", 3),
        ("import sys; sys.exit('bad input')", 1),
        ("raise ValueError('boom')", 1),
    ],
)
def test_a_warm_worker_ends_with_the_status_the_script_would_have_alone(tmp_path: Path, body: str, code: int):
    (tmp_path / "s.py").write_text(body + "\n")
    worker = "import sys; from trainer_hooks.warm import run_worker; run_worker(sys.argv[1:])"
    done = subprocess.run(
        [PYTHON, "-c", worker, "s.py"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=clean_env()
    )
    assert done.returncode == code, done.stderr
    assert ("Traceback" in done.stderr) == ("raise" in body)


def test_a_worker_forked_after_cuda_was_initialised_refuses_to_run(tmp_path: Path, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    (tmp_path / "never.py").write_text("raise AssertionError('ran')\n")
    with pytest.raises(SystemExit, match="CUDA was initialised in the warm server"):
        warm.run_worker([str(tmp_path / "never.py")])


@pytest.mark.parametrize(
    ("version", "refused"),
    [((3, 10, 0), True), ((3, 10, 8), True), ((3, 10, 9), False), ((3, 9, 15), True), ((3, 9, 16), False),
     ((3, 11, 0), False), ((3, 12, 4), False)],
)  # fmt: skip
def test_warm_workers_are_refused_where_the_forkserver_socket_is_abstract(version, refused):
    """Issue 43 row 6 (CVE-2022-42919): on CPython 3.9.0-3.9.15 and 3.10.0-3.10.8 multiprocessing's
    forkserver listens on an abstract Unix socket that any local user can connect to and have code
    run in the job. This machine's 3.11 cannot show the attack; the refusal is checked by version."""
    problem = warm.interpreter_problem(version, "linux")
    assert (problem is not None) == refused, problem
    if refused:
        assert "CVE-2022-42919" in problem and f"{version[0]}.{version[1]}.{version[2]}" in problem
    assert warm.interpreter_problem(version, "darwin") is None  # abstract sockets are Linux's


def test_the_warm_launcher_on_an_affected_interpreter_exits_with_one_line_and_starts_nothing(tmp_path: Path):
    (tmp_path / "x.py").write_text("open('ran', 'w').close()")
    as_3_10_8 = (
        "import runpy, sys; sys.version_info = (3, 10, 8, 'final', 0); "
        "sys.argv = ['trainer_hooks.launch', '--warm', '--standalone', '--nproc-per-node', '1', 'x.py']; "
        "runpy.run_module('trainer_hooks.launch', run_name='__main__')"
    )
    done = subprocess.run([PYTHON, "-c", as_3_10_8], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--warm refused on Python 3.10.8" in done.stderr and not (tmp_path / "ran").exists()
