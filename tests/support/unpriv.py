"""Unprivileged local users for the attack tests.

The sidecar runs as root and its socket is open to every local user, so the security tests
run each attack as an ordinary user. CI runs as root: these helpers create throw-away system
users (idempotently) and run standard-library Python as them with `/usr/bin/python3`, which
every user may execute (the dev venv's interpreter lives under /root, mode 0700).

Usage:
    alice = unprivileged_user("a")            # creates "sidecar-t-a" once
    d = world_dir(tmp_path)                   # a 0755 directory the user can read
    hooks = stage_hooks(d)                    # a copy of trainer_hooks the user can import
    proc = run_as(alice, [UNPRIV_PYTHON, "-c", code], env={"PYTHONPATH": str(hooks)})
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import ROOT

UNPRIV_PYTHON = "/usr/bin/python3"
_PREFIX = "sidecar-t-"


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


def can_switch_users() -> bool:
    return os.geteuid() == 0 and shutil.which("useradd") is not None and os.path.exists(UNPRIV_PYTHON)


def unprivileged_user(tag: str) -> User:
    """An unprivileged system user `sidecar-t-<tag>`, created on first use (needs root;
    the test is skipped otherwise)."""
    if not can_switch_users():
        pytest.skip("needs root, useradd and /usr/bin/python3 to run attacks as another user")
    name = _PREFIX + tag
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        # --user-group gives each user its own group, so two test users share nothing.
        subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=False,
            capture_output=True,
        )
        entry = pwd.getpwnam(name)  # raises if useradd failed (also under a concurrent create)
    return User(name=name, uid=entry.pw_uid, gid=entry.pw_gid)


def world_dir(parent: Path | None = None) -> Path:
    """A fresh directory (mode 0755) on a path every user can traverse."""
    d = Path(tempfile.mkdtemp(prefix="sidecar-unpriv-", dir="/tmp"))
    d.chmod(0o755)
    return d


def stage_hooks(dest: Path) -> Path:
    """Copy the stdlib-only `trainer_hooks` package where an unprivileged user can import it;
    returns the directory to put on PYTHONPATH."""
    target = dest / "pylib"
    shutil.copytree(ROOT / "trainer_hooks", target / "trainer_hooks", ignore=shutil.ignore_patterns("__pycache__"))
    for path in [target, *target.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return target


def run_as(user: User, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """Start `argv` as `user` (uid, gid, no supplementary groups), in its own session."""
    full_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "PYTHONUNBUFFERED": "1"}
    full_env.update(env or {})
    return subprocess.Popen(
        list(argv), user=user.uid, group=user.gid, extra_groups=[], env=full_env, start_new_session=True, **kwargs
    )


def run_as_sync(
    user: User, argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess:
    """Run `argv` as `user` to completion; stdout and stderr captured as text."""
    proc = run_as(user, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
