"""The host-memory protocol of snapshots; knows files, not tensors.

Each rank keeps the state it needs to resume (model, optimizer, scheduler, RNG, data position,
step) as a file in shared memory, `checkpoint.memory_dir` (tmpfs, /dev/shm by default). Such a
file survives the process being killed (a hang the sidecar ends, a crash) but not the node
rebooting; the background copy to `checkpoint.dir` (checkpoint_store.py) covers that. Why files
in tmpfs and not torch's shared-memory tensors (`share_memory_()`): those are freed with the last
process that maps them, so they would need a helper process outliving the rank; a named file is
found again by the restarted rank alone, is replaced atomically by a rename, and an operator
sees it with `ls` and removes it with `rm`.

Layout, under a directory of the user's own with an unguessable name:

    <memory_dir>/sidecar-trainer-<uid>.<random>/ mode 0700, this user's, never a symlink
        <job>/                                   a hash of the run id and checkpoint.dir
            owner.json                           the process that restarts the ranks (torchrun's agent)
            rank-<R>.step-<N>.pt                 the payload
            rank-<R>.step-<N>.json               its seal: size, sha256 and what the payload is

`memory_dir` (/dev/shm) is shared by every local user, so no name in it may be one that another
user could take first: a fixed `sidecar-trainer-<uid>` created by someone else used to turn the
user's snapshots off (issue 28, row 12). The user's directory is found again not by its name but
by what nobody else can forge: every `sidecar-trainer-<uid>.*` entry that is a real directory
(opened with O_NOFOLLOW, then fstat) owned by this user with mode 0700; one of another user, a
symlink or a file under such a name is passed over, never written into. None found: one is
created, `mkdir` of a random name (mode 0700, O_EXCL by nature). `memory_dir` itself must be
root's or the user's, and sticky if others may write it (as /dev/shm is), so that nobody can
rename the user's directory away. On a node the local rank 0 opens first (checkpoint.py), the
other ranks then find its directory; should several exist anyway (two torchrun agents of one user
starting at once), each rank keeps using the one that holds its own snapshots of the job.

A snapshot counts only when its seal exists and the payload has the seal's size and sha256: the
payload is written as `rank-<R>.pt.tmp` and renamed, then the seal likewise, so a rank killed
half-way leaves debris that `steps` ignores and the next write removes. A write that fails
(a full tmpfs: ENOSPC from a write, or torch.save's RuntimeError after a short one) removes what
it wrote of its step, the partial payload included, before it raises: the space goes back at
once, and the rank's previous snapshot, sealed and intact, is what is left (issue 28, row 4;
checkpoint.py skips the snapshot and trains on).

Size: before it writes a new snapshot a rank deletes all of its own but the newest, so it holds
at most two: the newest complete one and the one being written (or, once that is sealed, the two
newest). Two are needed: a rank stopped between its gradient all-reduce and the seal of that
step's snapshot is one snapshot behind its peers, and the job resumes from the newest step every
rank still holds. One snapshot is the rank's model and optimizer state (its shard under FSDP;
DDP's full replica on every rank) plus a few kilobytes. When the job finishes the ranks remove
their files; a job that failed for good leaves them until the next job of the same user on the
node starts and finds the job's owner process gone (in the fixed-name directory of versions
before issue 28 too, when it is the user's own).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from sidecar_trainer.checkpoint_store import digest_file, write_file, write_stream

log = logging.getLogger("sidecar_trainer")

OWNER = "owner.json"
PREFIX = "sidecar-trainer-"
_SEAL = re.compile(r"^rank-(\d+)\.step-(\d+)\.json$")


def job_key(run_id: str, checkpoint_dir: str) -> str:
    """The job's directory name: the same for every attempt of one torchrun run writing one
    checkpoint directory (`--standalone` draws a fresh run id per torchrun invocation)."""
    return hashlib.sha256(f"{run_id}\0{os.path.abspath(checkpoint_dir)}".encode()).hexdigest()[:16]


def private_dir(path: Path) -> str | None:
    """Why `path` is not a directory that only this user may use, or None. It is opened with
    O_NOFOLLOW and judged by fstat of what was opened: a symlink is refused, never followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"{path} is a symlink"
        if e.errno == errno.ENOTDIR:
            return f"{path} is not a directory"
        return f"cannot open {path}: {e.strerror}"
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return f"{path} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o} (want this user's, 0700)"
    return None


