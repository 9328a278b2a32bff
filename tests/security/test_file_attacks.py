"""Issue 9, rows 1-4: an unprivileged local user turns the sidecar's file handling against the
node. Each attack runs as a throw-away user (tests/support/unpriv.py) with the standard library only,
against a real sidecar whose socket is open to everyone (mode 0666, as shipped), and must get
nothing: no file it could not read lands in an incident, nothing root owns is written, and no
path it names can block the sidecar. docs/security.md, "Files the sidecar opens and writes"."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import PYTHON, Sidecar, tail, wait_until
from tests.support.unpriv import (
    UNPRIV_PYTHON,
    run_as,
    stage_hooks,
    unprivileged_user,
    world_dir,
)

QUICK_STALLS = (
    "socket_mode=0666",
    "collectors.enabled=[]",
    "hooks_flush_interval_seconds=0.5",
    "watchdog.check_interval_seconds=0.25",
    "watchdog.startup_timeout_seconds=2",
    "watchdog.floor_seconds=2",
    "remediation.py_spy=false",
    "remediation.dump_wait_seconds=1",
    "remediation.kill_without_restart=true",  # the victim is a plain python rank, no launcher
    "remediation.grace_seconds=2",
    "remediation.max_per_window=50",
    "limits.max_jobs=64",
)

# The attacker's toolkit: raw HTTP over the sidecar's Unix socket, standard library only.
CLIENT = r"""
import http.client, json, os, signal, socket, sys, tempfile, time
SOCK = os.environ["SIDECAR_SOCKET"]
class Conn(http.client.HTTPConnection):
    def __init__(self):
        super().__init__("localhost", timeout=30)
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(30)
        self.sock.connect(SOCK)
def post(path, body):
    c = Conn()
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, json.loads(data or b"null")
def register(job, path, signum=int(signal.SIGUSR2)):
    return post("/v1/register", {"job_id": job, "rank": 0, "world_size": 1, "pid": os.getpid(),
                                 "stack_dump": {"signal": signum, "path": path}})
def report(**kw):
    print(json.dumps(kw), flush=True)
"""

# Row 1: the dump path is a symlink to the attacker's own empty file; when the dump signal
# comes, it is re-pointed at a root-only file (the sidecar measured the empty file first).
SYMLINK_ATTACK = (
    CLIENT
    + r"""
secret = sys.argv[1]
d = tempfile.mkdtemp()
empty = os.path.join(d, "empty")
open(empty, "w").close()
link = os.path.join(d, "dump")
os.symlink(empty, link)
def repoint(*_):
    os.symlink(secret, link + ".new")
    os.replace(link + ".new", link)
signal.signal(signal.SIGUSR2, repoint)
status, body = register("row1", link)
report(status=status, body=body)
time.sleep(120)  # and never push: a stall
"""
)

# Row 2: the dump path is another process's environment (here: the sidecar's own).
PROC_ATTACK = (
    CLIENT
    + r"""
signal.signal(signal.SIGUSR2, signal.SIG_IGN)
status, body = register("row2", sys.argv[1])
report(status=status, body=body)
time.sleep(120)
"""
)

# Row 3: the job_id `incidents` (the incident store's directory), then symlinks planted under
# every temporary name the next incident of job "row3" could use, pointing at a root file.
PLANT_ATTACK = (
    CLIENT
    + r"""
import subprocess
target, incidents = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGUSR2, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # its stall must not end us
status, body = post("/v1/register", {"job_id": "incidents", "rank": 0, "world_size": 1, "pid": child.pid})
report(step="incidents", status=status, body=body)
planted, error = 0, None
start = time.time() + 1.0
for ms in range(8000):  # every millisecond of the 8 s in which the stall will be detected
    t = start + ms / 1000
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
    try:
        os.symlink(target, os.path.join(incidents, f"{stamp}-row3.json.tmp"))
        planted += 1
    except OSError as e:
        error = f"{type(e).__name__}: {e}"
        break
