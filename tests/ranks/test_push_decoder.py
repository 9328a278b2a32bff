"""The push decoder (sidecar/ranks/push.py): every bad field of a batch is refused with its code and
a message that names it, from the bytes on the wire and from parsed values alike, and no body at
all makes it raise anything but a ProtocolError."""

from __future__ import annotations

import copy
import json
import math
import random

import pytest

from sidecar.ranks.push import EventItem, PhaseItem, StepItem, decode_push, parse_push
from sidecar.ranks.refusal import ProtocolError
from trainer_hooks.wire import MAX_COUNT, MAX_PID, MAX_RANK, MAX_TIME, NAME_RE

MAX_ITEMS = 10


def good_batch(nan: bool = True) -> dict:
    """Three good records; `nan`: the step's metrics hold a value sent as text (the second decoder)."""
    batch = {
        "job_id": "run-42",
        "rank": 1,
        "pid": 4242,
        "dropped": 0,
        "session": "s-1",
        "items": [
            {"type": "step", "step": 1, "time": 10.0, "metrics": {"loss": 2.5, "tokens": 512, "acc": "nan"}},
            {"type": "phase", "name": "eval", "action": "start", "time": 11.0, "timeout_seconds": 60},
            {"type": "event", "name": "checkpoint_saved", "time": 12.0, "fields": {"step": 1, "path": "/c/1"}},
        ],
    }
    if not nan:
        del batch["items"][0]["metrics"]["acc"]
    return batch


def with_field(path: tuple, value, nan: bool = True) -> dict:
    """The good batch with the field at `path` set to `value` (deleted when value is ...)."""
    batch = good_batch(nan)
    *parents, last = path
    node = batch
    for key in parents:
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return batch


def refusals(batch: dict) -> list[ProtocolError]:
    """The refusal of the batch's bytes and of its parsed values: they name the same field."""
    found = []
    for decode in (lambda: decode_push(json.dumps(batch).encode(), MAX_ITEMS), lambda: parse_push(batch, MAX_ITEMS)):
        with pytest.raises(ProtocolError) as info:
            decode()
        found.append(info.value)
    assert str(found[0]).split(":")[0] == str(found[1]).split(":")[0] and found[0].code == found[1].code
    return found


