"""The Monitor in the training process itself: disabled mode, errors swallowed, phases,
close, fork safety, stack dumps on a signal, and what it reads from the environment."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.hooks.test_gpu_metrics import FakeSidecar
from tests.support import wait_until
from trainer_hooks import Monitor, environment
from trainer_hooks.records import Encoder, number


def quiet_monitor(tmp_path: Path, **kw) -> Monitor:
    """A monitor whose sidecar is absent (nothing listens on its socket)."""
    kw.setdefault("socket", str(tmp_path / "absent.sock"))
    kw.setdefault("diag_dir", str(tmp_path / "diag"))
    return Monitor(job_id="unit", rank=0, world_size=1, environ={}, **kw)


def test_disabled_by_environment_is_a_no_op(tmp_path: Path, hung_server):
    mon = Monitor(socket=hung_server.path, diag_dir=str(tmp_path / "diag"), environ={"SIDECAR_HOOKS_DISABLED": "1"})
    mon.step(1, loss=1.0)
    with mon.phase("eval"):
        mon.event("x")
    time.sleep(0.7)
    mon.close()
    assert not mon.enabled and mon.stack_dump_path is None
    assert hung_server.connections == 0
    assert not (tmp_path / "diag").exists()


def test_disabled_by_argument_is_a_no_op(tmp_path: Path, hung_server):
    mon = Monitor(enabled=False, socket=hung_server.path, environ={})
    mon.step(1, loss=1.0)
    time.sleep(0.7)
    mon.close()
    assert not mon.enabled and hung_server.connections == 0


def test_hook_calls_never_raise_on_bad_input(tmp_path: Path):
    mon = quiet_monitor(tmp_path)
    mon.step("not a step", loss=object(), lr="fast", tokens=[1, 2])
    mon.step(None)
    mon.event(None, **{"weird key": object()})
    with mon.phase(12345, timeout="soon"):
        pass
    mon.close()
    mon.step(2, loss=1.0)  # after close: ignored
    mon.close()


def test_phase_block_exception_propagates_unchanged(tmp_path: Path):
    mon = quiet_monitor(tmp_path)
    error = KeyError("disk full")
    with pytest.raises(KeyError) as caught:
        with mon.phase("checkpoint_save", timeout=600):
            raise error
    assert caught.value is error
    mon.close()


def test_close_is_idempotent_and_quick_without_a_sidecar(tmp_path: Path):
    mon = quiet_monitor(tmp_path)
    mon.step(1, loss=1.0)
    start = time.monotonic()
    mon.close()
    mon.close()
    assert time.monotonic() - start < 5.0
    assert not mon.enabled


def test_forked_child_is_disabled_and_parent_is_not(tmp_path: Path):
    mon = quiet_monitor(tmp_path)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            mon.step(10**6, loss=0.0)
            mon.close()
            os.write(write_fd, json.dumps({"enabled": mon.enabled, "dropped": mon.dropped}).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    child = json.loads(os.read(read_fd, 1000))
    os.close(read_fd)
    assert child == {"enabled": False, "dropped": 0}
    assert mon.enabled
    mon.close()


STACK_RANK = """
import sys, time
from trainer_hooks import Monitor
mon = Monitor(job_id="job/with odd name", rank=3, world_size=4)
deadline = time.monotonic() + 30
while mon.stack_dump_path is None and time.monotonic() < deadline:
    time.sleep(0.05)
print(mon.stack_dump_path, flush=True)
def waiting_for_allreduce():
    time.sleep(60)
