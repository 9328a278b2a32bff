"""The registry's refusals: each maps onto the push API's error body (`code`, HTTP `status`)."""

from __future__ import annotations


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