BAD_FIELDS = [
    # the envelope
    (("job_id",), ..., "job_id"),
    (("job_id",), "", "job_id"),
    (("job_id",), "x" * 129, "job_id"),
    (("job_id",), "a\x1bb", "job_id"),
    (("job_id",), 42, "job_id"),
    (("job_id",), "incidents", "job_id"),
    (("job_id",), ".hidden", "job_id"),
    (("rank",), ..., "rank"),
    (("rank",), "one", "rank"),
    (("rank",), -1, "rank"),
    (("rank",), MAX_RANK + 1, "rank"),
    (("rank",), 1.5, "rank"),
    (("rank",), True, "rank"),
    (("pid",), 0, "pid"),
    (("pid",), MAX_PID + 1, "pid"),
    (("pid",), None, "pid"),
    (("dropped",), -1, "dropped"),
    (("dropped",), "none", "dropped"),
    (("dropped",), 2.5, "dropped"),
    (("session",), 7, "session"),
    (("session",), "s" * 129, "session"),
    (("items",), ..., "items"),
    (("items",), {"type": "step"}, "items"),
    (("items",), None, "items"),
    (("items", 2), "step", "items[2]"),
    # a record's kind
    (("items", 0, "type"), ..., "items[0].type"),
    (("items", 0, "type"), "metric", "items[0].type"),
    (("items", 1, "type"), 3, "items[1].type"),
    # step records
    (("items", 0, "step"), ..., "items[0].step"),
    (("items", 0, "step"), -3, "items[0].step"),
    (("items", 0, "step"), 1.5, "items[0].step"),
    (("items", 0, "step"), MAX_COUNT + 1, "items[0].step"),
    (("items", 0, "step"), "7", "items[0].step"),
    (("items", 0, "step"), False, "items[0].step"),
    (("items", 0, "time"), "now", "items[0].time"),
    (("items", 0, "time"), -1, "items[0].time"),
    (("items", 0, "time"), MAX_TIME, "items[0].time"),
    (("items", 0, "time"), True, "items[0].time"),
    (("items", 0, "metrics"), [1.0], "items[0].metrics"),
    (("items", 0, "metrics"), {"bad name": 1.0}, "items[0].metrics"),
    (("items", 0, "metrics"), {"\x1b[2J": 1.0}, "items[0].metrics"),
    (("items", 0, "metrics", "loss"), "high", "items[0].metrics.loss"),
    (("items", 0, "metrics", "loss"), [1], "items[0].metrics.loss"),
    (("items", 0, "metrics", "loss"), True, "items[0].metrics.loss"),
    (("items", 0, "metrics", "loss"), None, "items[0].metrics.loss"),
    (("items", 0, "metrics", "tokens"), 10**400, "items[0].metrics.tokens"),
    # phase records
    (("items", 1, "name"), ..., "items[1].name"),
    (("items", 1, "name"), "bad phase!", "items[1].name"),
    (("items", 1, "name"), "", "items[1].name"),
    (("items", 1, "name"), "p" * 129, "items[1].name"),
    (("items", 1, "action"), ..., "items[1].action"),
    (("items", 1, "action"), "pause", "items[1].action"),
    (("items", 1, "time"), "soon", "items[1].time"),
    (("items", 1, "timeout_seconds"), 0, "items[1].timeout_seconds"),
    (("items", 1, "timeout_seconds"), -1, "items[1].timeout_seconds"),
    (("items", 1, "timeout_seconds"), 1e9, "items[1].timeout_seconds"),
    (("items", 1, "timeout_seconds"), "1h", "items[1].timeout_seconds"),
    # event records
    (("items", 2, "name"), ..., "items[2].name"),
    (("items", 2, "name"), "9lives", "items[2].name"),
    (("items", 2, "time"), {}, "items[2].time"),
    (("items", 2, "fields"), "no", "items[2].fields"),
    (("items", 2, "fields"), [1, 2], "items[2].fields"),
    (("items", 2, "fields"), {f"f{i}": i for i in range(17)}, "items[2].fields"),
]


@pytest.mark.parametrize("nan", [False, True], ids=["numbers only", "a metric as text"])
@pytest.mark.parametrize(
    "path, value, named", BAD_FIELDS, ids=[f"{n}={'absent' if v is ... else repr(v)[:20]}" for _, v, n in BAD_FIELDS]
)
def test_each_bad_field_is_refused_by_name(path, value, named, nan):
    error = refusals(with_field(path, value, nan))[0]
    assert (error.code, error.status) == ("bad_field", 400)
    message = str(error)
    assert message.startswith(named + ":") or message.startswith(named + " "), message
    assert len(message.split(":", 1)[1].strip()) > 5, message  # and says what is wrong with it


def test_too_many_records_are_too_large():
    batch = good_batch()
    batch["items"] = [{"type": "step", "step": i + 1} for i in range(MAX_ITEMS + 1)]
    error = refusals(batch)[0]
    assert (error.code, error.status) == ("too_large", 413) and "limits.max_items_per_push" in str(error)


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"null", b"{", b"", b"\xff\xfe", b"[" * 100_000])
def test_a_body_that_is_no_json_object_is_bad_json(body):
    with pytest.raises(ProtocolError) as info:
        decode_push(body, MAX_ITEMS)
    assert info.value.code == "bad_json"


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity"])
def test_a_bare_non_finite_token_is_named_as_strict_json_does(token):
    body = json.dumps(good_batch()).encode().replace(b"2.5", token)
    with pytest.raises(ProtocolError) as info:
        decode_push(body, MAX_ITEMS)
    assert info.value.code == "bad_json" and token.decode().lstrip("-") in str(info.value)


