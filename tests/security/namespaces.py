"""Run code as pid 1 of a fresh pid namespace (`unshare --pid --fork --mount-proc`, as root):
the way to force pid reuse deterministically (write `/proc/sys/kernel/ns_last_pid`, then fork:
no other process on the machine competes for pids there) and to stand in for a pod without
`hostPID`."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap

import pytest

from tests.security.rig import CLIENT, result_of
from tests.support import PYTHON, ROOT

UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"

# For the code that runs inside: fork a process that gets exactly the pid `want`.
REUSE = textwrap.dedent(r'''
    def process_with_pid(want, argv, **kw):
        """Start argv so that it gets pid `want` in this namespace (nobody else forks here)."""
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(want - 1))
        p = subprocess.Popen(argv, **kw)
        assert p.pid == want, (p.pid, want)
        return p
''')


def needs_namespaces() -> None:
    if os.geteuid() != 0 or not os.path.exists(UNSHARE):
        pytest.skip("needs root and unshare(1) for pid namespaces")


def in_new_pid_namespace(code: str, env: dict[str, str], timeout: float = 120.0) -> dict:
    """Run CLIENT + REUSE + `code` with the project's Python as pid 1 of a new pid namespace
    (root, sharing everything else); returns the dict it reported."""
    needs_namespaces()
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env)
    source = f"CLIENT = {CLIENT!r}\n" + CLIENT + REUSE + textwrap.dedent(code)
    proc = subprocess.run(
        [UNSHARE, "--pid", "--fork", "--kill-child", "--mount-proc", PYTHON, "-c", source],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )
    return result_of(proc)


def start_in_new_pid_namespace(code: str, env: dict[str, str], timeout: float = 60.0):
    """Like in_new_pid_namespace, but in the background: returns (the unshare process, the host
    pid of the namespace's pid 1, the first dict the code reported). Stop it with kill_tree.
    The code must live on after it reports (its pid 1 is looked up then); code that ends by
    itself belongs in in_new_pid_namespace."""
    import json
    import select
    import time

    import psutil

    needs_namespaces()
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env)
    source = f"CLIENT = {CLIENT!r}\n" + CLIENT + REUSE + textwrap.dedent(code)
    proc = subprocess.Popen(
        [UNSHARE, "--pid", "--fork", "--kill-child", "--mount-proc", PYTHON, "-c", source],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("RESULT "):
                children = psutil.Process(proc.pid).children()
                if not children:
                    proc.kill()
                    raise AssertionError("the namespace's pid 1 ended right after reporting; use in_new_pid_namespace")
                init = children[0].pid
                return proc, init, json.loads(line[len("RESULT ") :])
            if not line:
                break
    proc.kill()
    raise AssertionError(f"no result from the namespace:\n{proc.stderr.read()}")