def shared_dir_problem(path: Path) -> str | None:
    """Why `path` (memory_dir) cannot hold this user's private directory, or None. It must be
    root's or this user's, and sticky when others may write it (/dev/shm: root's, 1777); otherwise
    another user could rename the user's directory away and put one of theirs in its place."""
    try:
        st = os.stat(path)  # the configured directory itself may be a symlink (/dev/shm -> /run/shm)
    except OSError as e:
        return f"cannot use {path}: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid not in (0, os.geteuid()):
        return f"{path} is owned by uid {st.st_uid} (want root's or this user's)"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"{path} has mode {stat.S_IMODE(st.st_mode):o}: others may write it and it is not sticky"
    return None


def user_dirs(memory_dir: Path) -> list[Path]:
    """This user's directories in `memory_dir`: every `sidecar-trainer-<uid>.<16 hex digits>` that
    is a real directory of this user's with mode 0700. An entry of another user's under such a
    name, a symlink or a file, is passed over: nobody else can make a directory this user owns."""
    uid = os.geteuid()
    pattern = re.compile(rf"^{PREFIX}{uid}\.[0-9a-f]{{16}}$")
    found = []
    with os.scandir(memory_dir) as entries:
        for entry in entries:
            if not pattern.match(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and private_dir(Path(entry.path)) is None:
                found.append(Path(entry.path))
    return sorted(found)


def make_user_dir(memory_dir: Path) -> Path:
    """A new directory of this user's in `memory_dir` under a random name, mode 0700."""
    for _ in range(8):
        path = memory_dir / f"{PREFIX}{os.geteuid()}.{secrets.token_hex(8)}"
        try:
            os.mkdir(path, 0o700)  # fails on any existing entry, a symlink included
        except FileExistsError:
            continue
        os.chmod(path, 0o700)  # what the umask took away: a directory only we can have made, in a sticky one
        return path
    raise FileExistsError(errno.EEXIST, "no free name", str(memory_dir))


def _choose(dirs: list[Path], key: str, rank: int) -> Path | None:
    """Of this user's directories, the one holding this rank's snapshots of job `key`, else one
    holding the job, else the first by name; None when there is none."""

    def order(user_dir: Path) -> tuple[bool, bool, str]:
        job = user_dir / key
        has_job = job.is_dir() and not job.is_symlink()
        mine = has_job and any(job.glob(f"rank-{rank}.step-*.json"))
        return (not mine, not has_job, user_dir.name)

    return min(dirs, key=order, default=None)


def process_identity(pid: int, proc: str = "/proc") -> int | None:
    """The start time (clock ticks after boot) of process `pid`: with the pid it names the
    process for good (a reused pid has another start time). None when it does not exist."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(owner: dict) -> bool:
    pid, start = owner.get("pid"), owner.get("start")
    return isinstance(pid, int) and pid > 0 and process_identity(pid) == start


class SnapshotStore:
    """One rank's snapshots of one job."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.dir, self.rank = directory, rank

    @classmethod
    def open(cls, memory_dir: str, key: str, rank: int) -> SnapshotStore | None:
        """The store of job `key` for `rank`, its directories found or created; None (with a
        warning) when `memory_dir` cannot hold private files of this user or has no room for a
        directory. Removes the directories of this user's other jobs whose owner process is gone."""
        shared = Path(memory_dir)
        try:
            shared.mkdir(parents=True, exist_ok=True)
            problem = shared_dir_problem(shared)
            if problem:
                log.warning("memory snapshots off: %s", problem)
                return None
            mine = user_dirs(shared)
            user_dir = _choose(mine, key, rank) or make_user_dir(shared)
            with contextlib.suppress(FileExistsError):
                os.mkdir(user_dir / key, 0o700)
            problem = private_dir(user_dir) or private_dir(user_dir / key)
            if problem:
                log.warning("memory snapshots off: %s", problem)
                return None
            legacy = shared / f"{PREFIX}{os.geteuid()}"  # the fixed name before issue 28, if it is ours
            for swept in [*mine, *([legacy] if private_dir(legacy) is None else [])]:
                collect_garbage(swept, keep=key)
        except OSError as e:  # no room for a directory, one removed under us
            log.warning("memory snapshots off: cannot use %s: %s", memory_dir, e.strerror or e)
            return None
        store = cls(user_dir / key, rank)
        store.claim(os.getppid())
        return store

    def claim(self, owner_pid: int) -> None:
        """Name the process whose life bounds the job's snapshots on this node (torchrun's agent,
        the parent of every attempt's ranks). Where that fails (a full tmpfs) the job stays unnamed,
        and no later job collects its directory."""
        body = json.dumps({"pid": owner_pid, "start": process_identity(owner_pid)}).encode()
        tmp = self.dir / f"{OWNER}.{self.rank}.tmp"
        try:
            write_file(tmp, body)
            os.rename(tmp, self.dir / OWNER)
        except OSError as e:
            _unlink(tmp)
            log.warning("memory snapshots: cannot name the job's owner in %s: %s", self.dir, e.strerror or e)

    def _payload(self, step: int) -> Path:
        return self.dir / f"rank-{self.rank}.step-{step}.pt"

    def _seal(self, step: int) -> Path:
        return self.dir / f"rank-{self.rank}.step-{step}.json"

    # ------------------------------------------------------------ writing

    def write(self, step: int, produce: Callable[[BinaryIO], object], meta: dict) -> None:
        """Make step N this rank's newest snapshot with what `produce(file)` writes; keeps the
        previous newest one, deletes every older one and any debris first. Whatever fails (a full
        tmpfs, `produce` itself) removes all it wrote of step N before the error goes on."""
        newest = self.steps()[:1]
        for path in self.dir.glob(f"rank-{self.rank}.*"):
            m = re.match(rf"^rank-{self.rank}\.step-(\d+)\.(pt|json)$", path.name)
            if m is None or int(m[1]) not in newest:
                _unlink(path)
        tmp, seal_tmp = self.dir / f"rank-{self.rank}.pt.tmp", self.dir / f"rank-{self.rank}.json.tmp"
        try:
            digest = write_stream(tmp, produce)
            os.rename(tmp, self._payload(step))
            seal = {"step": step, "rank": self.rank, "size": digest.size, "sha256": digest.sha256, "meta": meta}
            write_file(seal_tmp, json.dumps(seal, sort_keys=True).encode())
            os.rename(seal_tmp, self._seal(step))
        except BaseException:
            # Neither the partial payload, nor a payload without its seal, nor an older seal of the
            # same step (whose payload was just replaced) is left behind.
            for path in (tmp, seal_tmp, self._payload(step), self._seal(step)):
                with contextlib.suppress(OSError):
                    _unlink(path)
            raise

    def remove(self) -> None:
        """Delete this rank's files, and the job's directory once no rank has any left."""
        for path in self.dir.glob(f"rank-{self.rank}.*"):
            _unlink(path)
        if not any(p.name.startswith("rank-") for p in self.dir.iterdir()):
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------ reading

    def steps(self) -> list[int]:
        """Steps of this rank's sealed snapshots, newest first (the payloads are not read)."""
        out = []
        for path in self.dir.glob(f"rank-{self.rank}.step-*.json"):
            m = _SEAL.match(path.name)
            if m and int(m[1]) == self.rank:
                out.append(int(m[2]))
        return sorted(out, reverse=True)

    def seal(self, step: int) -> dict | None:
        try:
            seal = json.loads(self._seal(step).read_bytes())
        except (OSError, ValueError):
            return None
        return seal if isinstance(seal, dict) else None

    def check(self, step: int) -> str | None:
        """Why step N's snapshot cannot be used, or None: sealed, and the payload is what the seal says."""
        seal = self.seal(step)
        if seal is None or seal.get("step") != step or seal.get("rank") != self.rank:
            return "no readable seal"
        try:
            got = digest_file(self._payload(step))
        except OSError as e:
            return f"payload unreadable ({e.strerror})"
        if got.size != seal.get("size"):
            return f"payload has {got.size} bytes, the seal says {seal.get('size')}"
        if got.sha256 != seal.get("sha256"):
            return "payload checksum mismatch"
        return None

    def payload(self, step: int) -> Path:
        return self._payload(step)


def collect_garbage(user_dir: Path, keep: str) -> list[Path]:
    """Remove the job directories in `user_dir` (but `keep`) whose owner process has exited."""
    removed = []
    for entry in user_dir.iterdir():
        if entry.name == keep or not entry.is_dir() or entry.is_symlink():
            continue
        try:
            owner = json.loads((entry / OWNER).read_bytes())
        except (OSError, ValueError):
            continue  # being created right now, or not ours to judge
        if isinstance(owner, dict) and not _alive(owner):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    if removed:
        log.info("memory snapshots: removed %d left by finished jobs", len(removed))
    return removed


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
