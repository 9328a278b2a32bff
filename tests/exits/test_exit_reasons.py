"""Every rank exit gets its reason from real evidence: real processes that finish, raise, are
killed from outside, by the kernel's OOM killer or by the watchdog, watched by a real sidecar."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.exits.conftest import counted, exits_of, incidents, rank_env, register, wait_for_exit
from tests.support import PYTHON, Sidecar, tail, wait_until
from tests.exits.conftest import HANG_SETTINGS, RANK


def test_a_clean_finish_is_finished_and_opens_no_incident(sidecar, ranks):
    r = ranks(rank_env(sidecar, "clean"), "finish").wait_ready()
    r.start_fatal()
    assert r.wait() == 0
    exit_ = wait_for_exit(sidecar, "clean")
    assert exit_["reason"] == "finished"
    assert exits_of(sidecar, "clean") == []
    assert counted(sidecar, "clean") == {"finished": 1.0}


def test_an_outside_sigkill_is_signal(sidecar, ranks):
    r = ranks(rank_env(sidecar, "killed"), "hold").wait_ready()
    os.kill(r.proc.pid, signal.SIGKILL)
    r.wait()
    exit_ = wait_for_exit(sidecar, "killed")
    assert exit_["reason"] == "signal"
    (recorded,) = exits_of(sidecar, "killed")
    assert any("killed by SIGKILL" in line for line in recorded["evidence"]), recorded
    assert recorded["step"] >= 3 and recorded["loss"] is not None and recorded["step_time_seconds"] in (0.05, 0.5)
    assert counted(sidecar, "killed") == {"signal": 1.0}
    status = sidecar.status()
    assert status["exits"]["last"]["reason"] == "signal"
    (entry,) = [e for e in status["ranks"] if e["job_id"] == "killed"]
    assert entry["exit_reason"] == "signal"


def test_an_uncaught_exception_is_reported_and_the_users_own_hook_still_runs(sidecar, ranks, tmp_path):
    marker = tmp_path / "users-hook.txt"
    r = ranks(rank_env(sidecar, "raised"), "user_hook", "--marker", str(marker)).wait_ready()
    r.start_fatal()
    assert r.wait() == 1
    assert marker.read_text() == "ValueError: the user's own failure", "the user's excepthook ran"
    assert "Traceback (most recent call last)" in r.log.read_text(), "Python's own hook printed the traceback"
    wait_for_exit(sidecar, "raised", reason="exception/other")
    (recorded,) = exits_of(sidecar, "raised")
    assert recorded["exception"]["type"] == "ValueError"
    assert recorded["exception"]["message"] == "the user's own failure"
    assert recorded["exception"]["traceback"][-1].endswith("in main")
    assert any("exited with status 1" in line for line in recorded["evidence"])


def test_a_nonfinite_guard_names_the_checkpoint_to_resume_from(sidecar, ranks):
    r = ranks(rank_env(sidecar, "nan"), "nan", "--steps", "8").wait_ready()
    r.start_fatal()
    r.wait()
    wait_for_exit(sidecar, "nan", reason="exception/nonfinite")
    (incident,) = [i for i in incidents(sidecar, "exit") if i["job_id"] == "nan"]
    rollback = incident["exits"][0]["rollback"]
    assert rollback == {"first_nonfinite_loss_step": 5, "checkpoint_step": 4, "checkpoint_path": "/ckpt/step-4"}
    assert "resume from checkpoint step 4" in incident["summary"]


def test_a_watchdog_kill_is_watchdog(tmp_path, ranks):
    with Sidecar(tmp_path / "hang", *HANG_SETTINGS) as sidecar:
        _watchdog_kill(sidecar, ranks)


def _watchdog_kill(sidecar, ranks):
    r = ranks(rank_env(sidecar, "hung"), "hang").wait_ready()
    r.start_fatal()
    r.wait(timeout=120)
    exit_ = wait_for_exit(sidecar, "hung", timeout=60)
    assert exit_["reason"] == "watchdog"
    assert counted(sidecar, "hung") == {"watchdog": 1.0}
    assert exits_of(sidecar, "hung") == [], "the stall incident is the record; no exit incident"
    (stall,) = [i for i in incidents(sidecar, "stall") if i["job_id"] == "hung"]
    assert stall["outcome"] == "killed"


def test_a_process_without_hooks_killed_from_outside_is_signal(sidecar, ranks):
    r = ranks(rank_env(sidecar, "bare"), "hold", "--no-hooks").wait_ready()
    register(sidecar, "bare", r.proc.pid)
    os.kill(r.proc.pid, signal.SIGTERM)
    r.wait()
    exit_ = wait_for_exit(sidecar, "bare")
    assert exit_["reason"] == "signal"
    (recorded,) = exits_of(sidecar, "bare")
    assert any("killed by SIGTERM" in line for line in recorded["evidence"])


@pytest.mark.parametrize("hooks", [True, False], ids=["hooks", "no_hooks"])
def test_a_kernel_oom_kill_is_oom_killed(hooks, sidecar, ranks, small_memory_cgroup):
    env = {**rank_env(sidecar, f"oom-{hooks}"), "EXIT_TEST_CGROUP": str(small_memory_cgroup)}
    r = ranks(env, "allocate", *([] if hooks else ["--no-hooks"])).wait_ready()
    if not hooks:
        register(sidecar, f"oom-{hooks}", r.proc.pid)
    r.start_fatal()
    assert r.wait() == -signal.SIGKILL, tail(r.log)
    wait_for_exit(sidecar, f"oom-{hooks}", reason="oom_killed")
    (recorded,) = exits_of(sidecar, f"oom-{hooks}")
    evidence = "\n".join(recorded["evidence"])
    assert "killed by SIGKILL" in evidence
    assert f"in {small_memory_cgroup}" in evidence or "Killed process" in evidence, evidence


def test_a_hung_sidecar_delays_an_exception_exit_by_a_fraction_of_a_second(tmp_path):
    """The final report's flush is bounded: a sidecar that accepts and never answers."""
    from tests.hooks.helpers import HungServer
    server = HungServer(tmp_path / "hung.sock")
    try:
        env = {"SIDECAR_SOCKET": server.path, "TORCHELASTIC_RUN_ID": "hung-sidecar", "RANK": "0", "WORLD_SIZE": "1",
               "PYTHONPATH": os.environ.get("PYTHONPATH", "") + os.pathsep + str(RANK.rsplit("/tests/", 1)[0])}
        code = ("import time, sys\nfrom trainer_hooks import Monitor\nm = Monitor()\ntime.sleep(0.5)\n"
                "t0 = time.monotonic()\nimport atexit\n"
                "atexit.register(lambda: print('exit-delay', time.monotonic() - t0, flush=True))\n"
                "raise RuntimeError('boom')\n")
        import subprocess
        out = subprocess.run([PYTHON, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                             timeout=60)
        delay = float(out.stdout.split("exit-delay", 1)[1].split()[0])
        assert delay < 1.0, delay
        assert "RuntimeError: boom" in out.stderr
    finally:
        server.close()
