"""A verdict's kind from a holder of the job's key (docs/security.md, "Kinds and conditions"): a
forged `job_paused` cannot hold a node whose own ranks wait on a peer or stopped working, and a
kind this version does not know counts as `other` (a bounded metric label), never refused."""

from __future__ import annotations

from types import SimpleNamespace

from sidecar import hang_kinds
from sidecar.jobview.report import Culprit, Verdict
from sidecar.watchdog import pause
from sidecar.watchdog.states import RankState


def node(activity: str | None, waiting: bool):
    rank = SimpleNamespace(collectives=None)
    track = SimpleNamespace(rank=rank, state=RankState.STALLED, probe=SimpleNamespace(waiting=waiting, frames=()))
    dog = SimpleNamespace(
        clock=lambda: 10.0, tracks_of=lambda job: [track],
        liveness=SimpleNamespace(activity=lambda r, now, frames: activity),
    )  # fmt: skip
    return SimpleNamespace(dog=dog, job_id="j1", incident=None)


def forged(kind: str) -> Verdict:
    return Verdict("j1", "inc", 2, 1.0, culprit=Culprit(None, "node-9", reason="trust me", kind=kind))


def test_a_forged_pause_does_not_hold_a_node_whose_rank_waits_on_a_peer():
    assert not pause.paused(node("idle", waiting=True), forged("job_paused"))


def test_a_forged_pause_does_not_hold_a_node_whose_rank_stopped_working():
    assert not pause.paused(node("stopped", waiting=False), forged("job_paused"))
    assert not pause.paused(node("idle", waiting=False), forged("job_paused"))


def test_a_real_pause_holds_and_a_verdict_naming_a_hang_does_not():
    assert pause.paused(node("cpu", waiting=False), forged("job_paused"))
    assert pause.paused(node("cpu", waiting=False), None)  # no verdict: this node's own reading
    assert not pause.paused(node("cpu", waiting=False), forged("rank_late"))


def test_an_unknown_kind_is_one_bounded_label():
    assert {hang_kinds.metric_label(f"kind_{i}") for i in range(1000)} == {"other"}
