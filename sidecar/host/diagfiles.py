"""The diagnostics directory: the only place the sidecar writes, and how it writes there.

    <diag_dir>/                   owned by the sidecar's user, mode 0755
        incidents/                incident records (settings incident_file_mode, incident_group)
        <job>/                    one per job: the ranks' stack-dump files (`stackfiles.py`)

Rules, so that the question of symlinks and races cannot arise (docs/security.md):
- every directory is owned by the sidecar's user and writable by nobody else. A directory
  left group- or world-writable (by an older version) loses those bits when next used; one
  owned by another user, or a symlink, is refused (`UnsafeDirectory`).
- directories are opened with O_NOFOLLOW and everything inside them is named relative to
  that descriptor (`dir_fd`), never by a path walked again later.
- files are created with O_CREAT|O_EXCL|O_NOFOLLOW (a name that exists, even as a dangling
  symlink, fails) and replaced by rename() within the same directory descriptor.
- a job's directory name comes from `job_dir_name`, which can never be `incidents`, a dot
  name or contain a separator (the protocol refuses such job_ids before they get here).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

INCIDENTS = "incidents"
RESERVED_NAMES = frozenset({INCIDENTS})
DIR_MODE = 0o755
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")


class UnsafeDirectory(OSError):
    """A directory the sidecar will not write into; the message says why."""


def job_dir_name(job_id: str) -> str:
    """The directory name of a job's files: letters, digits and `._-` only, never a reserved
    or dot name (two job_ids may share a directory; every file in it has a unique name)."""
    name = _UNSAFE_CHARS.sub("_", job_id)[:128] or "_"
    if name.startswith(".") or name.lower() in RESERVED_NAMES:
        name = "_" + name
    return name


def _checked(fd: int, where: str) -> int:
    """`fd` of a directory, once it is known to be ours and writable by nobody else."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafeDirectory(f"{where} is owned by uid {st.st_uid}, not by the sidecar's user")
    if st.st_mode & 0o022:
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o022)
        log.warning(
            "%s was writable by other users (mode %o); made it %o",
            where,
            stat.S_IMODE(st.st_mode),
            stat.S_IMODE(st.st_mode) & ~0o022,
        )
    return fd


def open_root(diag_dir: Path | str) -> int:
    """The diag directory (created with its parents when missing), opened without following
    a symlink. Its parents come from the operator's settings and are trusted."""
    path = Path(diag_dir)
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, DIR_MODE)
    try:
        fd = os.open(path, DIR_FLAGS)
    except OSError as e:
        raise UnsafeDirectory(f"cannot open diagnostics directory {path}: {e.strerror}") from None
    return _checked(fd, str(path))


def open_subdir(parent_fd: int, name: str, where: str) -> int:
    """`name` inside the directory `parent_fd`, created when missing, with the same rules."""
    if "/" in name or name in ("", ".", ".."):
        raise UnsafeDirectory(f"{name!r} is not a directory name")
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, DIR_MODE, dir_fd=parent_fd)
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:  # ELOOP: a symlink; ENOTDIR: something else
        raise UnsafeDirectory(f"{where} is not a directory the sidecar may use: {e.strerror}") from None
    return _checked(fd, where)


@contextlib.contextmanager
def opened(diag_dir: Path | str, *names: str) -> Iterator[int]:
    """A descriptor of `<diag_dir>/<names...>`, each level checked; closed on exit."""
    fds = [open_root(diag_dir)]
    try:
        where = Path(diag_dir)
        for name in names:
            where = where / name
            fds.append(open_subdir(fds[-1], name, str(where)))
        yield fds[-1]
    finally:
        for fd in fds:
            os.close(fd)


def write_atomic(dir_fd: int, name: str, data: bytes, mode: int, gid: int | None = None) -> None:
    """Replace `name` in the directory with `data`: written to a fresh temporary file
    (O_EXCL|O_NOFOLLOW, unpredictable name, `mode`), then renamed over `name`. A reader sees
    the old file or the new one; a symlink planted under either name is replaced, never
    followed."""
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have taken bits away
            if gid is not None:
                os.fchown(fd, -1, gid)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
