"""Stack-dump files: the sidecar creates each rank's file; the rank only writes into it.

At registration the sidecar creates `<diag_dir>/<job>/rank<R>-pid<P>-<random>.stacks` itself
(O_CREAT|O_EXCL|O_NOFOLLOW, in a directory it owns and nobody else may write), gives it to the
rank's uid with mode 0600, and answers its path. The hooks open that path as the rank's own
user and point faulthandler at it. When the rank hangs, the sidecar reads what the dump
added through `StackFile`: opened with O_NOFOLLOW|O_NONBLOCK and checked to be the very
regular file it created (device and inode), read with pread up to a size cap.

So no path a rank names is ever opened with root's authority: not a symlink swapped at the
right moment, not a FIFO that blocks the opening thread, not `/proc/<pid>/environ`. The rank
cannot replace the file (the directory is not writable by it) and cannot make it anything
but a regular file; it can only write into it, which is all it could do before. The field
`stack_dump.path` of a register request is ignored (docs/architecture.md).

Why not a descriptor passed over the socket (SCM_RIGHTS): the push API is HTTP through
aiohttp, which neither exposes ancillary data nor lets a handler receive it, and the hooks
also speak TCP, where there is none. Why not keep the descriptor open: thousands of ranks
would hold thousands of descriptors; reopening in a directory nobody else can write, with
the inode checked, is as safe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sidecar.host import diagfiles

log = logging.getLogger(__name__)

MAX_STACK_BYTES = 256 * 1024  # read at most this much of what a dump added to its file
PRUNE_AFTER_SECONDS = 60.0  # an empty file no rank holds is removed after this long
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


@dataclass(frozen=True)
class StackFile:
    """A dump file the sidecar created: its path and the identity of the file there."""

    path: str
    dev: int
    ino: int

    @classmethod
    def existing(cls, path: str | Path) -> StackFile:
        """A file already there (tests, and files a process of the operator's own prepared)."""
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        return cls(str(path), st.st_dev, st.st_ino)

    def _open(self) -> int | None:
        try:
            fd = os.open(self.path, _READ_FLAGS)
        except OSError:
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (self.dev, self.ino):
            os.close(fd)
            return None
        return fd

    def size(self) -> int:
        fd = self._open()
        if fd is None:
            return 0
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def read_from(self, offset: int, limit: int = MAX_STACK_BYTES) -> str:
        """What the file holds from `offset` on, at most `limit` bytes; "" when it is gone."""
        fd = self._open()
        if fd is None:
            return ""
        try:
            return os.pread(fd, limit, offset).decode(errors="replace")
        except OSError:
            return ""
        finally:
            os.close(fd)


def owner_uid(pid: int, procfs: str = "/proc") -> int | None:
    """The filesystem uid of a process (the uid its opens run with), or None when it is not
    visible."""
    try:
        with open(f"{procfs}/{int(pid)}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[4])
    except (OSError, ValueError, IndexError):
        pass
    return None


def create(diag_dir: Path | str, job_id: str, rank: int, pid: int, uid: int) -> StackFile:
    """A new, empty dump file for one rank, owned by `uid`, mode 0600. Raises OSError."""
    name = f"rank{rank}-pid{pid}-{secrets.token_hex(4)}.stacks"
    job_dir = diagfiles.job_dir_name(job_id)
    with diagfiles.opened(diag_dir, job_dir) as dir_fd:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            if uid != os.geteuid():
                os.fchown(fd, uid, -1)
            os.fchmod(fd, 0o600)
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            raise
        os.close(fd)
    return StackFile(str(Path(diag_dir) / job_dir / name), st.st_dev, st.st_ino)


def prune(diag_dir: Path | str, keep: Iterable[str], now: float | None = None) -> int:
    """Remove the empty dump files that no registered rank holds any more (older than
    PRUNE_AFTER_SECONDS), and job directories left empty. Dumps with content stay: incidents
    name them. Returns how many files went."""
    keep = set(keep)
    now = time.time() if now is None else now
    root = Path(diag_dir)
    removed = 0
    try:
        root_fd = diagfiles.open_root(root)
    except OSError:
        return 0
    try:
        for job in os.listdir(root_fd):
            if job in diagfiles.RESERVED_NAMES or job.startswith("."):
                continue
            try:
                job_fd = os.open(job, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
            except OSError:
                continue
            quiet = False
            try:
                names = os.listdir(job_fd)
                for name in names:
                    if not name.endswith(".stacks") or str(root / job / name) in keep:
                        continue
                    with contextlib.suppress(OSError):
                        st = os.stat(name, dir_fd=job_fd, follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode) and st.st_size == 0 and now - st.st_mtime > PRUNE_AFTER_SECONDS:
                            os.unlink(name, dir_fd=job_fd)
                            removed += 1
                quiet = now - os.fstat(job_fd).st_mtime > PRUNE_AFTER_SECONDS  # no file came or went lately
            finally:
                os.close(job_fd)
            if quiet:
                with contextlib.suppress(OSError):  # only succeeds when empty
                    os.rmdir(job, dir_fd=root_fd)
    finally:
        os.close(root_fd)
    return removed
