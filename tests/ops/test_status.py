"""`sidecar status` against live sidecars: what it shows and what its exit status says."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from sidecar.commands.client import resolve_endpoint
from sidecar.watchdog.stackdumps import py_spy_path
from tests.ops.helpers import Rank, run_cli, wait_for_state
from tests.support import ROOT, Sidecar, free_port, wait_until


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """A sidecar with two ranks of job run-42 that have made progress."""
    sidecar = Sidecar(tmp_path_factory.mktemp("healthy"), "watchdog.observe_only=true").start()
    made = [Rank(sidecar, "run-42", r, {"torch": "2.13.0"}) for r in (0, 1)]
    try:
        for r in made:
            r.push_step(loss=2.25)
        wait_until(lambda: all(r["step"] == 1 for r in sidecar.status()["ranks"]), 30, what="steps recorded")
        yield sidecar
    finally:
        for r in made:
            r.close()
        sidecar.stop()


def test_piped_output_is_plain_text_listing_every_rank(healthy):
    out = run_cli("status", "--socket", healthy.socket)
    assert out.returncode == 0, out.stderr
    assert "\x1b[" not in out.stdout
    lines = out.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("JOB ") and line.split()[1] == "RANK")
    header = lines[at]
    assert header.split()[:4] == ["JOB", "RANK", "PID", "STATE"]
    table = lines[at + 1 : next((i for i in range(at + 1, len(lines)) if not lines[i].strip()), len(lines))]
    rows = [line.split() for line in table if line.startswith("run-42 ")]  # the ranks table, not the go-live checks'
    assert [row[1] for row in rows] == ["0", "1"]
    assert all(row[3] == "healthy" and row[4] == "1" and "2.25" in row for row in rows)
    assert "HEALTHY" in lines[0] and "Problems: none" in out.stdout


def test_json_is_the_raw_status_with_the_exit_code(healthy):
    out = run_cli("status", "--url", healthy.url, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["exit_code"] == 0 and doc["problems"] == [] and doc["target"] == healthy.url
    assert doc["status"]["health"] == "healthy"
    assert sorted(r["rank"] for r in doc["status"]["ranks"]) == [0, 1]


def test_socket_comes_from_sidecar_socket_when_no_flag_is_given(healthy):
    out = run_cli("status", "--json", env={"SIDECAR_SOCKET": healthy.socket})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["target"] == healthy.socket


def test_endpoint_is_the_flag_then_sidecar_socket_then_sidecar_url_then_the_default():
    env = {"SIDECAR_SOCKET": "/env.sock", "SIDECAR_URL": "node-3:9402"}
    assert str(resolve_endpoint("/flag.sock", None, env)) == "/flag.sock"
    assert str(resolve_endpoint("/flag.sock", "node-4:9402", env)) == "http://node-4:9402"
    assert str(resolve_endpoint(None, None, env)) == "/env.sock"
    assert str(resolve_endpoint(None, None, {"SIDECAR_URL": "node-3:9402"})) == "http://node-3:9402"
    assert str(resolve_endpoint(None, None, {})) == "/run/sidecar/sidecar.sock"


def test_a_stalled_rank_exits_1_and_names_the_rank(tmp_path, ranks):
    settings = (
        "watchdog.observe_only=true",
        "watchdog.check_interval_seconds=0.2",
        "watchdog.floor_seconds=1",
        "watchdog.ceiling_seconds=2",
        "hooks_flush_interval_seconds=0.2",
    )
    with Sidecar(tmp_path, *settings) as sidecar:
        rank = ranks(sidecar, "run-7", 3)
        rank.push_step()
        wait_for_state(sidecar, 3, "stalled")  # no more pushes
        out = run_cli("status", "--socket", sidecar.socket)
    assert out.returncode == 1, out.stdout + out.stderr
    row = next(line.split() for line in out.stdout.splitlines() if line.startswith("run-7 "))
    assert row[3] == "stalled"
    lines = out.stdout.splitlines()
    problems = [line for line in lines[lines.index("Problems:") + 1 :] if line.startswith("  - ")]
    assert any("run-7/3" in p and "stalled" in p for p in problems), problems
    assert "DEGRADED" in lines[0]


def test_after_a_stall_was_killed_status_counts_it_instead_of_saying_no_stall_yet(tmp_path, ranks):
    settings = (
        "watchdog.check_interval_seconds=0.2",
        "watchdog.floor_seconds=1",
        "watchdog.ceiling_seconds=2",
        "hooks_flush_interval_seconds=0.2",
        "job_view.enabled=false",
        "remediation.py_spy=false",
        "remediation.dump_wait_seconds=0.2",
        "remediation.grace_seconds=1",
    )
    killed = 'sidecar_watchdog_remediations_total{job_id="run-8",outcome="killed"} 1.0'
    with Sidecar(tmp_path, *settings) as sidecar:
        rank = ranks(sidecar, "run-8", 2)
        rank.push_step()
        wait_until(lambda: killed in sidecar.metrics(), 60, interval=0.2, what="the stalled rank killed")
        out = run_cli("status", "--socket", sidecar.socket)
    line = next(line for line in out.stdout.splitlines() if line.startswith("Would-be kills and false alarms"))
    assert line == "Would-be kills and false alarms: none: 1 stall since start, 1 killed", out.stdout


def checkpoints_fact(out: subprocess.CompletedProcess) -> str:
    """The `checkpoints: ...` fact of the status screen's facts line."""
    facts = out.stdout.splitlines()[1]
    return facts[facts.index("checkpoints: ") :].split("  ")[0]


