"""Reports and verdicts on the wire (sidecar/jobview/report.py) and how sidecars sign them
(sidecar/jobview/auth.py): a peer's bad input is a 4xx naming the field, a forged or replayed
request is refused, and an unsigned answer is not believed."""

from __future__ import annotations

import json

import pytest

from sidecar.jobview import auth
from sidecar.jobview.report import NodePart, parse_report, parse_verdict
from sidecar.ranks.protocol import ProtocolError
from tests.jobview.helpers import rank, report


def wire(**changes) -> dict:
    data = json.loads(json.dumps(report("node-1", rank(2, waiting=False)).to_wire()))
    data.update(changes)
    return data


def test_a_report_survives_the_round_trip():
    parsed = parse_report(wire(), max_ranks=8)
    assert parsed.node == "node-1" and parsed.ranks[0].rank == 2 and parsed.ranks[0].waiting is False


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"node": "bad name\n"}, "node"),
        ({"job_id": ".hidden"}, "job_id"),
        ({"ranks": [{"rank": -1}]}, "ranks[0]"),
        ({"ranks": [{**wire()["ranks"][0], "state": "dancing"}]}, "ranks[0].state"),
        ({"ranks": [{**wire()["ranks"][0], "waiting": "yes"}]}, "ranks[0].waiting"),
        ({"ranks": [{**wire()["ranks"][0], "busy": 1}]}, "ranks[0].busy"),
        ({"time": "now"}, "time"),
        (
            {"part": {"incident": "x", "outcome": "killed", "timeline": [{"event": "e", "time": -1}]}},
            "part.timeline[0]",
        ),
        ({"part": {"incident": "x", "outcome": "killed", "stages": [1.0]}}, "part.stages"),
        ({"part": {"incident": "x", "outcome": "killed", "stages": {"kill": -0.5}}}, "part.stages.kill"),
        ({"part": {"incident": "x", "outcome": "killed", "stages": {"kill": "fast"}}}, "part.stages.kill"),
        ({"part": {"incident": "x", "outcome": "killed", "stages": {"kill": True}}}, "part.stages.kill"),
        ({"part": {"incident": "x", "outcome": "killed", "stages": {"Kill\x1b": 1.0}}}, "part.stages"),
        ({"part": {"incident": "x", "outcome": "killed", "stages": {f"s{i}": 1.0 for i in range(17)}}}, "part.stages"),
    ],
)
def test_a_bad_report_is_refused_naming_the_field(changes, field):
    with pytest.raises(ProtocolError) as e:
        parse_report(wire(**changes), max_ranks=8)
    assert str(e.value).startswith(field), str(e.value)


def test_a_part_with_its_recovery_stages_survives_the_round_trip_in_order_unknown_ones_null():
    stages = {"detect": 4.8, "dump": 0.1, "decide": None, "kill": 0.06, "restart": 2, "first_step": 0.2}
    part = NodePart("inc-1", "killed", [{"event": "sigterm", "time": 11.0}], stages)
    parsed = parse_report(json.loads(json.dumps(report("node-1", rank(2), part=part).to_wire())), max_ranks=8)
    assert parsed.part is not None and parsed.part.stages == stages
    assert list(parsed.part.stages) == list(stages)  # the recovery's order, for the table's rows
    assert parsed.part.timeline == [{"event": "sigterm", "time": 11.0}]


def test_a_part_from_an_older_node_without_stages_is_accepted_with_none():
    old = {"incident": "inc-1", "outcome": "killed", "timeline": [{"event": "sigterm", "time": 11.0}]}
    parsed = parse_report(wire(part=old), max_ranks=8)
    assert parsed.part is not None and parsed.part.stages == {} and parsed.part.outcome == "killed"


def test_a_busy_rank_and_a_busy_culprit_survive_the_round_trip_and_default_to_not_busy():
    busy = wire(ranks=[{**wire()["ranks"][0], "busy": True}])
    assert parse_report(busy, max_ranks=8).ranks[0].busy is True
    older = wire(ranks=[{k: v for k, v in wire()["ranks"][0].items() if k != "busy"}])  # a peer before issue 29
    assert parse_report(older, max_ranks=8).ranks[0].busy is False
    verdict = {
        "job_id": "j1",
        "job_incident": "x",
        "version": 1,
        "opened": 1.0,
        "culprit": {
            "rank": 0,
            "node": "node-0",
            "step": 3,
            "phase": None,
            "stack_top": None,
            "kind": "rank_late",
            "evidence": "collectives",
            "busy": True,
        },
    }
    parsed = parse_verdict(verdict)
    assert parsed is not None and parsed.culprit is not None and parsed.culprit.busy is True
    with pytest.raises(ProtocolError) as e:
        parse_verdict({**verdict, "culprit": {**verdict["culprit"], "busy": "yes"}})
    assert "culprit.busy" in str(e.value)


DRILL = "drill-20261205T005255Z-424106"


@pytest.mark.parametrize("bad", ["drill-now", "x" * 300, 7, "drill-20261205T005255Z-42410\n", ["drill"]])
def test_a_drill_survives_the_round_trip_and_a_bad_one_is_refused(bad):
    """A node running `sidecar drill` on the job says so in its reports; the verdict carries it to
    every node (and an older peer, which sends none, means none)."""
    assert parse_report(wire(drill=DRILL), max_ranks=8).drill == DRILL
    assert parse_report(wire(), max_ranks=8).drill is None
    verdict = {"job_id": "j1", "job_incident": "x", "version": 1, "opened": 1.0, "drill": DRILL}
    parsed = parse_verdict(verdict)
    assert parsed is not None and parsed.drill == DRILL
    with pytest.raises(ProtocolError) as e:
        parse_report(wire(drill=bad), max_ranks=8)
    assert str(e.value).startswith("drill"), str(e.value)
    with pytest.raises(ProtocolError) as e:
        parse_verdict({**verdict, "drill": bad})
    assert str(e.value).startswith("verdict.drill"), str(e.value)


