"""Whose job_id it is: the uid of the job's live ranks, and for `limits.job_reservation_seconds`
after the last of them went, still that uid (a reservation).

A job_id belongs to the uid that registered it first. Without reservations it fell free the
moment the job had no live rank, which happens in every normal life: between two torchrun
restart attempts (the failed group is gone, the next not yet registered), and right after a
sidecar restart (nothing is registered until the hooks register again). Another user polling
`/v1/status` could take the job_id in that gap and lock the real job out of its own watchdog
(`403 job_owned` on every registration: its next hang never remediated). So when a job's last
live rank goes, its owner keeps the job_id for the reservation time: its own ranks may
register again, nobody else may.

A sidecar restart keeps no memory of its own, so the owners are written to the diagnostics
directory (`OWNERS_FILE`, root-only, rewritten atomically while they change) and read back at
start: every job recorded there is reserved for its recorded owner for the reservation time
from the start, long enough for its ranks (whose hooks re-register at once) to claim it again.

Bounds: live jobs are bounded by the registry's quotas; reservations per uid by
`limits.max_jobs_per_user` (root, and the unverified callers' bucket: `limits.max_jobs`), the
owner's oldest going first. A reservation gives its owner nothing another user needs: it holds
a job_id the owner could as well have held with a live rank.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sidecar.host import diagfiles

log = logging.getLogger(__name__)

OWNERS_FILE = ".job-owners.json"  # in the diag dir; a dot name, so never a job's directory
MAX_OWNERS_FILE_BYTES = 1 << 20
ROOT_UID = 0


@dataclass
class Ownership:
    uid: int | None  # None: registered by an unverified TCP caller
    until: float | None  # wall clock time the reservation ends; None while the job has live ranks


class JobOwners:
    """The owner of every job_id that has live ranks or a reservation."""

    def __init__(
        self,
        reservation_seconds: float,
        per_user: int,
        node: int,
        clock: Callable[[], float] = time.time,
    ):
        self.seconds, self.per_user, self.node, self.clock = reservation_seconds, per_user, node, clock
        self._jobs: dict[str, Ownership] = {}  # oldest change first
        self.changed = False  # since the last `snapshot`

    def owner(self, job_id: str) -> Ownership | None:
        """The job's owner while it has live ranks or is reserved; None when it is free."""
        entry = self._jobs.get(job_id)
        if entry is not None and entry.until is not None and entry.until <= self.clock():
            del self._jobs[job_id]
            self.changed = True
            return None
        return entry

    def claimed(self, job_id: str, uid: int | None) -> None:
        """A rank of the job registered as `uid` (admission allowed it): the job is live."""
        entry = self._jobs.get(job_id)
        if entry is None or entry.uid != uid or entry.until is not None:
            self._jobs.pop(job_id, None)
            self._jobs[job_id] = Ownership(uid, None)
            self.changed = True

    def released(self, job_id: str, uid: int | None) -> None:
        """The job's last live rank went: reserve the job_id for its owner."""
        self._jobs.pop(job_id, None)
        self.changed = True
        if self.seconds <= 0:
            return
        self._jobs[job_id] = Ownership(uid, self.clock() + self.seconds)
        limit = self.node if uid in (ROOT_UID, None) else self.per_user
        reserved = [job for job, o in self._jobs.items() if o.uid == uid and o.until is not None]
        for job in reserved[: max(0, len(reserved) - limit)]:
            del self._jobs[job]  # the owner's oldest reservations

    def expire(self) -> None:
        now = self.clock()
        for job in [job for job, o in self._jobs.items() if o.until is not None and o.until <= now]:
            del self._jobs[job]
            self.changed = True

    def reservations(self) -> dict[str, Ownership]:
        return {job: o for job, o in self._jobs.items() if o.until is not None and o.until > self.clock()}

    # ------------------------------------------------------------ across a sidecar restart

    def snapshot(self) -> bytes:
        """The owners as the file keeps them (resets `changed`)."""
        self.changed = False
        jobs = {job: {"uid": o.uid, "until": o.until} for job, o in self._jobs.items()}
        return (json.dumps({"version": 1, "saved": self.clock(), "jobs": jobs}) + "\n").encode()

    def restore(self, document: bytes) -> int:
        """Reserve every job of a snapshot for its owner for the reservation time from now (the
        job was live or reserved when the previous sidecar stopped); returns how many."""
        try:
            data = json.loads(document)
            jobs = data["jobs"] if isinstance(data, dict) else {}
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring %s: not a job owners record", OWNERS_FILE)
            return 0
        until = self.clock() + self.seconds
        restored = 0
        for job, entry in list(jobs.items() if isinstance(jobs, dict) else [])[: 4 * self.node]:
            uid = entry.get("uid") if isinstance(entry, dict) else None
            valid = isinstance(job, str) and (uid is None or type(uid) is int)
            if valid and job not in self._jobs and self.seconds > 0:
                self._jobs[job] = Ownership(uid, until)
                restored += 1
        self.changed = restored > 0
        return restored


def read_owners(diag_dir: Path | str) -> bytes | None:
    """The owners file the previous sidecar wrote, if it is the sidecar's own regular file."""
    try:
        with diagfiles.opened(diag_dir) as root_fd:
            fd = os.open(OWNERS_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=root_fd)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    return None
                return os.read(fd, MAX_OWNERS_FILE_BYTES)
            finally:
                os.close(fd)
    except OSError:
        return None


def write_owners(diag_dir: Path | str, document: bytes) -> None:
    """Replace the owners file (mode 0600, written as every diag file is: diagfiles.py)."""
    try:
        with diagfiles.opened(diag_dir) as root_fd:
            diagfiles.write_atomic(root_fd, OWNERS_FILE, document, 0o600)
    except OSError as e:
        log.error("cannot write %s in %s: %s", OWNERS_FILE, diag_dir, e)