def test_a_relative_checkpoint_dir_is_shown_as_the_directory_it_names(tmp_path):
    with Sidecar(tmp_path, "checkpoint_dir=.") as sidecar:  # the sidecar starts in ROOT
        doc = sidecar.status()
        out = run_cli("status", "--socket", sidecar.socket)
    assert doc["node"]["checkpoint_dir"] == str(ROOT)
    assert checkpoints_fact(out).startswith(f"checkpoints: {ROOT} ("), out.stdout


def test_the_shipped_configmap_sets_no_checkpoint_dir_and_status_says_it_is_not_set(tmp_path):
    configmap = yaml.safe_load((ROOT / "deploy/kubernetes/base/configmap.yaml").read_text())
    shipped = yaml.safe_load(configmap["data"]["sidecar.yaml"])["checkpoint_dir"]
    with Sidecar(tmp_path, f"checkpoint_dir={shipped}") as sidecar:
        wait_until(lambda: "sidecar_node_memory_total_bytes " in sidecar.metrics(), 30, what="a node collector round")
        metrics = sidecar.metrics()
        out = run_cli("status", "--socket", sidecar.socket)
    assert checkpoints_fact(out) == "checkpoints: not set (checkpoint_dir)", out.stdout
    assert not [line for line in metrics.splitlines() if line.startswith("sidecar_checkpoint_filesystem")]


def test_a_failing_collector_exits_1_and_names_the_collector(tmp_path):
    spec = {
        "driver_version": "550.54.15",
        "cuda_driver_version": 12040,
        "gpu_count": 2,
        "gpus": {"1": {"errors": {"*": "gpu_is_lost"}}},
    }
    spec_file = tmp_path / "nvml.json"
    spec_file.write_text(json.dumps(spec))
    with Sidecar(
        tmp_path, "collectors.nvml_module=sidecar.testing.fake_nvml_lib", env={"SIDECAR_FAKE_NVML": str(spec_file)}
    ) as sidecar:
        wait_until(lambda: sidecar.status()["collectors"]["gpu"]["success"] is False, 30, what="gpu collector failing")
        out = run_cli("status", "--socket", sidecar.socket, "--json")
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    assert doc["exit_code"] == 1
    assert any("gpu" in p for p in doc["problems"]), doc["problems"]
    assert [g["gpu"] for g in doc["status"]["gpus"]] == ["0"]  # the lost GPU has no readings