def test_a_body_that_is_no_strict_json_is_bad_json_whatever_the_schema_refused_first():
    """msgspec checks types while it parses: a bad field before the break must not hide it."""
    body = json.dumps(with_field(("rank",), "one")).encode()
    for broken in (body[:-1], body.replace(b"2.5", b"NaN"), body.replace(b'"s-1"', b'"s-1\\q"')):
        with pytest.raises(ProtocolError) as info:
            decode_push(broken, MAX_ITEMS)
        assert info.value.code == "bad_json", broken


def test_text_that_is_no_utf8_is_bad_json_even_in_an_unknown_field():
    """msgspec skips an unknown field without reading its text; JSON never took such a body."""
    body = json.dumps(good_batch() | {"note": "x"}).encode().replace(b'"x"', b'"\xff"')
    with pytest.raises(ProtocolError) as info:
        decode_push(body, MAX_ITEMS)
    assert info.value.code == "bad_json"


def test_a_number_past_a_double_is_infinite_where_a_field_takes_it_as_before():
    """JSON reads 1e400 as inf: a metric (a non-finite value) and an event's field keep it; a time
    refuses it by name."""
    body = json.dumps(good_batch()).encode().replace(b"2.5", b"1e400").replace(b'"path": "/c/1"', b'"size": 1e400')
    step, _, event = decode_push(body, MAX_ITEMS).items
    assert step.metrics["loss"] == math.inf and event.fields["size"] == math.inf
    with pytest.raises(ProtocolError) as info:
        decode_push(body.replace(b"10.0", b"1e400"), MAX_ITEMS)
    assert info.value.code == "bad_field" and str(info.value).startswith("items[0].time:")


def test_metrics_sent_as_text_arrive_as_floats_in_step_records():
    batch = good_batch(nan=False)
    batch["items"][0]["metrics"] |= {"a": "inf", "b": "-inf", "c": "NaN", "d": "+Inf"}
    step = decode_push(json.dumps(batch).encode(), MAX_ITEMS).items[0]
    assert type(step) is StepItem and all(type(v) is float for v in step.metrics.values())
    assert (step.metrics["a"], step.metrics["b"], step.metrics["d"]) == (math.inf, -math.inf, math.inf)
    assert math.isnan(step.metrics["c"]) and step.metrics["loss"] == 2.5


def test_unknown_fields_are_ignored_as_before():
    batch = good_batch() | {"from_newer_hooks": {"x": 1}}
    batch["items"][0]["unit"] = "tokens"
    assert len(decode_push(json.dumps(batch).encode(), MAX_ITEMS).items) == 3


def test_integral_floats_are_integers_and_absent_parts_take_their_defaults():
    batch = with_field(("rank",), 1.0)
    batch["items"] = [{"type": "step", "step": 3.0, "time": None, "metrics": None}, {"type": "event", "name": "e"}]
    push = decode_push(json.dumps(batch).encode(), MAX_ITEMS)
    step, event = push.items
    assert (push.rank, type(push.rank), step.step, type(step.step)) == (1, int, 3, int)
    assert step.metrics == {} and event.fields == {} and type(step.time) is float and step.time == event.time


def test_a_lone_surrogate_takes_the_standard_librarys_parse_to_the_same_checks():
    """msgspec refuses lone surrogates as malformed; JSON allows the escape, as the sidecar did
    before: the body is parsed again and checked through the same types."""
    batch = good_batch()
    batch["items"][2]["fields"]["path"] = "/ckpt/\udcff"  # a path the hooks read with surrogateescape
    event = decode_push(json.dumps(batch).encode(), MAX_ITEMS).items[2]
    assert event.fields["path"] == "/ckpt/\udcff"
    batch["items"][1]["name"] = "eval\ud800"
    with pytest.raises(ProtocolError) as info:
        decode_push(json.dumps(batch).encode(), MAX_ITEMS)
    assert info.value.code == "bad_field" and str(info.value).startswith("items[1].name:")


