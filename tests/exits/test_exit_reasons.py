"""Every rank exit gets its reason from real evidence: real processes that finish, raise, are
killed from outside, by the kernel's OOM killer or by the watchdog, watched by a real sidecar."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.exits.helpers import (
    HANG_SETTINGS,
    RANK,
    SETTINGS,
    counted,
    exits_of,
    incidents,
    rank_env,
    register,
    wait_for_exit,
)
from tests.support import PYTHON, Sidecar, tail, wait_until


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
    (incident,) = [i for i in incidents(sidecar, "exit") if i["job_id"] == "killed"]
    for path in (incident["path"], incident["path"][:-5] + ".txt"):
        assert os.stat(path).st_mode & 0o007 == 0, "incident files are not readable by others (security rules)"
    status = sidecar.status()
    assert status["exits"]["last"]["reason"] == "signal"
    (entry,) = [e for e in status["ranks"] if e["job_id"] == "killed"]
    assert entry["exit_reason"] == "signal"
    from tests.ops.helpers import run_cli

    out = run_cli("status", "--socket", sidecar.socket)
    assert "last exit: killed/0 signal at " in out.stdout, out.stdout
    (row,) = [line.split() for line in out.stdout.splitlines() if line.startswith("killed ")]
    assert row[3:5] == ["gone", "(signal)"], row
    listed = run_cli("incidents", "--diag-dir", str(sidecar.workdir / "diag"))
    assert "signal" in listed.stdout and "killed" in listed.stdout, listed.stdout


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
    # the exit is decided before its incident is on disk (written off the event loop): wait for the file
    found = wait_until(
        lambda: [i for i in incidents(sidecar, "exit") if i["job_id"] == "nan"], 30, what="the exit incident"
    )
    (incident,) = found
    rollback = incident["exits"][0]["rollback"]
    assert rollback == {"first_nonfinite_loss_step": 5, "checkpoint_step": 4, "checkpoint_path": "/ckpt/step-4"}
    assert "resume from checkpoint step 4" in incident["summary"]


def test_the_hint_names_the_newest_checkpoint_a_peer_saved_before_the_nan(sidecar, ranks):
    """Rank 1's loss goes NaN at step 9 and it dies having reported checkpoints up to step 4 only
    (it died before it reported the step-8 save that finished); rank 0 reported step 8. The job resumes from 8:
    the hint names it. Before, only the dying rank's own checkpoints were known when it was decided
    (`make test` at five workers: checkpoint 4 named where the trainer resumed from 8)."""
    peer = ranks(rank_env(sidecar, "nanpeer", 0, 2), "hold", "--steps", "8", "--checkpoint-until", "8", name="r0")
    peer.wait_ready()
    bad = ranks(rank_env(sidecar, "nanpeer", 1, 2), "nan", "--steps", "10", "--nan-step", "9",
                "--checkpoint-until", "4", name="r1").wait_ready()  # fmt: skip
    bad.start_fatal()
    bad.wait()
    wait_for_exit(sidecar, "nanpeer", reason="exception/nonfinite")
    found = wait_until(
        lambda: [i for i in incidents(sidecar, "exit") if i["job_id"] == "nanpeer"], 30, what="the exit incident"
    )
    rollback = found[0]["exits"][0]["rollback"]
    assert rollback == {"first_nonfinite_loss_step": 9, "checkpoint_step": 8, "checkpoint_path": "/ckpt/step-8"}


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
    assert counted(sidecar, "hung", "sidecar_job_failures_total") == {"watchdog": 1.0}
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
        env = {
            "SIDECAR_SOCKET": server.path,
            "TORCHELASTIC_RUN_ID": "hung-sidecar",
            "RANK": "0",
            "WORLD_SIZE": "1",
            "PYTHONPATH": os.environ.get("PYTHONPATH", "") + os.pathsep + str(RANK.rsplit("/tests/", 1)[0]),
        }
        code = (
            "import time, sys\nfrom trainer_hooks import Monitor\nm = Monitor()\ntime.sleep(0.5)\n"
            "t0 = time.monotonic()\nimport atexit\n"
            "atexit.register(lambda: print('exit-delay', time.monotonic() - t0, flush=True))\n"
            "raise RuntimeError('boom')\n"
        )
        import subprocess

        out = subprocess.run(
            [PYTHON, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
        )
        delay = float(out.stdout.split("exit-delay", 1)[1].split()[0])
        assert delay < 1.0, delay
        assert "RuntimeError: boom" in out.stderr
    finally:
        server.close()


def test_a_rank_that_dies_soon_after_an_xid_on_its_gpu_is_gpu_error(tmp_path, ranks):
    """The NVML stand-in: gpu 1 reports XID 79 (fallen off the bus) 2 s after the sidecar starts;
    the rank shows up in gpu 1's process list, then dies. A rank on gpu 0 killed the same way
    is only `signal`: the XID was not on a GPU it used."""
    spec = {
        "driver_version": "550.54.15",
        "cuda_driver_version": 12040,
        "gpu_count": 2,
        "xid_events": [{"gpu": 1, "xid": 79, "at_seconds": 2}],
    }
    spec_file = tmp_path / "nvml.json"
    spec_file.write_text(json.dumps(spec))
    with Sidecar(
        tmp_path / "gpu",
        *SETTINGS,
        "collectors.nvml_module=sidecar.testing.fake_nvml_lib",
        env={"SIDECAR_FAKE_NVML": str(spec_file)},
    ) as sidecar:
        on_bad = ranks(rank_env(sidecar, "xid"), "hold", name="on-bad-gpu").wait_ready()
        on_good = ranks(rank_env(sidecar, "xid", rank=1, world=2), "hold", name="on-good-gpu").wait_ready()
        spec["gpus"] = {
            "1": {"processes": [{"pid": on_bad.proc.pid, "used_memory_bytes": 1 << 30}]},
            "0": {"processes": [{"pid": on_good.proc.pid, "used_memory_bytes": 1 << 30}]},
        }
        spec_file.write_text(json.dumps(spec))
        wait_until(
            lambda: (
                'sidecar_gpu_xid_errors_total{gpu="1",xid="79"}' in sidecar.metrics()
                and 'sidecar_gpu_process_memory_bytes{gpu="1",job_id="xid",rank="0"}' in sidecar.metrics()
                and 'sidecar_gpu_process_memory_bytes{gpu="0",job_id="xid",rank="1"}' in sidecar.metrics()
            ),
            60,
            what="the XID and both ranks on their GPUs",
        )
        time.sleep(1.5)  # one more exit-tracker poll after the collector round
        for r in (on_bad, on_good):
            os.kill(r.proc.pid, signal.SIGKILL)
            r.wait()
        assert wait_for_exit(sidecar, "xid", rank=0)["reason"] == "gpu_error"
        assert wait_for_exit(sidecar, "xid", rank=1)["reason"] == "signal"
        by_rank = {e["rank"]: e for e in exits_of(sidecar, "xid")}
        assert any("XID 79 on gpu 1 (it used)" in line for line in by_rank[0]["evidence"]), by_rank[0]
        assert any("XID 79 on gpu 1 (it was not seen using)" in line for line in by_rank[1]["evidence"])


def test_an_exception_that_ends_a_thread_is_kept_as_evidence(sidecar, tmp_path):
    """A thread's death does not end the process: it is an event, and evidence when the rank dies."""
    code = (
        "import os, threading, time\nfrom trainer_hooks import Monitor\nm = Monitor(flush_interval=0.2)\n"
        "m.step(1, loss=1.0)\n"
        "def worker():\n    raise ConnectionError('prefetch server went away')\n"
        "t = threading.Thread(target=worker, name='prefetch'); t.start(); t.join()\n"
        "time.sleep(1.0)\nos._exit(3)\n"
    )
    import subprocess

    env = {**os.environ, **rank_env(sidecar, "thread")}
    out = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "ConnectionError: prefetch server went away" in out.stderr
    assert wait_for_exit(sidecar, "thread")["reason"] == "nonzero_exit"
    (recorded,) = exits_of(sidecar, "thread")
    assert "a thread of the rank died earlier of ConnectionError: prefetch server went away" in recorded["evidence"]
