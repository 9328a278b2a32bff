"""Who may register, and how much: the registry's rules and its refusals.

One job_id belongs to one uid while it has live ranks; a rank held by another live process of
the same restart attempt is not taken over; node-wide ceilings bound everyone and per-user
quotas everyone but root, so one user cannot take the slots another user's job needs. The
rules read the registry's own tables (shared with it, never copied); whether a process still
runs is asked of `alive`, injected by whoever builds the registry.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from trainer_hooks.wire import WELL_KNOWN_PHASES

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.config import Settings
    from sidecar.protocol import Registration
    from sidecar.registry import Rank, RankKey

ROOT_UID = 0


class RegistryError(Exception):
    """A request the registry refuses. `code` and `status` map onto the API's error body."""

    code = "bad_request"
    status = 400


class UnknownRank(RegistryError):
    code, status = "unknown_rank", 409


class RankTaken(RegistryError):
    """Another live process of the same restart attempt holds the rank: two jobs, one job_id."""
    code, status = "rank_taken", 409


class StepNotIncreasing(RegistryError):
    code, status = "step_not_increasing", 409


class LimitExceeded(RegistryError):
    code, status = "limit_exceeded", 429


class JobOwned(RegistryError):
    """The job_id belongs to another uid (its live ranks run as that uid)."""
    code, status = "job_owned", 403