waiting_for_allreduce()
"""


def test_stack_dump_goes_to_the_file_the_sidecar_created(tmp_path: Path, sidecar):
    env = dict(os.environ, SIDECAR_SOCKET=sidecar.socket)
    proc = subprocess.Popen([sys.executable, "-c", STACK_RANK], stdout=subprocess.PIPE, text=True, env=env)
    try:
        path = Path(proc.stdout.readline().strip())
        assert path.parent == sidecar.workdir / "diag" / "job_with_odd_name", path
        assert path.name.startswith(f"rank3-pid{proc.pid}-") and path.suffix == ".stacks"
        st = path.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o600)
        assert path.parent.stat().st_mode & 0o022 == 0  # nobody else may write where the dumps live
        time.sleep(0.3)  # into the sleep
        proc.send_signal(signal.SIGUSR2)
        text = wait_until(
            lambda: "waiting_for_allreduce" in path.read_text() and path.read_text(), 20, what="stack dump"
        )
        # the main thread's stack alone (the one the signal lands on), not the sender thread's
        assert "Stack (most recent call first)" in text and "trainer_hooks/sender.py" not in text
        assert proc.poll() is None  # the dump does not kill the rank
    finally:
        proc.kill()
        proc.wait()


HANDLER_BEFORE_REGISTRATION = """
import os, signal, sys, time
from trainer_hooks import Monitor
mon = Monitor(job_id="j", rank=0, world_size=1, socket=sys.argv[1])
os.kill(os.getpid(), signal.SIGUSR2)
time.sleep(0.2)
print("alive", mon.stack_dump_path, flush=True)
"""


def test_a_dump_signal_before_any_sidecar_answer_goes_to_stderr(tmp_path: Path):
    out = subprocess.run(
        [sys.executable, "-c", HANDLER_BEFORE_REGISTRATION, str(tmp_path / "absent.sock")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "alive None"  # the signal's default action would have ended the rank
    assert "Stack (most recent call first)" in out.stderr


# A rank whose second thread runs Python all the time (a data pipeline, a logger) while the main
# thread computes: the watchdog's looks signal it again and again.
BUSY_THREADS = """
import json, os, signal, sys, threading, time
from trainer_hooks import Monitor
mon = Monitor(job_id="j", rank=0, world_size=1, socket=sys.argv[1])
def pipeline():
    while True:
        sum(json.loads(json.dumps(list(range(50)))))
threading.Thread(target=pipeline, daemon=True).start()
print("ready", flush=True)
x = 0
while True:
    x += 1
