"""`sidecar run` as a real process: the push API over its Unix socket, `/metrics` (linted by
the real promtool), `/v1/status` against the contract, start-up refusals and a clean stop."""

from __future__ import annotations

import grp
import http.client
import json
import os
import re
import signal
import socket
import stat
import subprocess
import time

import pytest

from tests.daemon.helpers import push_body, registration, step_item
from tests.support import PYTHON, ROOT, Sidecar, http_get, spawned, tail, wait_until

PROMTOOL = "/usr/bin/promtool"
FAKE_GPUS = {
    "driver_version": "550.54.15",
    "cuda_driver_version": 12040,
    "gpu_count": 2,
    "gpus": {"1": {"clock_event_reasons": 4, "ecc_uncorrected": 2}},
}

STATUS_KEYS = {
    "crash_loops",
    "version",
    "time",
    "uptime_seconds",
    "health",
    "problems",
    "node",
    "gpus",
    "nics",
    "infiniband",
    "ranks",
    "collectors",
    "watchdog",
    "incidents",
    "exits",
    "jobs",
    "stragglers",
    "fitness",
    "golive",
}
NODE_KEYS = {
    "name",
    "hostname",
    "kernel",
    "os",
    "cpu_utilization_ratio",
    "memory_total_bytes",
    "memory_available_bytes",
    "checkpoint_dir",
    "checkpoint_avail_bytes",
    "diag_dir",
    "driver_version",
    "cuda_version",
    "gpu_source",
}
GPU_KEYS = {
    "gpu",
    "name",
    "uuid",
    "utilization_ratio",
    "memory_used_bytes",
    "memory_total_bytes",
    "temperature_celsius",
    "slowdown_temperature_celsius",
    "power_watts",
    "clock_events",
    "ecc_uncorrected",
    "xid_total",
}
RANK_KEYS = {
    "job_id",
    "rank",
    "local_rank",
    "world_size",
    "pid",
    "uid",
    "state",
    "step",
    "step_time_seconds",
    "iterations_per_second",
    "loss",
    "grad_norm",
    "lr",
    "phase",
    "last_progress_age_seconds",
    "timeout_seconds",
    "restart_count",
    "dropped",
    "exit_reason",
    "restart_safe",
    "observe_only",
    "slurm_job_id",
    "slurm",
}
COLLECTOR_KEYS = {"success", "duration_seconds", "age_seconds", "error"}


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 10.0):
        super().__init__("sidecar", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def post(socket_path: str, path: str, body: dict) -> tuple[int, dict]:
    conn = UnixHTTPConnection(socket_path)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def rank_process():
    """A child of the test process standing in for a rank (the test registers it)."""
    p = subprocess.Popen(["sleep", "600"], start_new_session=True)
    yield p
    p.kill()
    p.wait()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, rank_process):
    """One real sidecar with two stand-in GPUs and one rank that pushed a few steps."""
    work = tmp_path_factory.mktemp("daemon")
    (work / "gpus.json").write_text(json.dumps(FAKE_GPUS))
    with Sidecar(
        work,
        "collectors.nvml_module=sidecar.testing.fake_nvml_lib",
        f"checkpoint_dir={work}",
        env={"SIDECAR_FAKE_NVML": str(work / "gpus.json")},
    ) as sc:
        pid = rank_process.pid
        status, body = post(sc.socket, "/v1/register", registration(pid, world_size=1))
        assert status == 200, body
        t = time.time()
        status, body = post(
            sc.socket,
            "/v1/push",
            push_body(
                pid,
                [
                    step_item(1, t - 0.2, loss=2.0, lr=1e-3, tokens=4096),
                    step_item(2, t - 0.1, loss=1.5, grad_norm=0.5, tokens=4096, mfu=0.4),
                    {"type": "phase", "name": "eval", "action": "start", "time": t, "timeout_seconds": 600},
                ],
            ),
        )
        assert status == 200, body
        # The node collector reads the driver version the GPU collector found in an earlier round.
        wait_until(
            lambda: (lambda s: len(s["gpus"]) == 2 and s["node"]["driver_version"])(sc.status()),
            30,
            what="a collector round that saw the GPUs",
        )
        yield sc