def test_a_report_with_more_ranks_than_the_limit_is_too_large():
    with pytest.raises(ProtocolError) as e:
        parse_report(wire(ranks=[wire()["ranks"][0]] * 9), max_ranks=8)
    assert e.value.status == 413


def test_a_malformed_verdict_is_refused():
    with pytest.raises(ProtocolError):
        parse_verdict({"job_id": "j1", "job_incident": "x", "version": "one", "opened": 1.0})
    assert parse_verdict(None) is None


KEY = "a" * 64


def test_a_signed_request_is_accepted_once():
    verifier = auth.Verifier(KEY, "node-0")
    header, nonce = auth.sign_request(KEY, "POST", "/v1/jobs/j1/report", b"{}", "node-0")
    assert verifier.check("POST", "/v1/jobs/j1/report", b"{}", header) == nonce
    assert verifier.check("POST", "/v1/jobs/j1/report", b"{}", header) is None  # a replay


@pytest.mark.parametrize(
    "tamper",
    [
        lambda h: ("POST", "/v1/jobs/j1/report", b'{"x":1}', h),  # another body
        lambda h: ("POST", "/v1/jobs/j2/report", b"{}", h),  # another job
        lambda h: ("GET", "/v1/jobs/j1/report", b"{}", h),  # another method
        lambda h: ("POST", "/v1/jobs/j1/report", b"{}", None),  # unsigned
        lambda h: ("POST", "/v1/jobs/j1/report", b"{}", "1:2"),  # malformed
        lambda h: ("POST", "/v1/jobs/j1/report", b"{}", "nan:n:" + h.split(":")[2]),  # no time
    ],
)
def test_a_forged_or_altered_request_is_refused(tamper):
    header, _ = auth.sign_request(KEY, "POST", "/v1/jobs/j1/report", b"{}", "node-0")
    assert auth.Verifier(KEY, "node-0").check(*tamper(header)) is None


def test_a_request_signed_with_another_key_for_another_node_or_long_ago_is_refused():
    header, _ = auth.sign_request("b" * 64, "POST", "/p", b"", "node-0")
    assert auth.Verifier(KEY, "node-0").check("POST", "/p", b"", header) is None
    elsewhere, _ = auth.sign_request(KEY, "POST", "/p", b"", "node-1")  # round 3, row 11
    assert auth.Verifier(KEY, "node-0").check("POST", "/p", b"", elsewhere) is None
    assert auth.Verifier(KEY, "node-1").check("POST", "/p", b"", elsewhere) is not None
    old, _ = auth.sign_request(KEY, "POST", "/p", b"", "node-0", now=1000.0)
    assert auth.Verifier(KEY, "node-0").check("POST", "/p", b"", old) is None


def test_a_nonce_is_remembered_for_the_whole_window_and_forgotten_after_it():
    """Round 3, row 11: nonces were kept by count (4,096): one replayed after 4,096 other requests,
    2.1 s later, was accepted. Now for the window, however many requests come between."""
    clock = [10_000.0]
    verifier = auth.Verifier(KEY, "node-0", clock=lambda: clock[0])
    first, _ = auth.sign_request(KEY, "POST", "/p", b"", "node-0", now=clock[0])
    assert verifier.check("POST", "/p", b"", first) is not None
    for _ in range(5000):
        clock[0] += 0.01
        header, _ = auth.sign_request(KEY, "POST", "/p", b"", "node-0", now=clock[0])
        assert verifier.check("POST", "/p", b"", header) is not None
    assert verifier.check("POST", "/p", b"", first) is None  # 50 s later: still remembered
    clock[0] += auth.MAX_SKEW_SECONDS
    assert verifier.check("POST", "/p", b"", first) is None  # too old now
    fresh, _ = auth.sign_request(KEY, "POST", "/p", b"", "node-0", now=clock[0])
    assert verifier.check("POST", "/p", b"", fresh) is not None
    assert len(verifier) <= 5000  # the first requests' nonces left with their window


def test_past_its_bound_a_jobs_nonces_refuse_rather_than_forget(monkeypatch):
    monkeypatch.setattr(auth, "MAX_NONCES", 3)
    verifier = auth.Verifier(KEY, "node-0")
    headers = [auth.sign_request(KEY, "POST", "/p", b"", "node-0")[0] for _ in range(4)]
    assert [verifier.check("POST", "/p", b"", h) is not None for h in headers] == [True, True, True, False]
    assert verifier.check("POST", "/p", b"", headers[0]) is None and verifier.refused_full == 1


def test_an_answer_counts_only_when_signed_for_the_request():
    signature = auth.sign_reply(KEY, "nonce-1", b'{"ok":true}')
    assert auth.reply_is_signed(KEY, "nonce-1", b'{"ok":true}', signature)
    assert not auth.reply_is_signed(KEY, "nonce-2", b'{"ok":true}', signature)
    assert not auth.reply_is_signed(KEY, "nonce-1", b'{"ok":false}', signature)
    assert not auth.reply_is_signed(KEY, "nonce-1", b'{"ok":true}', None)
