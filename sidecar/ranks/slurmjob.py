"""A rank's Slurm job, so that alerts and incidents reach its owner (issue 44): `slurm_job_id`,
`slurm_user`, `slurm_account` and `slurm_partition` labels on its series and its job's own series,
`slurm` in `/v1/status` and in its job's incident records.

Where each fact comes from (the sidecar is root; what a rank sends is its own word,
docs/security.md "What a rank may claim about itself"):

- the job id: the sidecar's own reading of the verified process's cgroup (host/cgroups.slurm_job_of,
  `Rank.slurm_job_id`), never a number the rank sends;
- the user: the name of the uid the verified process runs as, in this node's user database (the uid's
  number where it has no name, as Slurm's own commands show it), never SLURM_JOB_USER, which the rank
  could set to anyone's name; none for a registration no process was verified for;
- the account and partition: the rank's environment (SLURM_JOB_ACCOUNT, SLURM_JOB_PARTITION), sent in
  the registration's `slurm` (protocol 9). Nothing on the node can check them; they must be Slurm names
  (trainer_hooks/wire.py SLURM_LABEL_RULES: letters, digits, `_`, `.`, `-`, at most 64 characters), else
  the registration is refused with 400 naming the key. A rank that lies labels only its own ranks and
  its own job (whose job_id belongs to its uid): it gains a wrong account on its own alerts, nothing else.

A rank is a Slurm job's when its cgroup says so or its registration carries `slurm` (the hooks send it
where SLURM_JOB_ID is set); only then is its user named. The labels add no series: a rank has one value
of each at a time, replaced when it registers again (sidecar/ranks/podlabels.py carries them with the
pod labels). `metrics.slurm_labels: false` keeps them off the series; `/v1/status` and the incidents keep
them.
"""

from __future__ import annotations

import pwd
import re
from collections.abc import Iterable
from typing import Any, Protocol

from sidecar.host import cgroups
from trainer_hooks.wire import SLURM_LABEL_KEYS as KEYS
from trainer_hooks.wire import SLURM_LABEL_RULES as RULES

# The labels, in the order the facts are listed: job id, user, account, partition.
LABELS = ("slurm_job_id", "slurm_user", "slurm_account", "slurm_partition")
# A user name as it may stand in a label: the node's user database is root's to trust, but a name that
# is not a plain login name (a directory's odd entry) is shown as the uid instead.
USER_RE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.@$-]{0,127}\Z")


class Rank(Protocol):
    """What of a rank (ranks/model.py Rank) its Slurm facts are read from."""

    pid: int  # its process, in the sidecar's pid namespace
    owner_uid: int | None  # the uid its process runs as (None: no process was verified)
    slurm_job_id: str | None  # from its verified process's cgroup
    slurm_user: str | None  # the name of the uid its verified process runs as
    slurm: dict[str, str] | None  # account and partition, as it says; None: it names no Slurm job


class SlurmLabelError(ValueError):
    """The `slurm` object of a registration is not what Slurm would name."""


def parse(value: Any) -> dict[str, str] | None:
    """The validated `slurm` of a registration: its account and partition (None: absent or null, not
    a Slurm job by its own word)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SlurmLabelError("slurm: expected an object with account and partition")
    out = {}
    for key, text in value.items():
        if key not in RULES:
            why = " (the user is the uid of the process, never a name a rank sends)" if key == "user" else ""
            raise SlurmLabelError(f"slurm: unknown key {str(key)[:40]!r}; known: {', '.join(KEYS)}{why}")
        if text is None:
            continue
        pattern, max_len, what = RULES[key]
        if not isinstance(text, str) or len(text) > max_len or not pattern.match(text):
            shown = repr(text[:64]) if isinstance(text, str) else type(text).__name__
            raise SlurmLabelError(
                f"slurm.{key}: expected {what} (letters, digits, '_', '.' and '-', at most {max_len} characters), "
                f"got {shown}"
            )
        out[key] = text
    return out


def user_name(uid: int) -> str:
    """The name of `uid` in this node's user database, or its number (no name, or not a plain one).
    May block on the node's directory service (NSS): call it off the event loop."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError, OSError):
        return str(uid)
    return name if USER_RE.match(name) else str(uid)


def verified(rank: Rank) -> tuple[str | None, str | None]:
    """(Slurm job id, user) of a rank whose process the sidecar verified: the job whose cgroup holds
    it, and the name of the uid it runs as when it is a Slurm job's (its cgroup, or its own `slurm`).
    Reads the rank, changes nothing; blocking (/proc, NSS): in the executor."""
    job_id = cgroups.slurm_job_of(rank.pid)
    if rank.owner_uid is None or (job_id is None and rank.slurm is None):
        return job_id, None
    return job_id, user_name(rank.owner_uid)


def facts(rank: Rank) -> dict[str, str] | None:
    """The rank's Slurm facts by key (job_id, user, account, partition; each where known), or None for a
    rank that is no Slurm job's."""
    if rank.slurm_job_id is None and rank.slurm is None:
        return None
    out = {"job_id": rank.slurm_job_id, "user": rank.slurm_user, **(rank.slurm or {})}
    return {k: v for k, v in out.items() if v is not None}


def labels(rank: Rank) -> dict[str, str]:
    """The rank's Slurm labels (slurm_job_id, slurm_user, slurm_account, slurm_partition; each where known)."""
    found = facts(rank)
    return {f"slurm_{k}": v for k, v in found.items()} if found else {}


def job_facts(ranks: Iterable[Rank]) -> dict[str, str] | None:
    """A job's Slurm facts from its ranks on this node: each that its ranks name one value of (ranks
    naming two leave it out); None when no rank of it is a Slurm job's."""
    seen: dict[str, set[str]] = {}
    slurm = False
    for rank in ranks:
        found = facts(rank)
        if found is None:
            continue
        slurm = True
        for key, value in found.items():
            seen.setdefault(key, set()).add(value)
    if not slurm:
        return None
    return {key: values.pop() for key, values in seen.items() if len(values) == 1}
