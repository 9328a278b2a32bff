"""The agent's side of a crash loop ended on purpose (trainer_hooks/ending.py): a worker that exited
CRASH_LOOP_EXIT (93) was told by its sidecar that the job is in a crash loop (the same verdict at the
same step after restarts). The agent then restarts nothing, whatever --max-restarts has left, and
the launcher exits 93 (`run`): the status a scheduler reads as "do not requeue" (docs/slurm.md,
docs/kubernetes.md; NVRx's launchers use the same code). Plain torchrun cannot be told: it restarts
the group until its restarts run out (each attempt's ranks exit 93 as soon as their hooks hear from
the sidecar) and exits 1.

Patched in the agent process before torchrun's main runs; the workers are unchanged.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from trainer_hooks.wire import CRASH_LOOP_EXIT

log = logging.getLogger("trainer_hooks.launch")


def ended(failures: dict[Any, Any]) -> bool:
    """Whether a failed worker group's failures include a worker the sidecar ended (exit 93)."""
    return any(getattr(f, "exitcode", None) == CRASH_LOOP_EXIT for f in failures.values())


def sidecar_ended(job_id: str, environ: Any = None) -> bool:
    """Whether this node's sidecar ended the job (`GET /v1/jobs/<id>/ended`): a worker it could not
    tell (a hung rank it killed) fails with a signal, not 93, and its group must not restart into a
    rendezvous the other nodes' agents, gone with 93, never join. Unreachable or unsure: False."""
    import os
    from urllib.parse import quote

    from trainer_hooks.environment import endpoint
    from trainer_hooks.transport import Unreachable, request

    try:
        reply = request(endpoint(os.environ if environ is None else environ), "GET",
                        f"/v1/jobs/{quote(job_id, safe='')}/ended", connect_timeout=1.0, read_timeout=2.0)  # fmt: skip
    except (Unreachable, ValueError):
        return False
    ended = reply.body.get("ended") if reply.status == 200 else None
    return isinstance(ended, dict) and ended.get("exit_code") == CRASH_LOOP_EXIT


_said: list[str] = []  # the job ids this agent stopped for a crash loop (`run` exits 93 for them)
_jobs: set[str] = set()  # the job ids (rendezvous run ids) this agent ran


def install() -> bool:
    """Patch the local agent: a group with a worker that exited 93 is not restarted. False: torch's
    agent is not the one this was written against (nothing patched; torchrun's own restarts apply)."""
    try:
        from torch.distributed.elastic.agent.server.api import WorkerState
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    except ImportError:
        return False
    original = LocalElasticAgent._monitor_workers
    if getattr(original, "_sidecar_crash_loop", False):
        return True

    def monitor(self: Any, worker_group: Any) -> Any:
        result = original(self, worker_group)
        job_id = worker_group.spec.rdzv_handler.get_run_id()
        _jobs.add(job_id)
        if result.state != WorkerState.FAILED or self._remaining_restarts <= 0:
            return result
        if ended(result.failures) or sidecar_ended(job_id):
            log.error(
                "job %s: its sidecar ended the job for a crash loop; not restarting (%d restart(s) left)",
                job_id,
                self._remaining_restarts,
            )
            self._remaining_restarts = 0
            _said.append(job_id)
        return result

    monitor._sidecar_crash_loop = True  # type: ignore[attr-defined]
    # changes: agent-crash-loop (docs/changes-to-others.md)
    LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
    return True


def run(main: Callable[[], Any], prog: str) -> None:
    """torchrun's main, exiting CRASH_LOOP_EXIT when it failed because the sidecar ended the job: its
    workers exited 93, or the agent failed otherwise (the other nodes' agents gone with 93 took the
    rendezvous store with them while a hung worker here waited for its node to kill it) and this
    node's sidecar says the job is ended."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        main()
    except Exception as e:
        failures = e.failures if isinstance(e, ChildFailedError) else {}
        if not (ended(failures) or _said or any(sidecar_ended(job_id) for job_id in sorted(_jobs)[:4])):
            raise
        print(
            f"{prog}: the job was ended for a crash loop (the same verdict at the same step after restarts; "
            f"see `sidecar status` and the incident): exiting {CRASH_LOOP_EXIT}, do not requeue it unchanged",
            file=sys.stderr,
        )
        sys.exit(CRASH_LOOP_EXIT)