def test_pushed_steps_reach_metrics(daemon):
    text = daemon.metrics()
    labels = '{job_id="run-42",rank="0"}'
    assert f"sidecar_training_step{labels} 2.0" in text
    assert f"sidecar_training_loss{labels} 1.5" in text
    assert re.search(rf"sidecar_training_tokens_per_second{re.escape(labels)} 409\d\d\.\d+", text)
    assert 'sidecar_training_phase{job_id="run-42",phase="eval",rank="0"} 1.0' in text
    assert 'sidecar_build_info{version="' in text


@pytest.mark.system
def test_the_full_exposition_passes_promtool(daemon):
    exposition = daemon.metrics()
    assert "sidecar_gpu_utilization_ratio" in exposition and "sidecar_training_step" in exposition
    result = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_openmetrics_is_served_when_asked_for(daemon):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=10)
    conn.request("GET", "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    resp = conn.getresponse()
    body = resp.read().decode()
    conn.close()
    assert resp.getheader("Content-Type").startswith("application/openmetrics-text")
    names = {f.name for f in text_string_to_metric_families(body)}
    assert {"sidecar_training_step", "sidecar_gpu_utilization_ratio"} <= names


def test_status_follows_the_contract(daemon, rank_process):
    s = daemon.status()
    assert set(s) == STATUS_KEYS
    assert s["fitness"] == {"fit": True, "reasons": [], "findings": []}
    assert set(s["node"]) == NODE_KEYS and s["node"]["driver_version"] == "550.54.15"
    assert [set(g) for g in s["gpus"]] == [GPU_KEYS, GPU_KEYS]
    assert s["gpus"][1]["clock_events"] == ["sw_power_cap"] and s["gpus"][1]["ecc_uncorrected"] == 2
    assert set(s["collectors"]) == {"gpu", "nic", "process", "node"}
    assert all(set(c) == COLLECTOR_KEYS and c["success"] for c in s["collectors"].values())
    assert {"observe_only", "remediations_in_window", "max_per_window"} <= set(s["watchdog"])
    (rank,) = s["ranks"]
    assert set(rank) == RANK_KEYS
    assert (rank["job_id"], rank["rank"], rank["pid"], rank["step"], rank["loss"], rank["phase"]) == (
        "run-42",
        0,
        rank_process.pid,
        2,
        1.5,
        "eval",
    )
    assert s["health"] == "healthy" and s["problems"] == []


def test_the_socket_gets_the_configured_mode(daemon):
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o660


def test_a_second_sidecar_on_the_same_socket_refuses_to_start(daemon):
    result = subprocess.run(
        [PYTHON, "-m", "sidecar", "run", "--listen", "127.0.0.1:0", "--socket", daemon.socket],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 1
    assert "already running" in result.stderr
    assert http_get(daemon.url + "/healthz")[0] == 200 and os.path.exists(daemon.socket)


def run_sidecar(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "sidecar", "run", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def test_a_bad_setting_exits_2_with_one_line_naming_it(tmp_path):
    result = run_sidecar("--socket", str(tmp_path / "s.sock"), "--set", "watchdog.floor_seconds=-1")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("sidecar: setting watchdog.floor_seconds:")
    assert not (tmp_path / "s.sock").exists()


def test_listening_beyond_loopback_needs_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SIDECAR_TOKEN"}
    result = subprocess.run(
        [PYTHON, "-m", "sidecar", "run", "--listen", "0.0.0.0:0", "--socket", str(tmp_path / "s.sock")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "SIDECAR_TOKEN" in result.stderr


def test_an_unknown_socket_group_exits_2(tmp_path):
    result = run_sidecar("--socket", str(tmp_path / "s.sock"), "--set", "socket_group=no-such-group-here")
    assert result.returncode == 2
    assert result.stderr == "sidecar: setting socket_group: no group named 'no-such-group-here'\n"


def test_an_unreadable_token_file_exits_2(tmp_path):
    result = run_sidecar("--socket", str(tmp_path / "s.sock"), "--set", f"token_file={tmp_path / 'missing'}")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("sidecar: setting token_file: cannot read")


def test_a_tcp_port_in_use_exits_1_and_leaves_no_socket(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_sidecar(
            "--listen",
            f"127.0.0.1:{port}",
            "--socket",
            str(tmp_path / "s.sock"),
            "--set",
            "collectors.enabled=[]",
            "--set",
            "listen_retry_seconds=0",  # the retry is tests/security/test_start_and_stop.py's
        )
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert not (tmp_path / "s.sock").exists()


def listening_url(log) -> str:
    found = wait_until(
        lambda: log.exists() and re.search(r"listening on (http://[\d.]+:\d+)", log.read_text(errors="replace")),
        30,
        what="the listening line",
    )
    return found.group(1)


def test_port_0_tcp_beyond_loopback_with_a_token_and_a_clean_stop(tmp_path):
    group = grp.getgrgid(os.getgid()).gr_name
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(30)
    sock_path = tmp_path / "run" / "sidecar.sock"  # its directory does not exist yet
    # A stale socket (its sidecar died) is replaced.
    sock_path.parent.mkdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_path))
    stale.close()
    log = tmp_path / "sidecar.log"
    cmd = [
        PYTHON,
        "-m",
        "sidecar",
        "run",
        "--listen",
        "0.0.0.0:0",
        "--socket",
        str(sock_path),
        "--set",
        "collectors.enabled=[]",
        "--set",
        f"diag_dir={tmp_path / 'diag'}",
        "--observe-only",
        "--set",
        f"socket_group={group}",
        "--set",
        "socket_mode=0600",
    ]
    with spawned(cmd, log, env={"NOTIFY_SOCKET": str(tmp_path / "notify"), "SIDECAR_TOKEN": "t0ken"}) as proc:
        try:
            assert notify.recv(256) == b"READY=1"
            url = listening_url(log).replace("0.0.0.0", "127.0.0.1")
            assert "observe-only" in log.read_text()
            info = os.stat(sock_path)
            assert (stat.S_IMODE(info.st_mode), info.st_gid) == (0o600, os.getgid())
            assert http_get(url + "/healthz")[0] == 200
            conn = http.client.HTTPConnection(url.removeprefix("http://").split(":")[0], int(url.rsplit(":", 1)[1]))
            conn.request("POST", "/v1/register", json.dumps(registration(os.getpid())))
            assert conn.getresponse().status == 401
            conn.close()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            assert notify.recv(256) == b"STOPPING=1"
            assert not sock_path.exists()
        except BaseException:
            print(tail(log))
            raise
        finally:
            notify.close()


def test_the_start_up_line_is_written_once(daemon):
    assert daemon.log.read_text(errors="replace").count(" listening on ") == 1


def test_port_0_advertises_the_port_it_bound_to_the_job_view(tmp_path, rank_process):
    log = tmp_path / "sidecar.log"
    sock = str(tmp_path / "sidecar.sock")
    cmd = [PYTHON, "-m", "sidecar", "run", "--listen", "127.0.0.1:0", "--socket", sock]
    cmd += ["--set", "collectors.enabled=[]", "--set", f"diag_dir={tmp_path / 'diag'}"]
    with spawned(cmd, log):
        try:
            url = listening_url(log)
            assert not url.endswith(":0")
            status, body = post(sock, "/v1/register", registration(rank_process.pid, job="port-0", world_size=2))
            assert status == 200, body
            assert body["job_view"]["url"] == url
            # The hooks hand the offer back as the job's coordinator: taken, not refused.
            offer = {k: body["job_view"][k] for k in ("url", "node", "key")}
            event = {"type": "event", "name": "job_coordinator", "time": time.time(), "fields": offer}
            status, body = post(sock, "/v1/push", push_body(rank_process.pid, [event], job="port-0"))
            assert status == 200, body
            wait_until(lambda: "coordinator is" in log.read_text(errors="replace"), 30, what="the coordinator taken")
            assert "refused" not in log.read_text(errors="replace")
        except BaseException:
            print(tail(log))
            raise
