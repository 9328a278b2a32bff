"""The job view's exchange through the job's own store (trainer_hooks/jobview.py): rank 0 publishes
its sidecar's offer, the job's key with it (wire protocol 6); every rank delivers both to its own
sidecar in a `job_coordinator` event. A store of the real kind (torch's TCPStore) when torch is
here: the exchange must work with what torch's store really does (bytes back, `check`)."""

from __future__ import annotations

import pytest

from tests.support import free_port
from trainer_hooks.jobview import KEY, CoordinatorExchange
from trainer_hooks.wire import JOB_COORDINATOR_EVENT

torch_distributed = pytest.importorskip("torch.distributed")


def store(port: int, master: bool):
    return torch_distributed.TCPStore("127.0.0.1", port, 2, master, wait_for_workers=False)


def test_rank0_publishes_the_offer_with_the_jobs_key_and_every_rank_delivers_it():
    port = free_port()
    master, worker = store(port, True), store(port, False)
    offer = {"url": "http://10.0.0.1:9402", "node": "node-0", "key": "ab" * 32}
    got0: list[dict] = []
    got1: list[dict] = []
    rank0 = CoordinatorExchange(0, lambda: offer, got0.append, store=lambda: master)
    rank1 = CoordinatorExchange(1, lambda: None, got1.append, store=lambda: worker)
    assert not rank1.exchange_once()  # nothing published yet
    assert rank0.exchange_once() and rank1.exchange_once()
    for got in (got0, got1):
        assert got == [{"type": "event", "name": JOB_COORDINATOR_EVENT, "fields": offer}]
    assert rank1.exchange_once() and len(got1) == 1  # delivered once, not at every read


@pytest.mark.parametrize("key", ["short", 7, None, "ab" * 33])
def test_a_key_of_the_wrong_shape_is_left_out(key):
    port = free_port()
    master = store(port, True)
    master.set(KEY, '{"url": "http://10.0.0.1:9402", "node": "node-0", "key": %s}' % (
        "null" if key is None else f'"{key}"' if isinstance(key, str) else key))  # fmt: skip
    got: list[dict] = []
    assert CoordinatorExchange(1, lambda: None, got.append, store=lambda: master).exchange_once()
    assert got[0]["fields"] == {"url": "http://10.0.0.1:9402", "node": "node-0"}
