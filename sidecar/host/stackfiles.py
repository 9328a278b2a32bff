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
`stack_dump.path` of a register request is ignored (docs/architecture/wire-protocol.md).

Bounds (a rank may register again and again, and writes into its file what it likes):
`DumpFiles` counts the files it creates per owner uid, at most limits.max_ranks_per_user +
KEPT_PER_UID of one uid (root: only the node's 2 x limits.max_ranks); past a bound the owner's
oldest file that no live rank holds is removed first (at the node's, that of the uid with the
most), never one a live rank holds, never another user's for a uid's own excess. The retention
sweep (`prune`) removes what no live rank holds: empty files after a minute, and of the files
with content all but each uid's newest KEPT_PER_UID (the incidents quote each dump's first
lines, the file keeps the rest a while); and any file past MAX_DUMP_FILE_BYTES, four times what
is ever read of it, is removed, or emptied if a live rank holds it.

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
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from sidecar.host import diagfiles

log = logging.getLogger(__name__)

MAX_STACK_BYTES = 256 * 1024  # read at most this much of what a dump added to its file
MAX_DUMP_FILE_BYTES = 4 * MAX_STACK_BYTES  # a file beyond is removed, or emptied while a live rank holds it
PRUNE_AFTER_SECONDS = 60.0  # an empty file no rank holds is removed after this long
KEPT_PER_UID = 16  # files with content no live rank holds, kept per uid (the newest)
ROOT_UID = 0
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


class DumpFiles:
    """The dump files this sidecar created, per owner uid, oldest first, within bounds: `per_uid`
    files of one uid (root: none but the node's) and `node` in all. `held()` names the files live
    ranks hold: those are never removed to make room."""

    def __init__(self, diag_dir: Path | str, per_uid: int, node: int):
        self.diag_dir, self.per_uid, self.node = Path(diag_dir), per_uid, node
        self._files: dict[str, tuple[StackFile, int]] = {}  # path -> (file, uid), oldest first
        self._count: Counter = Counter()  # uid -> files
        self.removed = 0  # files removed to stay within the bounds

    def create(self, job_id: str, rank: int, pid: int, uid: int, held: Callable[[], set[str]]) -> StackFile:
        """A new file (`create`) for a rank of `uid`, after making room. Raises OSError."""
        if (uid != ROOT_UID and self._count[uid] >= self.per_uid) or len(self._files) >= self.node:
            keep = held()
            if uid != ROOT_UID and self._count[uid] >= self.per_uid:
                self._remove_oldest(uid, keep)
            if len(self._files) >= self.node:
                self._remove_oldest(max(self._count, key=lambda u: self._count[u]), keep)
        made = create(self.diag_dir, job_id, rank, pid, uid)
        self._files[made.path] = (made, uid)
        self._count[uid] += 1
        return made

    def _remove_oldest(self, uid: int, keep: set[str]) -> None:
        path = next((p for p, (_, owner) in self._files.items() if owner == uid and p not in keep), None)
        if path is None:
            return
        made, _ = self._files.pop(path)
        self._count[uid] -= 1
        if self._count[uid] <= 0:
            del self._count[uid]
        self.removed += 1
        remove(made)

    def forget_missing(self) -> None:
        """Drop the files the sweep removed from the count."""
        for path in [p for p in self._files if not os.path.lexists(p)]:
            _, uid = self._files.pop(path)
            self._count[uid] -= 1
            if self._count[uid] <= 0:
                del self._count[uid]


def remove(made: StackFile) -> None:
    """Remove a file this sidecar created, if it is still that file (same device and inode)."""
    path = Path(made.path)
    with contextlib.suppress(OSError), diagfiles.opened(path.parent.parent, path.parent.name) as dir_fd:
        st = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == (made.dev, made.ino):
            os.unlink(path.name, dir_fd=dir_fd)


def prune(diag_dir: Path | str, keep: Iterable[str], now: float | None = None) -> int:
    """Remove the dump files no live rank holds (`keep`: the paths live ranks hold): empty ones
    older than PRUNE_AFTER_SECONDS, and of those with content all but each uid's newest
    KEPT_PER_UID; and any file past MAX_DUMP_FILE_BYTES (emptied while a live rank holds it).
    Job directories left empty go too. Returns how many files went."""
    keep = set(keep)
    now = time.time() if now is None else now
    root = Path(diag_dir)
    removed = 0
    kept: dict[int, list[tuple[float, str, str]]] = {}  # uid -> (mtime, job dir, name) of unheld files with content
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
                for name in os.listdir(job_fd):
                    if not name.endswith(".stacks"):
                        continue
                    held = str(root / job / name) in keep
                    with contextlib.suppress(OSError):
                        st = os.stat(name, dir_fd=job_fd, follow_symlinks=False)
                        if not stat.S_ISREG(st.st_mode):
                            continue
                        if st.st_size > MAX_DUMP_FILE_BYTES:
                            if held:
                                _empty(job_fd, name, st)
                                continue
                            os.unlink(name, dir_fd=job_fd)
                            removed += 1
                        elif held:
                            continue
                        elif st.st_size == 0:
                            if now - st.st_mtime > PRUNE_AFTER_SECONDS:
                                os.unlink(name, dir_fd=job_fd)
                                removed += 1
                        else:
                            kept.setdefault(st.st_uid, []).append((st.st_mtime, job, name))
                quiet = now - os.fstat(job_fd).st_mtime > PRUNE_AFTER_SECONDS  # no file came or went lately
            finally:
                os.close(job_fd)
            if quiet:
                with contextlib.suppress(OSError):  # only succeeds when empty
                    os.rmdir(job, dir_fd=root_fd)
        for files in kept.values():
            for _, job, name in sorted(files)[:-KEPT_PER_UID]:
                with contextlib.suppress(OSError):
                    job_fd = os.open(job, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
                    try:
                        os.unlink(name, dir_fd=job_fd)
                        removed += 1
                    finally:
                        os.close(job_fd)
    finally:
        os.close(root_fd)
    return removed


def _empty(dir_fd: int, name: str, listed: os.stat_result) -> None:
    """Truncate a held file that outgrew MAX_DUMP_FILE_BYTES (the rank appends; its next dump
    starts the file again), if it is still the file that was listed."""
    fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (listed.st_dev, listed.st_ino):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)