# ---------------------------------------------------------------- random mutations

ODD_VALUES = [None, True, False, 0, -1, 1.5, 3.0, 1e308, 2**63, 2**64, -(2**70), "", "nan", "INF", "x" * 200,
              "\x1b[2J", "\u202e", "\ud800", "step", "phase", "event", "start", [], [1, "a"], {},
              {"type": "step"}]  # fmt: skip


def mutate(rng: random.Random, value):
    """One random change somewhere in a parsed batch: a value replaced, a key dropped or added."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(list(value))
        roll = rng.random()
        if roll < 0.15:
            del value[key]
        elif roll < 0.25:
            value[rng.choice(["type", "step", "x", "bad name", "time"])] = rng.choice(ODD_VALUES)
        elif roll < 0.55:
            value[key] = copy.deepcopy(rng.choice(ODD_VALUES))
        else:
            value[key] = mutate(rng, value[key])
        return value
    if isinstance(value, list) and value and rng.random() < 0.7:
        i = rng.randrange(len(value))
        value[i] = mutate(rng, value[i]) if rng.random() < 0.6 else copy.deepcopy(rng.choice(ODD_VALUES))
        return value
    return copy.deepcopy(rng.choice(ODD_VALUES))


def scramble(rng: random.Random, body: bytes) -> bytes:
    """Bytes changed, dropped or repeated at random places."""
    data = bytearray(body)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(data)) if data else 0
        roll = rng.random()
        if roll < 0.4 and data:
            data[i] = rng.randrange(256)
        elif roll < 0.7 and data:
            del data[i]
        else:
            data[i:i] = rng.choice([b"{", b"]", b'"', b"\\u", b",", b"NaN", b"1e999", b"\\ud800", b"-"])
    return bytes(data)


def check_accepted(push) -> None:
    """What every reader of a push relies on, whatever the body was."""
    assert isinstance(push.job_id, str) and type(push.rank) is int and 0 <= push.rank <= MAX_RANK
    assert type(push.pid) is int and 1 <= push.pid <= MAX_PID and type(push.dropped) is int
    for item in push.items:
        assert type(item.time) is float and 0 <= item.time < MAX_TIME
        if type(item) is StepItem:
            assert type(item.step) is int and 0 <= item.step <= MAX_COUNT
            assert all(NAME_RE.match(k) and type(v) is float for k, v in item.metrics.items())
        elif type(item) is PhaseItem:
            assert NAME_RE.match(item.name) and item.action in ("start", "end")
            assert item.timeout_seconds is None or math.isfinite(item.timeout_seconds)
        else:
            assert type(item) is EventItem and NAME_RE.match(item.name) and isinstance(item.fields, dict)


def strict_json(body: bytes) -> bool:
    def refuse(token):
        raise ValueError(token)

    try:
        json.loads(body, parse_constant=refuse)
    except (ValueError, RecursionError):
        return False
    return True


def outcome(decode, body) -> str:
    try:
        check_accepted(decode(body, MAX_ITEMS))
    except ProtocolError as e:
        assert e.code in ("bad_json", "bad_field", "too_large") and str(e), e
        return e.code
    return "accepted"


def test_random_mutations_of_a_good_batch_raise_only_protocol_errors():
    rng = random.Random(46)
    seen = set()
    for _ in range(3000):
        batch = good_batch(nan=rng.random() < 0.5)
        for _ in range(rng.randint(1, 3)):
            batch = mutate(rng, batch)
        body = json.dumps(batch).encode()
        by_bytes = outcome(decode_push, body)
        if isinstance(batch, dict):  # the bytes and the parsed values are judged alike
            assert outcome(parse_push, batch) == by_bytes, body
        seen.add(by_bytes)
        scrambled = scramble(rng, body)
        by_scrambled = outcome(decode_push, scrambled)
        assert by_scrambled == "bad_json" or strict_json(scrambled), scrambled
    assert seen >= {"accepted", "bad_field", "bad_json"}
