"""Who may register, and how much: the registry's rules.

One job_id belongs to one uid while it has live ranks; a rank held by another live process of
the same restart attempt is not taken over; node-wide ceilings bound everyone and per-user
quotas everyone but root, so one user cannot take the slots another user's job needs. The
rules read the registry through `RankTable`, a narrow read view (plus the one eviction it may
ask for); whether a process still runs is asked of `alive`, injected by whoever builds the
registry. The refusals are `sidecar/ranks/errors.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from sidecar.config import Settings
from sidecar.ranks.errors import JobOwned, LimitExceeded, RankTaken
from sidecar.ranks.model import Rank
from sidecar.ranks.ownership import Ownership
from sidecar.ranks.protocol import Registration
from trainer_hooks.wire import WELL_KNOWN_PHASES

ROOT_UID = 0


@dataclass
class JobNames:
    """The custom metric and phase names one job has used (beyond the well-known ones), under
    its owner: a job_id that passes to another uid starts with none (registry.py)."""

    owner_uid: int | None = None
    custom: set[str] = field(default_factory=set)
    phases: set[str] = field(default_factory=set)


class RankTable(Protocol):
    """What admission reads of the registry."""

    def get(self, job_id: str, rank: int) -> Rank | None: ...

    def ranks(self) -> list[Rank]: ...

    def job_ids(self) -> set[str]: ...

    def names(self, job_id: str) -> JobNames | None: ...

    def reservation(self, job_id: str) -> Ownership | None:
        """The job's owner while it is reserved (no live rank, within the reservation time)."""

    def evict_gone_job(self) -> None:
        """Drop the job whose ranks are all gone, oldest first (to make room for a new job)."""


