"""The one thing the sidecar may tell the hooks to do to their process: end it, because the job is
in a crash loop (the same verdict at the same step after restarts; sidecar/jobview/crashloop.py).
The answer to a registration or a push then carries `end` (wire.END) with CRASH_LOOP_EXIT: the rank
says why on stderr and exits with that status at once, so that `python -m trainer_hooks.launch`
stops restarting it and exits 93 itself (a scheduler's "do not requeue"). No other status is taken."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from trainer_hooks.wire import CRASH_LOOP_EXIT, END


def obey(body: dict, ident: Any, exit: Callable[[int], Any]) -> None:
    """Exit CRASH_LOOP_EXIT when the answer says the job is ended; else nothing."""
    end = body.get(END)
    if not isinstance(end, dict) or end.get("exit_code") != CRASH_LOOP_EXIT:
        return
    reason, incident = str(end.get("reason", "a crash loop"))[:500], str(end.get("job_incident", ""))[:200]
    try:
        sys.stderr.write(
            f"trainer_hooks: job {ident.job_id} rank {ident.rank}: the sidecar ended the job: {reason} "
            f"(job incident {incident}); exiting {CRASH_LOOP_EXIT}: do not restart or requeue it unchanged\n"
        )
        sys.stderr.flush()
    finally:
        exit(CRASH_LOOP_EXIT)
