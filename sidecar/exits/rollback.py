"""The rollback hint of an exit incident: when a rank's loss went non-finite, the checkpoint to
resume from (the newest one saved before it that bad weights cannot have reached)."""

from __future__ import annotations

from typing import Any

from sidecar.ranks.model import Rank
from sidecar.safetext import printable


class RollbackMemory:
    """Per job, across restarts: the checkpoints its ranks saved and where their loss first went
    non-finite. A restarted worker group resumes from its newest checkpoint, which may have been
    saved after the loss went bad; the hint must name one from before."""

    MAX_JOBS = 64  # jobs remembered; the least recently used is forgotten beyond

    def __init__(self) -> None:
        self._jobs: dict[str, dict[str, Any]] = {}

    def learn(self, rank: Rank) -> None:
        job = self._jobs.pop(rank.job_id, None) or {"checkpoints": {}, "onsets": set()}
        self._jobs[rank.job_id] = job  # most recently used last
        for step, path, when in rank.checkpoints:
            job["checkpoints"][(step, path)] = min(when, job["checkpoints"].get((step, path), when))
        if rank.first_nonfinite_loss is not None:
            job["onsets"].add(rank.first_nonfinite_loss)
        for key in sorted(job["checkpoints"], key=lambda k: job["checkpoints"][k])[:-32]:
            del job["checkpoints"][key]
        if len(job["onsets"]) > 16:
            job["onsets"] = set(sorted(job["onsets"], key=lambda o: o[1])[-16:])
        while len(self._jobs) > self.MAX_JOBS:
            del self._jobs[next(iter(self._jobs))]

    def hint(self, rank: Rank) -> dict[str, Any] | None:
        """When the rank's loss went non-finite: the newest checkpoint saved before it that no
        earlier non-finite loss of the job can have poisoned (one saved, at or past that
        loss's step, after it)."""
        self.learn(rank)
        if rank.first_nonfinite_loss is None:
            return None
        job = self._jobs[rank.job_id]
        bad_step = rank.first_nonfinite_loss[0]
        onsets = job["onsets"]
        good = [
            (step, path)
            for (step, path), when in job["checkpoints"].items()
            if step < bad_step and not any(o_step <= step and o_time <= when for o_step, o_time in onsets)
        ]
        hint: dict[str, Any] = {"first_nonfinite_loss_step": min([bad_step] + [s for s, _ in onsets])}
        if good:
            step, path = max(good, key=lambda c: c[0])
            # The rank's text, shown to people (never opened): no control characters in a terminal.
            hint.update(checkpoint_step=step, checkpoint_path=None if path is None else printable(path))
        return hint