def test_no_sidecar_exits_2_naming_the_socket(tmp_path):
    missing = str(tmp_path / "nobody.sock")
    out = run_cli("status", "--socket", missing)
    assert out.returncode == 2
    assert out.stdout == ""
    assert f"no sidecar at {missing} (no such socket)" in out.stderr
    assert "--url" in out.stderr


def test_refused_tcp_exits_2_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    out = run_cli("status", "--url", url, "--json")
    assert out.returncode == 2
    doc = json.loads(out.stdout)
    assert doc["exit_code"] == 2 and doc["status"] is None
    assert f"no sidecar at {url} (connection refused)" in doc["error"]


class _Broken(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's naming)
        if self.path == "/v1/status" and self.server.mode == "not-json":
            body, code = b"<html>proxy login</html>", 200
        else:
            body, code = b'{"error": "the sidecar is shutting down", "code": "unavailable"}', 503
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    "mode, expected", [("not-json", "did not answer JSON"), ("error", "HTTP 503: the sidecar is shutting down")]
)
def test_a_broken_answer_exits_2_saying_what_is_wrong(mode, expected):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Broken)
    server.mode = mode
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out = run_cli("status", "--url", url)
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 2
    assert expected in out.stderr and url in out.stderr


def test_watch_redraws_until_ctrl_c_then_exits_0(healthy):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "status", "--watch", "0.2", "--socket", healthy.socket],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        preexec_fn=ctrl_c_as_on_a_terminal,
    )
    try:
        frames = 0
        for line in proc.stdout:
            frames += line.startswith("Problems:")
            if frames == 2:
                break
        assert frames == 2
        proc.send_signal(signal.SIGINT)
        # Keep reading while it exits: a watcher that wrote on into a pipe nobody empties would
        # block in its last flush, and the test would wait for a hang of its own making.
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 60 s after Ctrl-C; where it is:\n{stacks_of(proc.pid)}")
        assert proc.returncode == 0, err
    finally:
        proc.kill()
        proc.wait()


