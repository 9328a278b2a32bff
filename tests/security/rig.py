"""A real sidecar that unprivileged users can reach, and the standard-library client the
attacks run as those users (`CLIENT` is prepended to each attack's code).

The sidecar runs as root with its socket at mode 0666, as the shipped configurations have it.
Its directory is world-traversable so that any local user can connect."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap

from tests.support import Sidecar
from tests.support.unpriv import UNPRIV_PYTHON, User, run_as_sync, world_dir

# Fast watchdog for tests that need stalls; 0666 socket as shipped.
OPEN_SOCKET = ("socket_mode=0666", "remediation.py_spy=false")

CLIENT = textwrap.dedent(r'''
    import json, os, socket, subprocess, sys, time
    SOCK = os.environ.get("SIDECAR_SOCKET", "")

    def request(path, body, sock=None, method="POST"):
        """One HTTP/1.1 request over the Unix socket; (status, parsed body)."""
        own = sock is None
        if own:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(30)
            sock.connect(SOCK)
        data = b"" if body is None else json.dumps(body).encode()
        head = (f"{method} {path} HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n" + ("Connection: close\r\n" if own else "") + "\r\n")
        sock.sendall(head.encode() + data)
        raw = b""
        while b"\r\n\r\n" not in raw:
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
        header, _, rest = raw.partition(b"\r\n\r\n")
        status = int(header.split()[1])
        length = next((int(line.split(b":")[1]) for line in header.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), None)
        while length is not None and len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        if own:
            sock.close()
        try:
            return status, json.loads(rest)
        except ValueError:
            return status, rest.decode(errors="replace")

    def registration(pid, job, rank=0, world_size=4, **extra):
        body = {"job_id": job, "rank": rank, "local_rank": rank % 4, "world_size": world_size,
                "local_world_size": min(4, world_size), "restart_count": 0, "pid": pid}
        body.update(extra)
        return body

    def sleeper():
        """A process of this user that stands in for a rank (a child: we may register it)."""
        return subprocess.Popen(["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def report(**values):
        print("RESULT " + json.dumps(values), flush=True)

    def sign(key, method, path, body, dest, stamp=None):
        """The job view's request signature (sidecar/jobview/auth.py), written out again here."""
        import hashlib, hmac, secrets
        stamp = f"{time.time() if stamp is None else stamp:.3f}"
        nonce = secrets.token_hex(12)
        parts = [method.encode(), path.encode(), dest.encode(), stamp.encode(), nonce.encode(),
                 hashlib.sha256(body).hexdigest().encode()]
        return f"{stamp}:{nonce}:" + hmac.new(key.encode(), b"\n".join(parts), hashlib.sha256).hexdigest()

    def sign_reply(key, nonce, body):
        import hashlib, hmac
        parts = [b"reply", nonce.encode(), hashlib.sha256(body).hexdigest().encode()]
        return hmac.new(key.encode(), b"\n".join(parts), hashlib.sha256).hexdigest()

    def tcp(port, method, path, body=None, headers=None, conn=None):
        """One request over TCP to 127.0.0.1:port; (status, parsed body). `body`: bytes or a dict."""
        import http.client
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        own = conn is None
        conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            if own:
                conn.close()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw.decode(errors="replace")
