"""Where the job's coordinating sidecar is, told through the job's own c10d store.

The sidecars of a multi-node job need one of them to gather the job's picture during a hang
(docs/architecture/job-view.md, "The job view"). Rank 0's sidecar offers itself at rank 0's registration;
rank 0's hooks write that offer under one key of the store the process group was formed with
(`torch.distributed`'s default store), and every rank's hooks read it and tell their own sidecar.
The offer holds the job's own key (wire protocol 6): the job's sidecars sign what they tell each
other with it, so no other job's ranks, and no node without a rank of the job, can speak for it.
One small key per job, written once and read once per attempt by a thread of the hooks' own:
never on the training thread, never in the sender's way (a store that does not answer blocks only
this thread). Without torch, or before `init_process_group`, nothing happens. SIDECAR_JOB_VIEW=0
turns it off.

Under torchrun's shared agent store (torch 2.13 without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and
without trainer_hooks.distributed) the key outlives an attempt: a rank may read the previous
attempt's coordinator until rank 0 of the new one has written; it is read again every
REREAD_SECONDS, and a previous coordinator that still runs can coordinate the job all the same.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from trainer_hooks.environment import switched_on
from trainer_hooks.errors import warn
from trainer_hooks.wire import JOB_COORDINATOR_EVENT, JOB_KEY_CHARS

KEY = "trainer_hooks/job_view/coordinator"
SWITCH = "SIDECAR_JOB_VIEW"
POLL_SECONDS = 1.0  # until the process group exists and the key is there
REREAD_SECONDS = 30.0  # afterwards: the coordinator may have moved (a restart)


def enabled(environ: Mapping[str, str]) -> bool:
    return switched_on(environ, SWITCH)


def _default_store() -> Any:
    """The default process group's store, or None (no torch, no group yet)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


class CoordinatorExchange:
    """Publishes the offer (rank 0) and delivers what the key holds, as a push item, each time
    it changes. `offer()` is the sidecar's offer from the registration answer (None before)."""

    def __init__(
        self,
        rank: int,
        offer: Callable[[], dict | None],
        deliver: Callable[[dict], None],
        store: Callable[[], Any] = _default_store,
    ):
        self.rank, self.offer, self.deliver, self.store = rank, offer, deliver, store
        self.published: dict | None = None
        self.known: dict | None = None
        self._stop = threading.Event()
        self._pid = os.getpid()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="trainer_hooks-job-view", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set() and os.getpid() == self._pid:
            try:
                done = self.exchange_once()
            except Exception as e:  # a store that went away, a torch without the call
                warn("job_view", "trainer_hooks: job view exchange failed (%s: %s)", type(e).__name__, e)
                done = False
            self._stop.wait(REREAD_SECONDS if done else POLL_SECONDS)

    def exchange_once(self) -> bool:
        """One round; True once the coordinator is known."""
        store = self.store()
        if store is None:
            return False
        if self.rank == 0:
            offer = self.offer()
            if offer and offer != self.published:
                store.set(KEY, json.dumps(offer))
                self.published = offer
        if not store.check([KEY]):
            return False
        value = json.loads(store.get(KEY))
        if (
            not isinstance(value, dict)
            or not isinstance(value.get("url"), str)
            or not isinstance(value.get("node"), str)
        ):
            return False
        key = value.get("key")
        value = {"url": value["url"][:240], "node": value["node"][:253]}
        if isinstance(key, str) and len(key) == JOB_KEY_CHARS:
            value["key"] = key  # the job's key: its sidecars sign their reports with it (sidecar/jobview/auth.py)
        if value != self.known:
            self.known = value
            self.deliver({"type": "event", "name": JOB_COORDINATOR_EVENT, "fields": value})
        return True
