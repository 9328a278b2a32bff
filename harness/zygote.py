"""Warm processes for the test suite: servers that import torchrun (or the sidecar) once and fork.

`python -m torch.distributed.run ...` spends about 2.3 CPU-s importing torch and torchrun before
its agent does anything, and `python -m sidecar run` 0.4 CPU-s importing the daemon; the suite
starts over a hundred agents and hundreds of sidecars. A server
(`python -m harness.warm_server SOCKET MODULE`) imports what its MODULE needs once; for each request it
forks a child that becomes the process asked for: a session of its own, output appended to the
log, stdin /dev/null, the request's working directory, environment and `sys.path` (the
directory, then PYTHONPATH's, then the interpreter's own), and then the module the request names
(MODULE, or one of the modules its server also runs) run as `__main__`, as `python -m` runs it.
What the process does from there is its own code: for an agent, torchrun's rendezvous, its
workers, their restarts and the exit status (torchrun starts its workers as new interpreters, or
from a rank server of the agent where `harness/zygote_ranks.py` can honour them); for a sidecar,
`sidecar run` from its argument parsing on.

What differs from a cold start: the modules were imported with the server's environment, so a
request whose environment differs in what is read at import or at the process's start (`PYTHON*`
other than PYTHONPATH, `LD_*` and harness/node_clock.c's `NODE_CLOCK_*`, and each kind's own: LOGLEVEL for
torchrun's loggers, `TORCH_LOGS` and C++ logging; aiohttp's `AIOHTTP_*`) is answered "cold" and
started as a new interpreter; the process's parent is the server (which reaps it and reports its
exit status); its command line is the server's.

Used only where ENV names a directory (tests/conftest.py sets it for each test worker, which
starts each server on its first request; `SIDECAR_TEST_COLD_AGENTS=1` turns it off), by
`harness.processes.Processes.start` and `tests.support.spawned`, for commands that are exactly
`[sys.executable, "-m", "torch.distributed.run", ...]` (or the project's two torchruns,
`trainer_hooks.launch` and `sidecar_trainer.launch`, which import the rest of what they need in the
child) or `[sys.executable, "-m", "sidecar", "run", ...]`: one run under `ip netns exec`, `runuser`,
a nice prefix or another launcher is started cold as before."""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ENV = "DEMO_AGENT_ZYGOTE"  # the directory of the servers' sockets
OWNER_ENV = "DEMO_AGENT_ZYGOTE_OWNER"  # the process that uses them (`owner()`), starting each on its first request
START_TIMEOUT = 120.0  # a server's imports, on a loaded machine
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Kind:
    preload: tuple[str, ...]  # imported once by the server
    import_env: tuple[str, ...]  # read at import: a request that sets them otherwise is started cold
    args: tuple[str, ...] = ()  # what must follow `-m MODULE`
    # Other modules the server runs: torchrun with more of its own (the child imports the rest).
    also: tuple[str, ...] = ()


KINDS = {
    "torch.distributed.run": Kind(
        ("torch", "torch.distributed.run", "torch._dynamo"),  # torch._dynamo: DDP and optimizers import it
        ("LOGLEVEL", "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES"),
        also=("trainer_hooks.launch", "sidecar_trainer.launch"),
    ),
    "sidecar": Kind(("sidecar.cli", "sidecar.daemon.app"), ("AIOHTTP_NO_EXTENSIONS", "AIOHTTP_NOSENDFILE"), ("run",)),
}

_servers: dict[str, subprocess.Popen] = {}
# In a server: the environment its modules were imported with, what importing them set in it
# (torch._dynamo sets TORCHINDUCTOR_CACHE_DIR), and the interpreter's own sys.path.
IMPORTED_WITH: dict[str, str] = {}
SET_BY_IMPORT: dict[str, str] = {}
BASE_PATH: list[str] = []


# ---------------------------------------------------------------- the client's side


def eligible(cmd: Sequence[str]) -> str | None:
    """The server (a key of KINDS) that starts `cmd`, else None."""
    if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m":
        return None
    for name, kind in KINDS.items():
        if (cmd[2] == name and tuple(cmd[3 : 3 + len(kind.args)]) == kind.args) or cmd[2] in kind.also:
            return name
    return None