''')


class OpenSidecar(Sidecar):
    """A sidecar in a fresh world-traversable directory, socket mode 0666; the directory goes
    when the `with` block ends."""

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        shutil.rmtree(self.workdir, ignore_errors=True)


def open_sidecar(*settings: str, name: str = "sidecar", env: dict | None = None) -> OpenSidecar:
    """A sidecar (not started) in a fresh world-traversable directory, socket mode 0666."""
    return OpenSidecar(world_dir(), *OPEN_SOCKET, *settings, name=name, env=env)


def attack(user: User, sidecar: Sidecar, code: str, timeout: float = 120.0) -> dict:
    """Run `code` (after CLIENT) as `user` against `sidecar`; the dict it passed to report()."""
    proc = run_as_sync(
        user,
        [UNPRIV_PYTHON, "-c", CLIENT + textwrap.dedent(code)],
        env={"SIDECAR_SOCKET": sidecar.socket},
        timeout=timeout,
    )
    return result_of(proc)


def result_of(proc: subprocess.CompletedProcess) -> dict:
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"no result (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def register_as_root(sidecar: Sidecar, pid: int, job: str) -> int:
    """Register `pid` (a process of the test's, root's) as rank 0 of `job`; the HTTP status."""
    import socket

    body = json.dumps({"job_id": job, "rank": 0, "world_size": 1, "pid": pid}).encode()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sidecar.socket)
        s.sendall(
            b"POST /v1/register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        return int(s.recv(4096).split()[1])


def ranks_of(sidecar: Sidecar, job: str) -> dict[int, dict]:
    return {r["rank"]: r for r in sidecar.status()["ranks"] if r["job_id"] == job}


def start_as(user: User, sidecar: Sidecar, code: str, timeout: float = 60.0):
    """Start `code` (after CLIENT) as `user` in the background; returns (process, the dict it
    reported first). The caller stops the process (tests.support.kill_tree)."""
    proc = run_as_user_background(user, sidecar, code)
    try:
        return proc, next_result(proc, timeout)
    except AssertionError:
        proc.kill()
        raise


def next_result(proc, timeout: float) -> dict:
    """The next dict a background script reported (a `RESULT {...}` line), or AssertionError with
    what it wrote instead."""
    import select
    import time

    assert proc.stdout is not None and proc.stderr is not None
    deadline = time.monotonic() + timeout
    buffered = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            buffered += line
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        elif proc.poll() is not None:
            break
    stderr = proc.stderr.read() if proc.poll() is not None else ""
    raise AssertionError(f"no result from the background script:\n{buffered}{stderr}")


def run_as_user_background(user: User, sidecar: Sidecar, code: str) -> subprocess.Popen:
    from tests.support.unpriv import run_as

    return run_as(
        user,
        [UNPRIV_PYTHON, "-c", CLIENT + textwrap.dedent(code)],
        env={"SIDECAR_SOCKET": sidecar.socket},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# ---------------------------------------------------------------- round 2: measuring the daemon under attack


class LoopProbe:
    """A tight `/healthz` poller over TCP, from its own thread: the longest answer it waited for
    is how long the sidecar's event loop was held (a handler that only answers `{"ok": true}`
    waits for nothing else). Use as a context manager; `worst` is in seconds."""

    def __init__(self, sidecar: Sidecar, pause: float = 0.01):
        import threading

        self.sidecar, self.pause = sidecar, pause
        self.worst, self.samples, self.failures = 0.0, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import http.client
        import time

        while not self._stop.is_set():
            start = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", self.sidecar.port, timeout=300)
            try:
                conn.request("GET", "/healthz")
                if conn.getresponse().status != 200:
                    self.failures.append("status")
            except OSError as e:
                self.failures.append(str(e))
            finally:
                conn.close()
            self.worst = max(self.worst, time.monotonic() - start)
            self.samples += 1
            self._stop.wait(self.pause)

    def __enter__(self) -> LoopProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=300)


# A rank of another user running the real hooks, a step every 0.2 s (the victim that must stay
# healthy while someone else attacks the sidecar).
HEALTHY_RANK = r"""
import time
from trainer_hooks import Monitor
mon = Monitor(job_id="healthy", rank=0, world_size=1, flush_interval=0.2)
step = 0
while True:
    step += 1
    mon.step(step, loss=1.0)
    time.sleep(0.2)
"""


def start_healthy_rank(user: User, sidecar: Sidecar) -> subprocess.Popen:
    """HEALTHY_RANK as `user` (the caller stops it with tests.support.kill_tree), once the
    sidecar watches it as healthy."""
    from tests.support import wait_until
    from tests.support.unpriv import run_as, stage_hooks

    hooks = stage_hooks(sidecar.workdir)
    proc = run_as(
        user,
        [UNPRIV_PYTHON, "-c", HEALTHY_RANK],
        env={"SIDECAR_SOCKET": sidecar.socket, "PYTHONPATH": str(hooks)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_until(
        lambda: ranks_of(sidecar, "healthy").get(0, {}).get("state") == "healthy",
        60,
        interval=0.2,
        what="the healthy rank watched as healthy",
    )
    return proc


def healthy_rank_taken_for_stalled(sidecar: Sidecar) -> list[str]:
    """The healthy rank's transitions past suspect, from the sidecar's log (the watchdog logs
    every transition): empty when it was never taken for stalled."""
    return [
        line
        for line in sidecar.log.read_text(errors="replace").splitlines()
        if "rank healthy/0 " in line and ("-> stalled" in line or "-> remediating" in line)
    ]