class Admission:
    """The rules over the registry's ranks and per-job names, with `settings.limits`."""

    def __init__(
        self,
        settings: Settings,
        table: RankTable,
        alive: Callable[[int, float | None], bool],
        clock: Callable[[], float] = time.time,
    ):
        self.settings = settings
        self.table = table
        self.alive = alive
        self.clock = clock

    def job_owner(self, job_id: str) -> tuple[bool, int | None]:
        """(owned, uid): a job is owned while it has live ranks, by the uid they run as."""
        for r in self.table.ranks():
            if r.job_id == job_id and not r.gone:
                return True, r.owner_uid
        return False, None

    def check_registration(self, reg: Registration, host_pid: int, owner_uid: int | None) -> None:
        """Refuse a registration that breaks a rule. `host_pid`: the rank's pid here;
        `owner_uid`: the uid its process runs as, which must be the uid of the job's live ranks,
        or of its reservation (JobOwned otherwise). A phase it re-registers inside counts as a
        new phase name."""
        self._check_not_taken(reg, host_pid)
        owned, owner = self.job_owner(reg.job_id)
        if owned and owner != owner_uid:
            raise JobOwned(
                f"job_id: {reg.job_id!r} belongs to uid {uid_text(owner)} (its ranks run as it) until "
                f"they are gone; this registration is for uid {uid_text(owner_uid)}"
            )
        reserved = None if owned else self.table.reservation(reg.job_id)
        if reserved is not None and reserved.uid != owner_uid:
            left = max(0.0, (reserved.until or 0.0) - self.clock())
            raise JobOwned(
                f"job_id: {reg.job_id!r} is reserved for uid {uid_text(reserved.uid)}, whose ranks of it went "
                f"lately, for {left:.0f} s more (limits.job_reservation_seconds); this registration is for "
                f"uid {uid_text(owner_uid)}"
            )
        self._check_room(reg, owned, owner_uid)
        if reg.phase is not None and reg.phase not in WELL_KNOWN_PHASES:
            self.check_names(reg.job_id, owner_uid, {}, {reg.phase: None})

    def check_names(
        self,
        job_id: str,
        owner_uid: int | None,
        new_custom: Mapping[str, int | None],
        new_phases: Mapping[str, int | None],
    ) -> None:
        """New custom metric and phase names (name -> index of the first push item naming it,
        None at registration) against the job's limits and, but for root, its owner's."""
        known = self.table.names(job_id) or JobNames()
        fresh_custom = {n: i for n, i in new_custom.items() if n not in known.custom}
        fresh_phases = {n: i for n, i in new_phases.items() if n not in known.phases}
        limits = self.settings.limits
        for new, used, limit, per_user, kind in (
            (fresh_custom, known.custom, limits.max_custom_metrics, limits.max_custom_metrics_per_user, _CUSTOM),
            (fresh_phases, known.phases, limits.max_phases, limits.max_phases_per_user, _PHASES),
        ):
            if not new:
                continue
            if len(used) + len(new) > limit:
                name = list(new)[max(0, limit - len(used))]
                raise LimitExceeded(
                    f"{kind.where(new, name)}too many {kind.noun} in job {job_id} (at {name!r}): "
                    f"limits.{kind.setting} is {limit}"
                )
            if owner_uid != ROOT_UID and self._user_names(owner_uid, job_id, kind) + len(new) > per_user:
                name = next(iter(new))
                raise LimitExceeded(
                    f"{kind.where(new, name)}too many {kind.noun} for uid {uid_text(owner_uid)} "
                    f"(at {name!r}): limits.{kind.setting}_per_user is {per_user}"
                )

    def _check_not_taken(self, reg: Registration, host_pid: int) -> None:
        """A rank still held by another live process of the same attempt is a second job with the
        same job_id (torchrun's --rdzv-id) on this node. Replacing it back and forth would reset
        both ranks' stall timers on every push and mix their metrics, so the newcomer is refused.
        A restarted worker (a higher restart count) or a dead holder is replaced as usual."""
        held = self.table.get(reg.job_id, reg.rank)
        if (
            held is not None
            and not held.gone
            and held.pid != host_pid
            and reg.restart_count <= held.restart_count
            and self.alive(held.pid, held.pid_start_time)
        ):
            raise RankTaken(
                f"rank {held.label} is held by pid {held.pid}, still running at restart "
                f"{held.restart_count}: two jobs with job_id {reg.job_id!r} on this node? "
                "give each its own --rdzv-id"
            )

    def _check_room(self, reg: Registration, owned: bool, owner_uid: int | None) -> None:
        """Node-wide ceilings for everyone; per-user quotas for everyone but root, so one user
        cannot take the slots another user's job needs."""
        limits = self.settings.limits
        held = self.table.get(reg.job_id, reg.rank)
        new_rank = held is None or held.gone
        ranks = self.table.ranks()
        if held is None:
            job_ranks = sum(1 for r in ranks if r.job_id == reg.job_id)
            if job_ranks == 0 and len(self.table.job_ids()) >= limits.max_jobs:
                self.table.evict_gone_job()
                ranks = self.table.ranks()
                if len(self.table.job_ids()) >= limits.max_jobs:
                    raise LimitExceeded(f"too many jobs: limits.max_jobs is {limits.max_jobs}")
            if job_ranks >= limits.max_ranks_per_job:
                raise LimitExceeded(
                    f"too many ranks in job {reg.job_id}: limits.max_ranks_per_job is {limits.max_ranks_per_job}"
                )
        if new_rank and sum(1 for r in ranks if not r.gone) >= limits.max_ranks:
            raise LimitExceeded(f"too many ranks on this node: limits.max_ranks is {limits.max_ranks}")
        if owner_uid == ROOT_UID:
            return
        live = [r for r in ranks if not r.gone and r.owner_uid == owner_uid]
        if not owned and len({r.job_id for r in live}) >= limits.max_jobs_per_user:
            raise LimitExceeded(
                f"too many jobs of uid {uid_text(owner_uid)}: limits.max_jobs_per_user is {limits.max_jobs_per_user}"
            )
        if new_rank and len(live) >= limits.max_ranks_per_user:
            raise LimitExceeded(
                f"too many ranks of uid {uid_text(owner_uid)}: limits.max_ranks_per_user is {limits.max_ranks_per_user}"
            )

    def _user_names(self, owner_uid: int | None, job_id: str, kind: _NameKind) -> int:
        """How many names of `kind` the jobs of `owner_uid` (and `job_id`) have used."""
        jobs = {r.job_id for r in self.table.ranks() if r.owner_uid == owner_uid} | {job_id}
        return sum(len(kind.of(names)) for job in jobs if (names := self.table.names(job)) is not None)


@dataclass(frozen=True)
class _NameKind:
    """Custom metric names or phase names: how a refusal words them."""

    noun: str
    setting: str  # the limits.* setting of the per-job bound (and of the per-user one, + "_per_user")
    field: str  # the push item's field that names them ("" for phases: the item's own name)

    def of(self, names: JobNames) -> set[str]:
        return names.custom if self is _CUSTOM else names.phases

    def where(self, new: Mapping[str, int | None], name: str) -> str:
        """The push item that named `name` as the error's field prefix ("" at registration)."""
        index = new[name]
        if index is None:
            return ""
        return f"items[{index}].{self.field}{name}: " if self.field else f"items[{index}].name: "


_CUSTOM = _NameKind("custom metric names", "max_custom_metrics", "metrics.")
_PHASES = _NameKind("phase names", "max_phases", "")


def uid_text(uid: int | None) -> str:
    return "unknown (unverified TCP caller)" if uid is None else str(uid)
