"""trainer_hooks/rendezvous.py: the agent's re-rendezvous patches (issue 32, item 2), against torch's
real dynamic rendezvous module: the SYNC wait and the state cache become the poll interval, every
other delay is torch's, a bad SIDECAR_RDZV_POLL_SECONDS falls back with a message, and a torch
without the patched names is left alone."""

from __future__ import annotations

import time

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from trainer_hooks import rendezvous


@pytest.fixture
def restored(monkeypatch):
    """Whatever a test patches in torch's module is put back after it."""
    monkeypatch.setattr(dynamic_rendezvous, "_delay", dynamic_rendezvous._delay)
    holder = dynamic_rendezvous._BackendRendezvousStateHolder
    monkeypatch.setattr(holder, "__init__", holder.__init__)
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", dynamic_rendezvous.get_method_name)
    return holder


@pytest.mark.parametrize(
    "value, expected, complains",
    [(None, rendezvous.POLL_SECONDS, False), ("0.25", 0.25, False), ("1", 1.0, False),
     ("0", rendezvous.POLL_SECONDS, True), ("5", rendezvous.POLL_SECONDS, True),
     ("fast", rendezvous.POLL_SECONDS, True), ("nan", rendezvous.POLL_SECONDS, True)],
)  # fmt: skip
def test_the_poll_interval_comes_from_the_environment_and_a_bad_value_is_named(value, expected, complains, capsys):
    env = {} if value is None else {rendezvous.POLL_ENV: value}
    assert rendezvous.poll_seconds(env) == expected
    err = capsys.readouterr().err
    assert (rendezvous.POLL_ENV in err and repr(value) in err) == complains, err


def test_the_sync_wait_and_the_state_cache_become_the_poll_interval(restored):
    holder = restored
    torch_delay, torch_init = dynamic_rendezvous._delay, holder.__init__
    assert rendezvous.fast_polls(0.05)
    started = time.monotonic()
    dynamic_rendezvous._delay(seconds=1)  # torch's SYNC wait: 1 s
    assert time.monotonic() - started < 0.5
    settings = object()
    assert holder(object(), settings)._cache_duration == 0.05  # the state copy torch keeps for 1 s
    assert holder(object(), settings, cache_duration=3)._cache_duration == 3  # an explicit one is kept
    # installing again wraps torch's own functions, not the patches
    assert rendezvous.fast_polls(0.2)
    assert dynamic_rendezvous._delay.__wrapped__ is torch_delay and holder.__init__.__wrapped__ is torch_init
    assert holder(object(), settings)._cache_duration == 0.2


def test_other_delays_are_torchs(restored, monkeypatch):
    calls: list[object] = []
    monkeypatch.setattr(dynamic_rendezvous, "_delay", lambda seconds: calls.append(seconds))
    assert rendezvous.fast_polls(0.1)
    for asked in ((0, 0.3), 2, 0.5, 1):
        dynamic_rendezvous._delay(seconds=asked)
    assert calls == [(0, 0.3), 2, 0.5, 0.1]


def test_install_patches_both_and_a_torch_without_them_is_left_alone(restored, monkeypatch):
    assert rendezvous.install() == {"fast_polls": True, "fast_event_names": True}
    monkeypatch.delattr(dynamic_rendezvous, "_delay")
    monkeypatch.delattr(dynamic_rendezvous, "get_method_name")
    assert rendezvous.install() == {"fast_polls": False, "fast_event_names": False}