def ctrl_c_as_on_a_terminal() -> None:
    """In the child before it runs: SIGINT at its default and not blocked, as a shell gives it.
    Both are inherited, and late in a full run the test worker's SIGINT was found ignored or
    blocked (by something else in that process): its children then slept through Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def stacks_of(pid: int) -> str:
    """Where a process that did not exit is (py-spy) and what it does with signals (for the
    failure message)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = "".join(line for line in f if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
    except OSError as e:
        masks = f"(/proc/{pid}/status: {e})\n"
    spy = py_spy_path()
    if spy is None:
        return masks + "(py-spy not installed)"
    done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
    return masks + done.stdout + done.stderr


class _Terminal:
    """`sidecar ARGS` with a pseudo-terminal (160x60) as stdin, stdout and stderr."""

    def __init__(self, *args: str):
        master, slave = os.openpty()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
        env.update(COLUMNS="160", LINES="60", TERM="xterm-256color")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=ROOT,
            preexec_fn=ctrl_c_as_on_a_terminal,
        )
        os.close(slave)
        self.master, self.output = master, b""

    def read_until(self, text: bytes, count: int = 1, timeout: float = 60.0) -> bytes:
        deadline = time.monotonic() + timeout
        while self.output.count(text) < count and time.monotonic() < deadline:
            if select.select([self.master], [], [], 0.2)[0]:
                try:
                    self.output += os.read(self.master, 65536)
                except OSError:  # EIO: the process closed the terminal
                    break
        return self.output

    def wait_reading(self, timeout: float) -> int:
        """Wait for the process to exit, reading what it writes meanwhile (a full terminal
        would block its last writes, and with them its exit)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(f"still running {timeout:g} s later; where it is:\n{stacks_of(self.proc.pid)}")
            if select.select([self.master], [], [], 0.2)[0]:
                try:
                    self.output += os.read(self.master, 65536)
                except OSError:  # EIO: the process closed the terminal and is leaving
                    time.sleep(0.05)
        return self.proc.returncode

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self.master)


def test_on_a_terminal_the_screen_has_colours(healthy):
    term = _Terminal("status", "--socket", healthy.socket)
    try:
        out = term.read_until(b"run-42", count=2)
        code = term.proc.wait(timeout=60)
    finally:
        term.close()
    assert b"\x1b[" in out and out.count(b"run-42") >= 2  # a degraded screen names the job again
    # Its exit status is the verdict it shows (on a loaded machine the rank may turn suspect).
    assert (code, b"HEALTHY" in out) in ((0, True), (1, False)), (code, out[-2000:])


def test_on_a_terminal_watch_redraws_on_the_alternate_screen_until_ctrl_c(healthy):
    term = _Terminal("status", "--watch", "0.2", "--socket", healthy.socket)
    try:
        out = term.read_until(b"Problems", count=2)
        assert out.count(b"Problems") >= 2 and b"\x1b[?1049h" in out
        term.proc.send_signal(signal.SIGINT)
        assert term.wait_reading(60) == 0
    finally:
        term.close()


def test_a_straggler_is_shown_with_its_node_lateness_and_who_judged_it_and_never_killed(tmp_path):
    """Two ranks of one job on this node send entry times of the same 32 collectives (250 ms apart:
    7.75 s of them, past lateness.CONFIRM_SECONDS), rank 1 entering each 100 ms after rank 0:
    /v1/status and `sidecar status` name rank 1 as this node's straggler, judged by this node (a
    single-node job has no coordinator's judgement), and it stays healthy."""
    from tests.ops.helpers import post

    sidecar = Sidecar(tmp_path, "watchdog.floor_seconds=600").start()
    made = [Rank(sidecar, "slow-job", r) for r in (0, 1)]
    try:
        now = time.time()
        for r in made:
            r.push_step()
            late = 0.1 * r.rank
            group = {"pg": "0", "desc": "default_pg", "size": 2, "ranks": [0, 1], "enqueued": 32, "started": -1,
                     "completed": 32, "pending": [],
                     "recent": [[s, now - 10 + s * 0.25 + late] for s in range(1, 33)]}  # fmt: skip
            body = {"job_id": r.job_id, "rank": r.rank, "pid": r.proc.pid, "dropped": 0, "items": [],
                    "collectives": {"time": now, "groups": [group]}}  # fmt: skip
            status, answer = post(sidecar.socket, "/v1/push", body)
            assert status == 200, answer
        doc = sidecar.status()
        judged = [j for j in doc["stragglers"] if j["job_id"] == "slow-job"]
        assert [(j["judged_by"], j["judged_on"], j["ranks_judged"]) for j in judged] == [
            ("node", doc["node"]["name"], 2)
        ], judged
        named = judged[0]["stragglers"]
        assert [(s["rank"], s["node"], s["pg"]) for s in named] == [(1, doc["node"]["name"], "0")]
        assert named[0]["lateness_seconds"] == pytest.approx(0.1, abs=1e-3)
        out = run_cli("status", "--socket", sidecar.socket)
        assert out.returncode == 0, out.stdout + out.stderr
        lines = out.stdout.splitlines()
        title = lines.index(next(line for line in lines if line.startswith("Stragglers")))
        row = next(line for line in lines[title:] if line.startswith("slow-job ")).split()
        assert row[:4] == ["slow-job", "1", doc["node"]["name"], "100.0"] and "node" in row, row
        # reported, never remediated: both ranks stay healthy, nothing is signalled
        assert {r["rank"]: r["state"] for r in sidecar.status()["ranks"]} == {0: "healthy", 1: "healthy"}
        assert all(r.proc.poll() is None for r in made)
    finally:
        for r in made:
            r.close()
        sidecar.stop()
