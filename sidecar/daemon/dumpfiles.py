"""The stack-dump file of a rank that registers (host/stackfiles.py makes it, bounded per uid)."""

from __future__ import annotations

import logging

from sidecar.config import Settings
from sidecar.host import stackfiles
from sidecar.ranks.model import Rank
from sidecar.ranks.registry import Registry

log = logging.getLogger("sidecar.daemon.api")


def stack_file_for(
    settings: Settings,
    dump_files: stackfiles.DumpFiles | None,
    registry: Registry,
    rank: Rank,
    previous: Rank | None,
    verified: bool,
) -> stackfiles.StackFile | None:
    """The dump file of a rank that just registered: the one it already had when the same
    process registers again, else a new one (within the per-uid bounds of stackfiles.DumpFiles).
    None when it asked for no dumps, when its caller was not verified as the process (nothing
    would be signalled anyway), or when the process is not visible."""
    if not verified or rank.stack_signal is None or rank.pid_start_time is None:
        return None
    if (
        previous is not None
        and previous.stack_file is not None
        and previous.pid == rank.pid
        and previous.pid_start_time == rank.pid_start_time
    ):
        return previous.stack_file
    uid = stackfiles.owner_uid(rank.pid)
    if uid is None:
        return None
    try:
        if dump_files is None:
            return stackfiles.create(settings.diagnostics_dir, rank.job_id, rank.rank, rank.pid, uid)
        return dump_files.create(rank.job_id, rank.rank, rank.pid, uid, lambda: held_dump_files(registry))
    except OSError as e:
        log.warning("no stack-dump file for rank %s: %s", rank.label, e)
        return None


def held_dump_files(registry: Registry) -> set[str]:
    """The dump files of live ranks: never removed."""
    return {r.stack_file.path for r in registry.ranks() if r.stack_file is not None and not r.gone}