"""


def test_dumps_of_a_rank_whose_threads_all_run_python_never_crash_it(tmp_path: Path):
    """Every thread's dump (faulthandler's all_threads) walked the running thread's frames and
    killed such a rank with SIGSEGV in about one signal of four; the main thread's alone never."""
    proc = subprocess.Popen(
        [sys.executable, "-c", BUSY_THREADS, str(tmp_path / "absent.sock")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for sent in range(300):
            proc.send_signal(signal.SIGUSR2)
            time.sleep(0.005)
            assert proc.poll() is None, f"the rank died of dump {sent + 1}: exit {proc.returncode}"
    finally:
        proc.kill()
        proc.wait()


def test_only_a_regular_file_of_this_user_is_adopted(tmp_path: Path):
    from trainer_hooks import stacks

    dump = stacks.install(int(signal.SIGUSR1))
    assert dump is not None
    try:
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        link = tmp_path / "link"
        real = tmp_path / "real.stacks"
        real.write_text("")
        link.symlink_to(real)
        assert not dump.adopt(str(fifo))  # non-blocking: a FIFO without a reader neither blocks nor is taken
        assert not dump.adopt(str(link))
        assert not dump.adopt(str(tmp_path / "absent"))
        if os.geteuid() == 0:
            other = tmp_path / "other.stacks"
            other.write_text("")
            os.chown(other, 65534, 65534)
            assert not dump.adopt(str(other))
        assert dump.path is None
        assert dump.adopt(str(real)) and dump.path == str(real)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert "test_only_a_regular_file_of_this_user_is_adopted" in wait_until(real.read_text, 10, what="dump")
    finally:
        dump.close()
    assert real.exists()  # the sidecar's file: the hooks never remove it


def test_stack_dump_can_be_switched_off(tmp_path: Path):
    mon = Monitor(socket=str(tmp_path / "absent.sock"), environ={"SIDECAR_STACK_SIGNAL": "off"})
    assert mon.enabled and mon.stack_dump_path is None
    mon.close()


def test_application_signal_handler_is_left_alone(tmp_path: Path):
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        mon = quiet_monitor(tmp_path, stack_signal=int(signal.SIGUSR1))
        assert mon.enabled and mon.stack_dump_path is None
        mon.close()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def cuda_or_skip():
    if shutil.which("nvidia-smi") is None:
        pytest.skip("needs an NVIDIA GPU")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    return torch


def sender_frames(mon: Monitor) -> list[str]:
    """The functions the monitor's sender thread is in now, innermost last."""
    assert mon._sender is not None and mon._sender.thread is not None
    frame = sys._current_frames().get(mon._sender.thread.ident or -1)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names[::-1]


def test_cuda_tensor_is_not_synchronised_on_the_training_thread(tmp_path: Path):
    torch = cuda_or_skip()
    fake = FakeSidecar(tmp_path / "sidecar.sock")
    mon = quiet_monitor(tmp_path, socket=fake.path, flush_interval=0.05, stack_signal=None)
    try:
        wait_until(lambda: mon.registered, 10, interval=0.01, what="registration")
        x = torch.ones((), device="cuda")
        (x * 2).item()  # load the kernel first: a first launch may wait for the GPU (CUDA lazy loading)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead
        loss = x * 2  # not computed until the sleep is done
        start = time.perf_counter()
        mon.step(1, loss=loss, grad_norm=loss)  # the first step: it wakes the sender at once
        elapsed = time.perf_counter() - start
        still_busy = not torch.cuda.current_stream().query()
        assert elapsed < 0.1, f"step() took {elapsed:.3f} s (GPU still busy after it: {still_busy})"
        assert still_busy, f"the GPU's ~1 s of queued work was done when step() returned ({elapsed * 1e3:.1f} ms)"
        time.sleep(0.2)  # the sender has had its turns meanwhile
        frames = sender_frames(mon)
        still_busy = not torch.cuda.current_stream().query()
        assert still_busy, "the GPU's ~1 s of queued work was done 0.2 s after step(): something waited for it"
        assert "number" not in frames, f"the sender thread waits for the GPU to read a value: {frames}"
        assert fake.steps() == [], "the step went before the GPU had computed its values"
        torch.cuda.synchronize()
        sent = wait_until(fake.steps, 5, interval=0.01, what="the step once the GPU computed its values")
        assert [(s["step"], s["metrics"]) for s in sent] == [(1, {"loss": 2.0, "grad_norm": 2.0})]
    finally:
        mon.close()
        fake.close()


def test_a_computed_cuda_value_is_read_without_waiting_for_the_work_queued_after_it(tmp_path: Path):
    torch = cuda_or_skip()
    fake = FakeSidecar(tmp_path / "sidecar.sock")
    mon = quiet_monitor(tmp_path, socket=fake.path, flush_interval=0.05, stack_signal=None)
    try:
        wait_until(lambda: mon.registered, 10, interval=0.01, what="registration")
        x = torch.ones((), device="cuda")
        torch.cuda._sleep(1000)  # load the kernel first (CUDA lazy loading)
        mon.step(0, loss=x * 3)  # read while the GPU is idle: the sender gets its side stream
        wait_until(fake.steps, 5, interval=0.005, what="step 0")
        loss = x * 3
        mon.step(1, loss=loss)
        start = time.monotonic()
        torch.cuda._sleep(2_000_000_000)  # about a second of training work queued behind the loss
        sent = wait_until(lambda: len(fake.steps()) == 2 and fake.steps(), 5, interval=0.005, what="step 1")
        took = time.monotonic() - start
        still_busy = not torch.cuda.current_stream().query()
        assert [(s["step"], s["metrics"]) for s in sent] == [(0, {"loss": 3.0}), (1, {"loss": 3.0})]
        assert still_busy and took < 0.5, (
            f"the loss went {took:.2f} s after the step, GPU still busy: {still_busy}: "
            "its read waited for the work queued after it"
        )
    finally:
        torch.cuda.synchronize()
        mon.close()
        fake.close()


FIRST_READ_WHILE_BUSY = """
import json, sys, tempfile, time
import torch
from tests.hooks.test_gpu_metrics import FakeSidecar
from trainer_hooks import Monitor
d = tempfile.mkdtemp()
fake = FakeSidecar(d + "/sidecar.sock")
mon = Monitor(job_id="unit", rank=0, world_size=1, environ={}, socket=fake.path, flush_interval=0.05, stack_signal=None)
while not mon.registered:
    time.sleep(0.01)
x = torch.ones((), device="cuda")
torch.cuda._sleep(1000)
(x * 3).item()
torch.cuda.synchronize()
mon.step(1, loss=x * 3)  # computed at once: the sender reads it while the work below is queued
torch.cuda._sleep(2_000_000_000)
gaps, last, start = [], time.perf_counter(), time.perf_counter()
while time.perf_counter() - start < 0.6:  # the training thread's Python keeps running
    time.sleep(0.001)
    now = time.perf_counter()
    gaps.append(now - last)
    last = now
busy = not torch.cuda.current_stream().query()
torch.cuda.synchronize()
deadline = time.monotonic() + 5
while not fake.steps() and time.monotonic() < deadline:
    time.sleep(0.01)
mon.close()
print(json.dumps({"max_gap": max(gaps), "busy": busy, "steps": fake.steps()}))
"""


def test_the_first_read_while_the_gpu_is_busy_does_not_hold_up_the_training_thread():
    """In a fresh process (no CUDA stream pool yet): the sender must not make its first pool stream
    while work is queued, which holds the GIL until the GPU is done with it."""
    cuda_or_skip()
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", FIRST_READ_WHILE_BUSY],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)),
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["busy"], f"the GPU's ~1 s of queued work was done within 0.6 s: {result}"
    assert result["max_gap"] < 0.2, f"the training thread stood still {result['max_gap']:.2f} s"
    assert [(s["step"], s["metrics"]) for s in result["steps"]] == [(1, {"loss": 3.0})]


def test_identity_comes_from_torchrun_environment():
    ident = environment.identity(
        {
            "RANK": "5",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "8",
            "LOCAL_WORLD_SIZE": "4",
            "TORCHELASTIC_RESTART_COUNT": "2",
            "TORCHELASTIC_RUN_ID": "run-42",
            "TORCHELASTIC_MAX_RESTARTS": "3",
        }
    )
    assert ident == environment.Identity("run-42", 5, 1, 8, 4, 2, launcher=environment.Launcher("torchrun", 3))
    assert environment.identity({}) == environment.Identity("default", 0, 0, 1, 1, 0)
    assert environment.identity({"RANK": "5", "WORLD_SIZE": "8"}, job_id="mine", rank=7).rank == 7


def test_endpoint_prefers_socket_then_url_then_default_socket():
    both = {"SIDECAR_SOCKET": "/s.sock", "SIDECAR_URL": "http://127.0.0.1:9402"}
    assert environment.endpoint(both).socket_path == "/s.sock"
    tcp = environment.endpoint({"SIDECAR_URL": "http://127.0.0.1:9402", "SIDECAR_TOKEN": "t"})
    assert (tcp.host, tcp.port, tcp.token, tcp.is_unix) == ("127.0.0.1", 9402, "t", False)
    assert environment.endpoint({}).socket_path == environment.DEFAULT_SOCKET
    assert environment.endpoint({"SIDECAR_URL": "ftp://x"}).socket_path == environment.DEFAULT_SOCKET


def test_stack_signal_setting():
    assert environment.stack_signal({}) == signal.SIGUSR2
    assert environment.stack_signal({"SIDECAR_STACK_SIGNAL": "SIGUSR1"}) == signal.SIGUSR1
    assert environment.stack_signal({"SIDECAR_STACK_SIGNAL": "usr1"}) == signal.SIGUSR1
    assert environment.stack_signal({"SIDECAR_STACK_SIGNAL": "10"}) == 10
    assert environment.stack_signal({"SIDECAR_STACK_SIGNAL": "off"}) is None
    assert environment.stack_signal({"SIDECAR_STACK_SIGNAL": "SIGBOGUS"}) is None


def test_non_finite_values_become_strings_and_the_wire_stays_strict_json():
    assert [number(math.nan), number(math.inf), number(-math.inf)] == ["nan", "inf", "-inf"]
    assert number(True) == 1 and number(3) == 3 and number(2.5) == 2.5
    item = Encoder().item((0, "step", 1.0, 7, {"loss": math.nan, "bad name!": 1.0, "skip": None}))
    assert item == {"type": "step", "step": 7, "time": 1.0, "metrics": {"loss": "nan", "bad_name_": 1.0}}
    json.dumps(item, allow_nan=False)


def test_flush_interval_and_disable_switches():
    assert environment.flush_interval({"SIDECAR_FLUSH_INTERVAL": "0.2"}) == 0.2
    assert environment.flush_interval({"SIDECAR_FLUSH_INTERVAL": "-1"}) is None
    assert environment.flush_interval({"SIDECAR_FLUSH_INTERVAL": "soon"}) is None
    assert environment.flush_interval({}) is None
    assert all(environment.disabled({"SIDECAR_HOOKS_DISABLED": v}) for v in ("1", "true", "YES", "on"))
    assert not any(environment.disabled({"SIDECAR_HOOKS_DISABLED": v}) for v in ("", "0", "false"))
