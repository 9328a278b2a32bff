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
from tests.unpriv import UNPRIV_PYTHON, User, run_as_sync, world_dir

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
''')


class OpenSidecar(Sidecar):
    """A sidecar in a fresh world-traversable directory, socket mode 0666; the directory goes
    when the `with` block ends."""

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        shutil.rmtree(self.workdir, ignore_errors=True)


def open_sidecar(*settings: str, name: str = "sidecar") -> OpenSidecar:
    """A sidecar (not started) in a fresh world-traversable directory, socket mode 0666."""
    return OpenSidecar(world_dir(), *OPEN_SOCKET, *settings, name=name)


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


def ranks_of(sidecar: Sidecar, job: str) -> dict[int, dict]:
    return {r["rank"]: r for r in sidecar.status()["ranks"] if r["job_id"] == job}


def start_as(user: User, sidecar: Sidecar, code: str, timeout: float = 60.0):
    """Start `code` (after CLIENT) as `user` in the background; returns (process, the dict it
    reported first). The caller stops the process (tests.support.kill_tree)."""
    import select
    import time

    proc = run_as_user_background(user, sidecar, code)
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
                return proc, json.loads(line[len("RESULT ") :])
        elif proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"no result from the background script:\n{buffered}{proc.stderr.read()}")


def run_as_user_background(user: User, sidecar: Sidecar, code: str) -> subprocess.Popen:
    from tests.unpriv import run_as

    return run_as(
        user,
        [UNPRIV_PYTHON, "-c", CLIENT + textwrap.dedent(code)],
        env={"SIDECAR_SOCKET": sidecar.socket},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