class Admission:
    """The rules over the registry's ranks and per-job name tables, with `settings.limits`."""

    def __init__(self, settings: Settings, ranks: dict[RankKey, Rank], custom_names: dict[str, set[str]],
                 phase_names: dict[str, set[str]], alive: Callable[[int, float | None], bool],
                 evict: Callable[[], None]):
        self.settings = settings
        self._ranks = ranks
        self._custom_names = custom_names
        self._phase_names = phase_names
        self.alive = alive
        self._evict_gone_job = evict  # drops the job whose ranks are all gone, oldest first

    def job_owner(self, job_id: str) -> tuple[bool, int | None]:
        """(owned, uid): a job is owned while it has live ranks, by the uid they run as."""
        for r in self._ranks.values():
            if r.job_id == job_id and not r.gone:
                return True, r.owner_uid
        return False, None

    def check_registration(self, reg: Registration, host_pid: int, owner_uid: int | None) -> None:
        """Refuse a registration that breaks a rule; records its phase name when it does not.
        `host_pid`: the rank's pid here; `owner_uid`: the uid its process runs as, which must be
        the uid of the job's live ranks (JobOwned otherwise)."""
        self._check_not_taken(reg, host_pid)
        owned, owner = self.job_owner(reg.job_id)
        if owned and owner != owner_uid:
            raise JobOwned(f"job_id: {reg.job_id!r} belongs to uid {uid_text(owner)} (its ranks run as it) until "
                           f"they are gone; this registration is for uid {uid_text(owner_uid)}")
        self._check_room(reg, owned, owner_uid)
        self._check_phase_name(reg.job_id, reg.phase, owner_uid)

    def check_names(self, r: Rank, custom: set[str], phases: set[str], new_custom: dict[str, int],
                    new_phases: dict[str, int]) -> None:
        """A push's new custom metric and phase names (name -> index of the first item naming
        it) against the job's (`custom`, `phases`) and its owner's limits."""
        limits = self.settings.limits
        if len(custom) + len(new_custom) > limits.max_custom_metrics:
            name = list(new_custom)[max(0, limits.max_custom_metrics - len(custom))]
            raise LimitExceeded(f"items[{new_custom[name]}].metrics.{name}: too many custom metric names in "
                                f"job {r.job_id}: limits.max_custom_metrics is {limits.max_custom_metrics}")
        if len(phases) + len(new_phases) > limits.max_phases:
            name = list(new_phases)[max(0, limits.max_phases - len(phases))]
            raise LimitExceeded(f"items[{new_phases[name]}].name: too many phase names in job {r.job_id} "
                                f"(at {name!r}): limits.max_phases is {limits.max_phases}")
        if r.owner_uid != ROOT_UID and (new_custom or new_phases):
            self._check_user_names(r, new_custom, new_phases)

    def _check_not_taken(self, reg: Registration, host_pid: int) -> None:
        """A rank still held by another live process of the same attempt is a second job with the
        same job_id (torchrun's --rdzv-id) on this node. Replacing it back and forth would reset
        both ranks' stall timers on every push and mix their metrics, so the newcomer is refused.
        A restarted worker (a higher restart count) or a dead holder is replaced as usual."""
        held = self._ranks.get((reg.job_id, reg.rank))
        if (held is not None and not held.gone and held.pid != host_pid and reg.restart_count <= held.restart_count
                and self.alive(held.pid, held.pid_start_time)):
            raise RankTaken(f"rank {held.label} is held by pid {held.pid}, still running at restart "
                            f"{held.restart_count}: two jobs with job_id {reg.job_id!r} on this node? "
                            "give each its own --rdzv-id")

    def _check_phase_name(self, job_id: str, phase: str | None, owner_uid: int | None) -> None:
        if phase is None or phase in WELL_KNOWN_PHASES:
            return
        names = self._phase_names.setdefault(job_id, set())
        if phase in names:
            return
        limit = self.settings.limits.max_phases
        if len(names) >= limit:
            raise LimitExceeded(f"too many phase names in job {job_id} (at {phase!r}): limits.max_phases is {limit}")
        user_limit = self.settings.limits.max_phases_per_user
        if owner_uid != ROOT_UID and self._user_names(self._phase_names, owner_uid, job_id) + 1 > user_limit:
            raise LimitExceeded(f"too many phase names for uid {uid_text(owner_uid)} (at {phase!r}): "
                                f"limits.max_phases_per_user is {user_limit}")
        names.add(phase)

    def _check_room(self, reg: Registration, owned: bool, owner_uid: int | None) -> None:
        """Node-wide ceilings for everyone; per-user quotas for everyone but root, so one user
        cannot take the slots another user's job needs."""
        limits = self.settings.limits
        key = (reg.job_id, reg.rank)
        held = self._ranks.get(key)
        new_rank = held is None or held.gone
        if key not in self._ranks:
            job_ranks = sum(1 for k in self._ranks if k[0] == reg.job_id)
            if job_ranks == 0 and len({k[0] for k in self._ranks}) >= limits.max_jobs:
                self._evict_gone_job()
                if len({k[0] for k in self._ranks}) >= limits.max_jobs:
                    raise LimitExceeded(f"too many jobs: limits.max_jobs is {limits.max_jobs}")
            if job_ranks >= limits.max_ranks_per_job:
                raise LimitExceeded(
                    f"too many ranks in job {reg.job_id}: limits.max_ranks_per_job is {limits.max_ranks_per_job}")
        if new_rank and sum(1 for r in self._ranks.values() if not r.gone) >= limits.max_ranks:
            raise LimitExceeded(f"too many ranks on this node: limits.max_ranks is {limits.max_ranks}")
        if owner_uid == ROOT_UID:
            return
        live = [r for r in self._ranks.values() if not r.gone and r.owner_uid == owner_uid]
        if not owned and len({r.job_id for r in live}) >= limits.max_jobs_per_user:
            raise LimitExceeded(f"too many jobs of uid {uid_text(owner_uid)}: limits.max_jobs_per_user is "
                                f"{limits.max_jobs_per_user}")
        if new_rank and len(live) >= limits.max_ranks_per_user:
            raise LimitExceeded(f"too many ranks of uid {uid_text(owner_uid)}: limits.max_ranks_per_user is "
                                f"{limits.max_ranks_per_user}")

    def _user_jobs(self, owner_uid: int | None) -> set[str]:
        return {r.job_id for r in self._ranks.values() if r.owner_uid == owner_uid}

    def _user_names(self, table: dict[str, set[str]], owner_uid: int | None, job_id: str) -> int:
        return sum(len(table.get(j, ())) for j in self._user_jobs(owner_uid) | {job_id})

    def _check_user_names(self, r: Rank, new_custom: dict[str, int], new_phases: dict[str, int]) -> None:
        limits = self.settings.limits
        if new_custom and self._user_names(self._custom_names, r.owner_uid, r.job_id) + len(new_custom) > \
                limits.max_custom_metrics_per_user:
            name = next(iter(new_custom))
            raise LimitExceeded(f"items[{new_custom[name]}].metrics.{name}: too many custom metric names for uid "
                                f"{uid_text(r.owner_uid)}: limits.max_custom_metrics_per_user is "
                                f"{limits.max_custom_metrics_per_user}")
        if new_phases and self._user_names(self._phase_names, r.owner_uid, r.job_id) + len(new_phases) > \
                limits.max_phases_per_user:
            name = next(iter(new_phases))
            raise LimitExceeded(f"items[{new_phases[name]}].name: too many phase names for uid "
                                f"{uid_text(r.owner_uid)} (at {name!r}): limits.max_phases_per_user is "
                                f"{limits.max_phases_per_user}")


def uid_text(uid: int | None) -> str:
    return "unknown (unverified TCP caller)" if uid is None else str(uid)