class WarmProcess(subprocess.Popen):
    """A `subprocess.Popen` for a process a server forked: its pid, and its exit status as the
    server reports it (the server is its parent and reaps it)."""

    def __init__(self, sock: socket.socket, pid: int, args: Sequence[str]):  # no Popen.__init__: nothing to start
        self.args = list(args)
        self.pid = pid
        self.returncode = None
        self.stdin = self.stdout = self.stderr = None
        self._child_created = False  # Popen.__del__ has nothing to reap
        self._sock = sock
        self._buffer = b""
        self._status: int | None = None  # as the server reported it; the returncode once polled

    def _read(self, timeout: float | None) -> None:
        self._receive(timeout)
        if self._status is not None and self.returncode is None:  # polled, as Popen.poll reaps
            self.returncode = self._status
            with contextlib.suppress(OSError):
                self._sock.sendall(b"read\n")  # the server may reap it now (`serve`'s `keep`)

    def _receive(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._status is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._sock.settimeout(left)
            try:
                data = self._sock.recv(256)
            except (TimeoutError, BlockingIOError):
                return
            if not data:  # the server ended before the agent: wait for the pid itself to go
                self._wait_pid(deadline)
                return
            self.take(data)
            if deadline is not None and time.monotonic() >= deadline:
                return

    def take(self, data: bytes) -> None:
        """What the server said about the process (its exit status)."""
        self._buffer += data
        for line in self._buffer.split(b"\n")[:-1]:
            if line.startswith(b"exit "):
                self._status = int(line.split()[1])
        self._buffer = self._buffer.rsplit(b"\n", 1)[-1]

    def _wait_pid(self, deadline: float | None) -> None:
        while os.path.exists(f"/proc/{self.pid}/stat"):
            if deadline is not None and time.monotonic() >= deadline:
                return
            time.sleep(0.05)
        self._status = -signal.SIGKILL  # unknown: reaped by init after the server ended

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        with contextlib.suppress(OSError):
            self._sock.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


def owner() -> str:
    """This process as OWNER_ENV names it: its pid and its pid namespace. Only the process that set
    ENV uses the servers: its children inherit ENV, and one of them in a pid namespace of its own (a
    test of namespaces) would otherwise get a process forked outside it."""
    return f"{os.getpid()}:{os.stat('/proc/self/ns/pid').st_ino}"


def spawn(cmd: Sequence[str], env: dict[str, str], cwd: str | Path, log: str | Path) -> subprocess.Popen | None:
    """The process forked by a server, or None where none is used (no server configured, not the
    process that configured it, a command no server starts, an environment it cannot honour): the
    caller starts `cmd` itself."""
    directory, module = os.environ.get(ENV), eligible(cmd)
    if not directory or not module or os.environ.get(OWNER_ENV) != owner():
        return None
    sock = _connect(directory, module)
    if sock is None:
        return None
    return ask(sock, {"argv": list(cmd), "env": dict(env), "cwd": str(cwd), "log": str(log)})


def ask(sock: socket.socket, request: dict) -> WarmProcess | None:
    """Send `request` to the server `sock` is connected to: the process it forked, or None where it
    answers that it cannot honour the request ("cold") or does not answer."""
    try:
        sock.sendall(json.dumps(request).encode() + b"\n")
        sock.settimeout(60)
        reply = b""
        while b"\n" not in reply:
            data = sock.recv(256)
            if not data:
                raise OSError("the server closed the connection")
            reply += data
    except OSError as e:
        sock.close()
        print(f"harness.zygote: {e}; starting {request['argv'][2]} cold", file=sys.stderr)
        return None
    first, _, after = reply.partition(b"\n")
    word, _, rest = first.decode().strip().partition(" ")
    if word != "pid":
        sock.close()
        return None  # "cold": the server cannot honour this environment
    proc = WarmProcess(sock, int(rest), request["argv"])
    proc.take(after)  # a process that ended at once: its status came with its pid
    return proc


def _connect(directory: str, module: str) -> socket.socket | None:
    path = os.path.join(directory, f"{module}.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(OSError):
        sock.connect(path)
        return sock
    server = _servers.get(module)
    if server is None:
        server = _servers[module] = subprocess.Popen(
            [sys.executable, "-m", "harness.warm_server", path, module],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.DEVNULL,
            stderr=open(f"{path}.log", "ab"),  # noqa: SIM115 (the server's own, for as long as it runs)
        )
    sock.close()
    started = connect(path, START_TIMEOUT, lambda: server.poll() is None)
    if started is None:
        print(
            f"harness.zygote: the server at {path} did not start (see {path}.log); starting {module} cold",
            file=sys.stderr,
        )
    return started


def connect(path: str, timeout: float, alive: Callable[[], bool]) -> socket.socket | None:
    """A connection to the server at `path`, once it listens; None if it is not `alive` or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError:
            sock.close()
        time.sleep(0.05)
    return None


def stop() -> None:
    """End this process's servers (what they started lives on in its own sessions)."""
    while _servers:
        _, server = _servers.popitem()
        server.kill()
        server.wait()


# ---------------------------------------------------------------- the server's side


def refusal(request: dict, module: str) -> str | None:
    """Why the request must be started cold by a server of `module`, else None."""
    env = request.get("env")
    if not isinstance(env, dict) or eligible(request.get("argv") or []) != module:
        return f"not {module}"
    # Python's own, and what the process's start reads (the dynamic loader's LD_PRELOAD, harness/node_clock.c's offset)
    started = ("PYTHON", "LD_", "NODE_CLOCK_")
    keys = {*KINDS[module].import_env, *(k for k in (*env, *os.environ) if k.startswith(started))}
    keys -= {"PYTHONPATH", "PYTHONUNBUFFERED"}
    differ = sorted(k for k in keys if env.get(k) != os.environ.get(k))
    if differ:
        return f"read at import: {','.join(differ)}"
    if env.get("PYTHONUNBUFFERED", "") in ("", "0"):
        return "buffered output"
    return None


def serve(path: str, preload: Sequence[str], check: Callable[[dict], str | None], keep: bool = False) -> dict:
    """Serve requests until the owner (the parent) ends: import `preload`, then fork a child for
    each request that `check` does not refuse. Returns only in a forked child, with its request.
    `keep`: a child that ended stays a zombie until its client has read its exit status (or went
    away), as a child of the client's own would until its `Popen.poll`: its pid and process group
    stay there to be signalled (torchrun's `killpg` of a worker that has just ended)."""
    owner = os.getppid()  # the test worker (or the agent): the server ends within a second of it
    gc.disable()  # as the gc module's docs advise for a fork server: no holes in the heap, and
    before = dict(os.environ)
    for name in preload:
        importlib.import_module(name)
    if not IMPORTED_WITH:
        IMPORTED_WITH.update(before)
        SET_BY_IMPORT.update({k: v for k, v in os.environ.items() if before.get(k) != v})
        BASE_PATH[:] = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    gc.freeze()  # the children's collections never touch (and so copy) what the imports made
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    buffers: dict[socket.socket, bytes] = {}
    children: dict[int, socket.socket | None] = {}
    reported: set[int] = set()  # with `keep`: ended, its status sent, not reaped yet
    while os.getppid() == owner:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                buffers[conn] = b""
                selector.register(conn, selectors.EVENT_READ)
            elif key.fileobj == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            else:
                conn = key.fileobj  # type: ignore[assignment]
                data = b""
                with contextlib.suppress(OSError):
                    data = conn.recv(65536)
                if not data or conn not in buffers:  # the client went away (or read the status it was sent)
                    selector.unregister(conn)
                    buffers.pop(conn, None)
                    for pid, c in list(children.items()):
                        if c is conn and pid in reported:
                            os.waitpid(pid, 0)  # a zombie: the client has its status
                            del children[pid]
                            reported.discard(pid)
                        elif c is conn:
                            children[pid] = None
                    conn.close()
                    continue
                buffers[conn] += data
                if b"\n" not in buffers[conn]:
                    continue
                line = buffers.pop(conn).split(b"\n", 1)[0]
                try:
                    request = json.loads(line)
                    why = check(request)
                except (ValueError, TypeError, KeyError) as e:
                    request, why = {}, f"bad request: {e}"
                if why:
                    with contextlib.suppress(OSError):
                        conn.sendall(f"cold {why}\n".encode())
                    selector.unregister(conn)
                    conn.close()
                    continue
                ready_r, ready_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.setsid()  # a session of its own before its pid is given out: it can be killpg'd
                    os.close(ready_r)
                    os.write(ready_w, b".")
                    os.close(ready_w)
                    gc.enable()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    selector.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    for c in [listener, *buffers, *(c for c in children.values() if c), conn]:
                        c.close()
                    return request
                os.close(ready_w)
                os.read(ready_r, 1)  # its setsid is done (or it died: end of file)
                os.close(ready_r)
                children[pid] = conn
                with contextlib.suppress(OSError):
                    conn.sendall(f"pid {pid}\n".encode())
        if keep:
            _report(children, reported)
        else:
            _reap(children)
    raise SystemExit(0)


def _report(children: dict[int, socket.socket | None], reported: set[int]) -> None:
    """Send each ended child's exit status to its client, leaving it a zombie (`serve`'s `keep`)."""
    for pid, conn in list(children.items()):
        if pid in reported:
            continue
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is None:
            continue
        if conn is None:  # its client went away: nobody to read it
            os.waitpid(pid, 0)
            del children[pid]
            continue
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        with contextlib.suppress(OSError):
            conn.sendall(f"exit {code}\n".encode())
        reported.add(pid)


def _reap(children: dict[int, socket.socket | None]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            # the client reads the status, then closes; the server forgets the connection then


def become(request: dict) -> None:
    """In the forked child (a session of its own already): the agent's output, directory, environment and path."""
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    cwd = request["cwd"]
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.abspath(cwd), *extra, *BASE_PATH]
    sys.argv = [request["argv"][0], *request["argv"][3:]]  # argv[0] becomes the module's file
