"""The host-memory protocol of snapshots; knows files, not tensors.

Each rank keeps the state it needs to resume (model, optimizer, scheduler, RNG, data position,
step) as a file in shared memory, `checkpoint.memory_dir` (tmpfs, /dev/shm by default). Such a
file survives the process being killed (a hang the sidecar ends, a crash) but not the node
rebooting; the background copy to `checkpoint.dir` (checkpoint_store.py) covers that. Why files
in tmpfs and not torch's shared-memory tensors (`share_memory_()`): those are freed with the last
process that maps them, so they would need a helper process outliving the rank; a named file is
found again by the restarted rank alone, is replaced atomically by a rename, and an operator
sees it with `ls` and removes it with `rm`.

Layout, under the user's own directory (mode 0700, refused when someone else owns it):

    <memory_dir>/sidecar-trainer-<uid>/<job>/    <job>: a hash of the run id and checkpoint.dir
        owner.json                               the process that restarts the ranks (torchrun's agent)
        rank-<R>.step-<N>.pt                     the payload
        rank-<R>.step-<N>.json                   its seal: size, sha256 and what the payload is

A snapshot counts only when its seal exists and the payload has the seal's size and sha256: the
payload is written as `rank-<R>.pt.tmp` and renamed, then the seal likewise, so a rank killed
half-way leaves debris that `steps` ignores and the next write removes.

Size: before it writes a new snapshot a rank deletes all of its own but the newest, so it holds
at most two: the newest complete one and the one being written (or, once that is sealed, the two
newest). Two are needed: a rank stopped between its gradient all-reduce and the seal of that
step's snapshot is one snapshot behind its peers, and the job resumes from the newest step every
rank still holds. One snapshot is the rank's model and optimizer state (its shard under FSDP;
DDP's full replica on every rank) plus a few kilobytes. When the job finishes the ranks remove
their files; a job that failed for good leaves them until the next job of the same user on the
node starts and finds the job's owner process gone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from sidecar_trainer.checkpoint_store import digest_file, write_file, write_stream

log = logging.getLogger("sidecar_trainer")

OWNER = "owner.json"
_SEAL = re.compile(r"^rank-(\d+)\.step-(\d+)\.json$")


def job_key(run_id: str, checkpoint_dir: str) -> str:
    """The job's directory name: the same for every attempt of one torchrun run writing one
    checkpoint directory (`--standalone` draws a fresh run id per torchrun invocation)."""
    return hashlib.sha256(f"{run_id}\0{os.path.abspath(checkpoint_dir)}".encode()).hexdigest()[:16]


def private_dir(path: Path) -> str | None:
    """Create `path` (mode 0700) if needed; why it cannot hold this user's snapshots, or None."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        return f"cannot create {path}: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return f"{path} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o} (want this user's, 0700)"
    return None


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
        """The store of job `key` for `rank`, its directories created; None (with a warning) when
        `memory_dir` cannot hold private files of this user. Removes the directories of this
        user's other jobs whose owner process is gone."""
        user_dir = Path(memory_dir) / f"sidecar-trainer-{os.geteuid()}"
        try:
            Path(memory_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.warning("memory snapshots off: cannot create %s: %s", memory_dir, e.strerror)
            return None
        problem = private_dir(user_dir) or private_dir(user_dir / key)
        if problem:
            log.warning("memory snapshots off: %s", problem)
            return None
        collect_garbage(user_dir, keep=key)
        store = cls(user_dir / key, rank)
        store.claim(os.getppid())
        return store

    def claim(self, owner_pid: int) -> None:
        """Name the process whose life bounds the job's snapshots on this node (torchrun's agent,
        the parent of every attempt's ranks)."""
        body = json.dumps({"pid": owner_pid, "start": process_identity(owner_pid)}).encode()
        tmp = self.dir / f"{OWNER}.{self.rank}.tmp"
        write_file(tmp, body)
        os.rename(tmp, self.dir / OWNER)

    def _payload(self, step: int) -> Path:
        return self.dir / f"rank-{self.rank}.step-{step}.pt"

    def _seal(self, step: int) -> Path:
        return self.dir / f"rank-{self.rank}.step-{step}.json"

    # ------------------------------------------------------------ writing

    def write(self, step: int, produce: Callable[[BinaryIO], object], meta: dict) -> None:
        """Make step N this rank's newest snapshot with what `produce(file)` writes; keeps the
        previous newest one, deletes every older one and any debris first."""
        newest = self.steps()[:1]
        for path in self.dir.glob(f"rank-{self.rank}.*"):
            m = re.match(rf"^rank-{self.rank}\.step-(\d+)\.(pt|json)$", path.name)
            if m is None or int(m[1]) not in newest:
                _unlink(path)
        tmp = self.dir / f"rank-{self.rank}.pt.tmp"
        digest = write_stream(tmp, produce)
        os.rename(tmp, self._payload(step))
        seal = {"step": step, "rank": self.rank, "size": digest.size, "sha256": digest.sha256, "meta": meta}
        write_file(self.dir / f"rank-{self.rank}.json.tmp", json.dumps(seal, sort_keys=True).encode())
        os.rename(self.dir / f"rank-{self.rank}.json.tmp", self._seal(step))

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
