"""A process's cgroup as the kernel reports it, opened without trusting any name in it.

The controller's hierarchy comes from mountinfo, the process's path in it from
/proc/<pid>/cgroup; the directory is opened component by component with O_NOFOLLOW under the
mount point (a cgroup name is chosen by whoever created the cgroup, possibly a user with a
delegated subtree), and it must list the process in its cgroup.procs. Files inside are read
relative to that descriptor, bounded. The exit tracker reads the memory controller's OOM
counter through it (sidecar/exits/kernel.py), the watchdog the freezer state of a process that
outlived SIGKILL (sidecar/host/stuck.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass

MAX_CGROUP_DEPTH = 32
MAX_PROCS_BYTES = 1 << 20  # cgroup.procs read to check membership
MAX_FILE_BYTES = 4096  # a control file (memory.events, freezer.state, ...)
MOUNTS_MAX_AGE = 60.0  # seconds; mountinfo can be long on a busy node, and cgroup mounts rarely change
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

UNIFIED = ""  # the controller name of the unified (v2) hierarchy, as /proc/<pid>/cgroup writes it
SLURM_JOB_CGROUP = re.compile(r"job_([0-9]{1,20})")  # slurmstepd's job_<SLURM_JOB_ID> directory


@dataclass
class CgroupDir:
    """An open cgroup directory: `path` is for people, `fd` is what is read."""

    path: str
    fd: int
    version: int  # 1 or 2

    def read(self, name: str, limit: int = MAX_FILE_BYTES) -> str | None:
        return read_at(self.fd, name, limit)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def read_at(dir_fd: int, name: str, limit: int) -> str | None:
    """At most `limit` bytes of the file `name` in `dir_fd` (never through a symlink), or None."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return os.read(fd, limit).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


_mounts_cache: dict[tuple[str, str], tuple[float, dict[int, tuple[str, str]]]] = {}


def mounts(procfs: str, controller: str) -> dict[int, tuple[str, str]]:
    """{version: (mount point, mount root)} of the hierarchies that hold `controller` (a v1
    controller name such as "memory" or "freezer"; the unified hierarchy holds every one)."""
    now = time.monotonic()
    key = (procfs, controller)
    cached = _mounts_cache.get(key)
    if cached is None or now - cached[0] >= MOUNTS_MAX_AGE:
        cached = _mounts_cache[key] = (now, _read_mounts(procfs, controller))
    return cached[1]


def _read_mounts(procfs: str, controller: str) -> dict[int, tuple[str, str]]:
    out: dict[int, tuple[str, str]] = {}
    try:
        with open(f"{procfs}/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        pre, sep, post = line.partition(" - ")
        fields, rest = pre.split(), post.split()
        if not sep or len(fields) < 5 or len(rest) < 3:
            continue
        root, point = _unescape(fields[3]), _unescape(fields[4])
        if rest[0] == "cgroup2":
            out.setdefault(2, (point, root))
        elif rest[0] == "cgroup" and controller in rest[2].split(","):
            out.setdefault(1, (point, root))
    return out


def _unescape(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def cgroup_of(pid: int, controller: str, procfs: str = "/proc") -> CgroupDir | None:
    """The cgroup of `pid` for `controller`, opened, or None. Where cgroup v1 mounts that
    controller (hosts with the legacy or hybrid layout) its hierarchy; otherwise the unified
    (v2) one. The caller checks afterwards that `pid` is still the process it means."""
    try:
        with open(f"{procfs}/{int(pid)}/cgroup") as f:
            lines = f.read(65536).splitlines()
    except (OSError, ValueError):
        return None
    found = mounts(procfs, controller)
    wanted: dict[int, str] = {}
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == UNIFIED:
            wanted.setdefault(2, path)
        elif controller in controllers.split(","):
            wanted.setdefault(1, path)
    for version in (1, 2):
        if version in wanted and version in found:
            opened = _open(found[version], wanted[version], version, pid)
            if opened is not None:
                return opened
    return None


def _open(mount: tuple[str, str], path: str, version: int, pid: int) -> CgroupDir | None:
    point, root = mount
    if root != "/":
        if path != root and not path.startswith(root.rstrip("/") + "/"):
            return None
        path = path[len(root) :]
    parts = [p for p in path.split("/") if p]
    if len(parts) > MAX_CGROUP_DEPTH or any(p in (".", "..") for p in parts):
        return None
    try:
        fd = os.open(point, _O_DIR)
    except OSError:
        return None
    try:
        for part in parts:
            nxt = os.open(part, _O_DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError:
        os.close(fd)
        return None
    members = read_at(fd, "cgroup.procs", MAX_PROCS_BYTES) or ""
    if str(pid) not in members.split():
        os.close(fd)
        return None
    return CgroupDir(os.path.join(point, *parts), fd, version)


def slurm_job_of(pid: int, procfs: str = "/proc") -> str | None:
    """The Slurm job whose cgroup holds `pid` (the kernel's record, /proc/<pid>/cgroup, not the
    process's word), or None. slurmstepd puts a job's tasks under `job_<id>`: cgroup v1
    `/slurm/uid_<uid>/job_<id>/step_<s>/task_<t>`, v2 `/system.slice/slurmstepd.scope/job_<id>/step_<s>/...`.
    The outermost `job_<id>` below a directory whose name holds "slurm" counts: a subtree Slurm
    delegates to the job's user lies deeper, so names the user chooses come after it."""
    try:
        with open(f"{procfs}/{int(pid)}/cgroup") as f:
            lines = f.read(65536).splitlines()
    except (OSError, ValueError):
        return None
    for line in lines:
        parts = [p for p in line.split(":", 2)[-1].split("/") if p]
        for i, part in enumerate(parts):
            found = SLURM_JOB_CGROUP.fullmatch(part)
            if found and any("slurm" in p for p in parts[:i]):
                return found.group(1)
    return None
