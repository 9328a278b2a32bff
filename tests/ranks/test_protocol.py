"""The wire protocol's validation: strict JSON, and a refusal that names the field."""

from __future__ import annotations

import math

import pytest

from sidecar.ranks import protocol
from sidecar.ranks.protocol import PhaseItem, ProtocolError, StepItem


def refusal(fn, *args) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        fn(*args)
    return info.value


def reg(**fields) -> dict:
    body = {"job_id": "run-42", "rank": 1, "world_size": 2, "local_world_size": 2, "local_rank": 1, "pid": 4242}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not ...}


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity"])
def test_bare_non_finite_tokens_are_not_json(token):
    e = refusal(protocol.decode, b'{"loss": ' + token + b"}")
    assert e.code == "bad_json" and token.decode().lstrip("-") in str(e)


@pytest.mark.parametrize("body", [b"", b"{", b"\xff\xfe", b"[1, 2]", b'"text"', b"[" * 100_000])
def test_malformed_or_non_object_bodies_are_bad_json(body):
    assert refusal(protocol.decode, body).code == "bad_json"


def test_a_registration_is_read_into_typed_fields():
    r = protocol.parse_registration(
        reg(
            step=17,
            phase="eval",
            restart_count=3,
            stack_dump={"signal": 12, "path": "/tmp/x.stacks"},
            versions={"torch": "2.13.0", "cuda": None},
        )
    )
    assert (r.job_id, r.rank, r.pid, r.step, r.phase, r.restart_count) == ("run-42", 1, 4242, 17, "eval", 3)
    assert (r.stack_signal, r.versions) == (12, {"torch": "2.13.0"})
    assert not hasattr(r, "stack_path")  # a path the rank names is never taken (docs/security.md)


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"rank": "one"}, "rank"),
        ({"rank": 2}, "rank"),  # not below world_size
        ({"world_size": ...}, "world_size"),
        ({"pid": 0}, "pid"),
        ({"pid": True}, "pid"),
        ({"job_id": ""}, "job_id"),
        ({"job_id": "x" * 500}, "job_id"),
        ({"job_id": "a\nb"}, "job_id"),
        ({"job_id": "incidents"}, "job_id"),  # the diag dir's incident store
        ({"job_id": "Incidents"}, "job_id"),
        ({"job_id": ".hidden"}, "job_id"),
        ({"job_id": ".."}, "job_id"),
        ({"local_rank": 5}, "local_rank"),
        ({"step": -1}, "step"),
        ({"restart_count": 10**30}, "restart_count"),
        ({"versions": []}, "versions"),
        ({"stack_dump": {"signal": 99}}, "stack_dump.signal"),
        ({"phase": "bad phase!"}, "phase"),
    ],
)
def test_a_bad_registration_field_is_named(fields, named):
    e = refusal(protocol.parse_registration, reg(**fields))
    assert e.code == "bad_field" and str(e).startswith(named + ":"), str(e)


@pytest.mark.parametrize(
    "parse",
    [protocol.parse_registration, lambda d: protocol.parse_push(d | {"items": []}, 10), protocol.parse_deregistration],
)
def test_a_reserved_job_id_is_refused_by_every_request(parse):
    e = refusal(parse, reg(job_id="incidents"))
    assert e.code == "bad_field" and e.status == 400 and "job_id" in str(e) and "reserved" in str(e)


def test_push_items_keep_their_order_and_types():
    p = protocol.parse_push(
        {
            "job_id": "j",
            "rank": 0,
            "pid": 7,
            "items": [
                {"type": "step", "step": 1, "time": 10.0, "metrics": {"loss": 2, "acc": "nan"}},
                {"type": "phase", "name": "eval", "action": "start", "time": 11.0, "timeout_seconds": 60},
                {"type": "event", "name": "checkpoint_saved", "time": 12.0, "fields": {"step": 1}},
            ],
        },
        100,
    )
    assert [type(i) for i in p.items] == [StepItem, PhaseItem, protocol.EventItem]
    assert p.items[0].metrics["loss"] == 2.0 and math.isnan(p.items[0].metrics["acc"])
    assert p.items[1].timeout_seconds == 60.0


def test_non_finite_values_arrive_as_strings():
    p = protocol.parse_push(
        {
            "job_id": "j",
            "rank": 0,
            "pid": 7,
            "items": [{"type": "step", "step": 1, "metrics": {"a": "inf", "b": "-inf", "c": "NaN"}}],
        },
        10,
    )
    m = p.items[0].metrics
    assert m["a"] == math.inf and m["b"] == -math.inf and math.isnan(m["c"])


@pytest.mark.parametrize(
    "item, named",
    [
        ({"type": "step", "step": -3}, "items[0].step"),
        ({"type": "step", "step": 1.5}, "items[0].step"),
        ({"type": "step", "step": 10**30}, "items[0].step"),
        ({"type": "step"}, "items[0].step"),
        ({"type": "step", "step": 1, "time": "now"}, "items[0].time"),
        ({"type": "step", "step": 1, "metrics": {"loss": "high"}}, "items[0].metrics.loss"),
        ({"type": "step", "step": 1, "metrics": {"loss": [1]}}, "items[0].metrics.loss"),
        ({"type": "step", "step": 1, "metrics": {"bad name": 1}}, "items[0].metrics"),
        ({"type": "step", "step": 1, "metrics": {"tokens": 10**400}}, "items[0].metrics.tokens"),
        ({"type": "step", "step": 1, "time": 10**400}, "items[0].time"),
        ({"type": "phase", "name": "eval", "action": "start", "timeout_seconds": 10**400}, "items[0].timeout_seconds"),
        ({"type": "phase", "name": "eval", "action": "pause"}, "items[0].action"),
        ({"type": "phase", "name": "eval", "action": "start", "timeout_seconds": -1}, "items[0].timeout_seconds"),
        ({"type": "event", "name": "x", "fields": "no"}, "items[0].fields"),
        ({"type": "metric"}, "items[0].type"),
        ("step", "items[0]"),
    ],
)
def test_a_bad_item_is_named_by_its_index(item, named):
    e = refusal(protocol.parse_push, {"job_id": "j", "rank": 0, "pid": 7, "items": [item]}, 10)
    assert e.code == "bad_field" and str(e).startswith(named), str(e)


def test_too_many_items_is_too_large():
    e = refusal(
        protocol.parse_push,
        {"job_id": "j", "rank": 0, "pid": 7, "items": [{"type": "step", "step": i} for i in range(11)]},
        10,
    )
    assert (e.code, e.status) == ("too_large", 413) and "limits.max_items_per_push" in str(e)


def test_deregistration_reason_defaults_to_finished():
    assert protocol.parse_deregistration({"job_id": "j", "rank": 0, "pid": 7}).reason == "finished"