report(step="planted", planted=planted, error=error)
status, body = register("row3", None)
report(step="row3", status=status, body=body)
time.sleep(120)
"""
)

# Row 4: the dump path is a FIFO nobody writes: opening it blocks until a writer comes.
FIFO_ATTACK = (
    CLIENT
    + r"""
signal.signal(signal.SIGUSR2, signal.SIG_IGN)
d = tempfile.mkdtemp()
fifo = os.path.join(d, "dump")
os.mkfifo(fifo)
status, body = register(sys.argv[1], fifo)
report(status=status, body=body)
time.sleep(120)
"""
)

# Another user's real training rank (the hooks): steps every 0.1 s, then hangs for good.
VICTIM = r"""
import time
from trainer_hooks import Monitor
mon = Monitor(job_id="victim", rank=0, world_size=1)
for step in range(1, 21):
    mon.step(step, loss=1.0)
    time.sleep(0.1)
print("hanging", mon.stack_dump_path, flush=True)
def stuck_in_allreduce():
    time.sleep(600)
stuck_in_allreduce()
"""


@pytest.fixture
def node() -> Iterator[tuple[Path, Path]]:
    """(a directory every user can traverse, the hooks staged inside it for the users)."""
    d = world_dir()
    try:
        yield d, stage_hooks(d)
    finally:
        subprocess.run(["rm", "-rf", str(d)], check=False)


@contextlib.contextmanager
def attacker(user, script: str, *args: str, sidecar: Sidecar, hooks: Path | None = None):
    env = {"SIDECAR_SOCKET": sidecar.socket}
    if hooks is not None:
        env["PYTHONPATH"] = str(hooks)
    proc = run_as(user, [UNPRIV_PYTHON, "-c", script, *args], env=env, stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@contextlib.contextmanager
def explained(sc: Sidecar) -> Iterator[None]:
    """On failure, show what the sidecar logged."""
    try:
        yield
    except BaseException:
        print(f"--- sidecar log ---\n{tail(sc.log, 80)}")
        raise


def line(proc: subprocess.Popen) -> dict:
    text = proc.stdout.readline()
    assert text, f"the attacker printed nothing (exit {proc.poll()})"
    return json.loads(text)


def incidents(diag: Path, job: str) -> list[dict]:
    out = []
    for path in sorted((diag / "incidents").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            if record.get("job_id") == job:
                out.append(record)
    return out


def finished_incident(diag: Path, job: str, timeout: float = 60) -> dict:
    return wait_until(
        lambda: next((r for r in incidents(diag, job) if r.get("outcome") != "pending"), None),
        timeout,
        interval=0.25,
        what=f"the incident of job {job} to finish",
    )


def everything_written(diag: Path) -> str:
    """Every incident file and `sidecar incidents --full`: where a leak would show."""
    texts = [p.read_text(errors="replace") for p in (diag / "incidents").glob("*") if p.is_file()]
    out = subprocess.run(
        [PYTHON, "-m", "sidecar", "incidents", "--diag-dir", str(diag), "--full"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return "\n".join(texts) + out.stdout + out.stderr


def root_only_file(text: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix="sidecar-root-only-"))  # 0700, root's
    path = d / "secret"
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_row1_a_symlinked_dump_path_repointed_at_a_root_only_file_leaks_nothing(node):
    d, _ = node
    mallory = unprivileged_user("a")
    secret = "ROOT-ONLY-" + secrets.token_hex(8)
    secret_file = root_only_file(secret)
    try:
        with (
            Sidecar(d / "sc", *QUICK_STALLS) as sc,
            explained(sc),
            attacker(mallory, SYMLINK_ATTACK, str(secret_file), sidecar=sc) as proc,
        ):
            answer = line(proc)
            assert answer["status"] == 200, answer
            record = finished_incident(d / "sc" / "diag", "row1")
            assert any(e["event"] == "dumps_requested" for e in record["timeline"])  # the trap was sprung
            assert secret not in everything_written(d / "sc" / "diag")
            created = (answer["body"].get("stack_dump") or {}).get("path", "")
            assert created.startswith(str(d / "sc" / "diag" / "row1") + "/")  # the sidecar's own file
    finally:
        subprocess.run(["rm", "-rf", str(secret_file.parent)], check=False)


def test_row2_proc_environ_as_the_dump_path_leaks_nothing(node):
    d, _ = node
    mallory = unprivileged_user("a")
    token = "TOKEN-" + secrets.token_hex(12)
    with Sidecar(d / "sc", *QUICK_STALLS, env={"SIDECAR_TOKEN": token}) as sc, explained(sc):
        with attacker(mallory, PROC_ATTACK, f"/proc/{sc.proc.pid}/environ", sidecar=sc) as proc:
            answer = line(proc)
            assert answer["status"] == 200, answer
            record = finished_incident(d / "sc" / "diag", "row2")
            assert any(e["event"] == "dumps_requested" for e in record["timeline"])
            assert token not in everything_written(d / "sc" / "diag")


def test_row3_job_id_incidents_and_planted_tmp_symlinks_write_nothing_of_roots(node):
    d, _ = node
    mallory = unprivileged_user("a")
    original = "root's own file\n"
    target = root_only_file(original)
    try:
        with Sidecar(d / "sc", *QUICK_STALLS) as sc, explained(sc):
            diag = d / "sc" / "diag"
            with attacker(mallory, PLANT_ATTACK, str(target), str(diag / "incidents"), sidecar=sc) as proc:
                reserved, planted, row3 = line(proc), line(proc), line(proc)
                assert row3["status"] == 200, row3
                record = finished_incident(diag, "row3")
            assert target.read_text() == original
            assert record["outcome"] == "killed"
            assert reserved["status"] == 400 and reserved["body"]["code"] == "bad_field", reserved
            assert reserved["body"]["error"].startswith("job_id:"), reserved
            assert planted["planted"] == 0, planted  # nobody else may write in the sidecar's directories
            for path in [diag, diag / "incidents", diag / "row3"]:
                st = path.lstat()
                assert st.st_uid == os.geteuid() and st.st_mode & 0o022 == 0, (path, oct(st.st_mode))
            for path in (diag / "incidents").iterdir():
                assert path.lstat().st_mode & 0o777 == 0o600, path  # incidents are not world-readable
    finally:
        subprocess.run(["rm", "-rf", str(target.parent)], check=False)


@pytest.mark.slow
def test_row4_a_fifo_dump_path_blocks_nothing(node):
    d, hooks = node
    mallory, victim_user = unprivileged_user("a"), unprivileged_user("b")
    sc = Sidecar(d / "sc", *QUICK_STALLS)
    sc.start()
    diag = d / "sc" / "diag"
    try:
        with explained(sc), contextlib.ExitStack() as stack:
            # More stalled FIFO jobs than the sidecar has worker threads (min(32, cores + 4)).
            attacks = [
                stack.enter_context(attacker(mallory, FIFO_ATTACK, f"row4-{i}", sidecar=sc))
                for i in range(min(32, (os.cpu_count() or 1) + 4) + 2)
            ]
            accepted = [f"row4-{i}" for i, p in enumerate(attacks) if line(p)["status"] == 200]
            assert accepted
            wait_until(
                lambda: all(incidents(diag, job) for job in accepted), 60, interval=0.25, what="the FIFO jobs' stalls"
            )
            time.sleep(3)  # past the dump wait: the reads of the dumps have begun
            victim = stack.enter_context(attacker(victim_user, VICTIM, sidecar=sc, hooks=hooks))
            hanging = victim.stdout.readline().split()
            record = finished_incident(diag, "victim", timeout=90)
            assert record["outcome"] == "killed", record
            assert hanging[0] == "hanging" and hanging[1].startswith(str(diag / "victim") + "/"), hanging
            assert victim.wait(timeout=30) is not None
            stacks = record["ranks"][0]
            assert any("stuck_in_allreduce" in s for s in stacks["stack_head"]), stacks  # its dump was read
        sc.proc.send_signal(signal.SIGTERM)
        sc.proc.wait(timeout=30)  # raises TimeoutExpired when a blocked thread holds the exit
    finally:
        sc.stop()
