"""The on-disk protocol of checkpoints; knows files, not tensors.

A checkpoint of step N is the directory `step-N/`. It is built as `step-N.tmp/`: every rank
writes and fsyncs its own files there, rank 0 then writes `manifest.json` (each file's size and
sha256) and `COMMIT` (the manifest's sha256), fsyncs, renames the directory to `step-N` and
fsyncs the parent. A crash at any point leaves either the complete `step-N/` or debris that
`scan` reports and `latest_complete` skips; older complete checkpoints are only pruned after a
newer one is committed, so the newest complete one is never lost.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("sidecar_trainer")

MANIFEST = "manifest.json"
COMMIT = "COMMIT"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-(\d+)\.tmp$")


@dataclass(frozen=True)
class FileDigest:
    size: int
    sha256: str


@dataclass(frozen=True)
class Candidate:
    step: int
    path: Path
    problem: str | None  # None: complete and intact


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _DigestingWriter:
    """A write-only file object that hashes and counts what passes through it, so a checkpoint file
    is checksummed while torch.save streams it out (never held in memory twice)."""

    def __init__(self, f: BinaryIO, interrupt: Callable[[], None] | None) -> None:
        self.f, self.interrupt = f, interrupt
        self.sha, self.size = hashlib.sha256(), 0

    def write(self, data) -> int:
        n = self.f.write(data)
        self.sha.update(data)
        self.size += len(data)
        if self.interrupt:  # fault injection: part of the file is on disk, the rest never will be
            self.f.flush()
            os.fsync(self.f.fileno())
            self.interrupt()
        return n

    def flush(self) -> None:
        self.f.flush()


def write_stream(
    path: Path, produce: Callable[[BinaryIO], object], interrupt: Callable[[], None] | None = None
) -> FileDigest:
    """Create `path` with what `produce(file)` writes, fsync it, and return its digest.
    `interrupt` (fault injection) runs after the first chunk reaches the disk."""
    with open(path, "wb") as f:
        out = _DigestingWriter(f, interrupt)
        produce(out)  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
    return FileDigest(out.size, out.sha.hexdigest())


def write_file(path: Path, data: bytes, interrupt: Callable[[], None] | None = None) -> FileDigest:
    return write_stream(path, lambda f: f.write(data), interrupt)


def digest_file(path: Path) -> FileDigest:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return FileDigest(size, h.hexdigest())


class CheckpointStore:
    def __init__(self, root: str | Path, keep_last: int) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def temp_for(self, step: int) -> Path:
        return self.root / f"step-{step}.tmp"

    # ------------------------------------------------------------ writing (rank 0 unless noted)

    def begin(self, step: int) -> Path:
        """Fresh, empty temp directory for step N (debris of an earlier attempt is removed)."""
        tmp = self.temp_for(step)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _fsync_dir(self.root)
        return tmp

    def commit(self, step: int, files: dict[str, FileDigest], meta: dict | None = None) -> Path:
        """Seal step N's temp directory: manifest, commit marker, atomic rename, fsyncs."""
        tmp, final = self.temp_for(step), self.path_for(step)
        manifest = {
            "step": step,
            "time": time.time(),
            "meta": meta or {},
            "files": {name: {"size": d.size, "sha256": d.sha256} for name, d in sorted(files.items())},
        }
        body = json.dumps(manifest, indent=1, sort_keys=True).encode()
        write_file(tmp / MANIFEST, body)
        write_file(tmp / COMMIT, hashlib.sha256(body).hexdigest().encode())
        for directory in [*(d for d in tmp.rglob("*") if d.is_dir()), tmp]:  # the files' names are durable too
            _fsync_dir(directory)
        if final.exists():  # a corrupt or stale step-N from an earlier attempt: the new one replaces it
            log.warning("checkpoint: replacing existing %s", final)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        return final

    def prune(self, newest: int) -> list[Path]:
        """After step `newest` was committed: keep it and the keep_last-1 committed checkpoints before
        it, delete older committed ones and older debris. Directories of later steps (left by a
        timeline that resumed from an earlier checkpoint) stay until this run replaces them."""
        older = [c for c in self.scan(verify=False) if c.step < newest]
        committed = [c for c in older if c.problem is None]
        doomed = [c.path for c in committed[self.keep_last - 1 :]]
        doomed += [c.path for c in older if c.problem is not None]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        return doomed

    # ------------------------------------------------------------ reading

    def manifest(self, path: Path) -> dict:
        return json.loads((path / MANIFEST).read_bytes())

    def check(self, path: Path, verify: bool = True) -> str | None:
        """Why `path` is not a usable checkpoint, or None. verify=False trusts the files' checksums."""
        try:
            body = (path / MANIFEST).read_bytes()
        except OSError:
            return "incomplete: no manifest.json"
        try:
            marker = (path / COMMIT).read_text().strip()
        except OSError:
            return "incomplete: no COMMIT marker"
        if marker != hashlib.sha256(body).hexdigest():
            return "corrupt: COMMIT does not match manifest.json"
        try:
            files = json.loads(body)["files"]
        except (ValueError, KeyError, TypeError):
            return "corrupt: manifest.json unreadable"
        for name, want in files.items():
            target = path / name
            if not target.is_file():
                return f"corrupt: {name} missing"
            if target.stat().st_size != want["size"]:
                return f"corrupt: {name} has {target.stat().st_size} bytes, manifest says {want['size']}"
            if verify:
                try:
                    got = digest_file(target)
                except OSError as e:
                    return f"corrupt: {name} unreadable ({e.strerror})"
                if got.sha256 != want["sha256"]:
                    return f"corrupt: {name} checksum mismatch"
        return None

    def scan(self, verify: bool = True) -> list[Candidate]:
        """Every step directory (and leftover temp directory), newest first, with its problem if any."""
        out: list[Candidate] = []
        try:
            entries = list(self.root.iterdir())
        except FileNotFoundError:
            return []
        for entry in entries:
            if m := _STEP_DIR.match(entry.name):
                problem = self.check(entry, verify) if entry.is_dir() else "not a directory"
                out.append(Candidate(int(m[1]), entry, problem))
            elif m := _TMP_DIR.match(entry.name):
                out.append(Candidate(int(m[1]), entry, "incomplete: never committed (writer died)"))
        return sorted(out, key=lambda c: (c.step, c.problem is None), reverse=True)

    def latest_complete(self) -> Candidate | None:
        """Newest intact checkpoint (checksums verified); every newer unusable one is skipped with a
        warning naming why."""
        for cand in self.scan(verify=False):
            problem = cand.problem or self.check(cand.path, verify=True)
            if problem is None:
                return cand
            log.warning("checkpoint: skipping %s (%s)", cand.path, problem)
        return None
