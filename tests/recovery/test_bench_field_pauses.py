"""bench_field_pauses reads the watchdog's verdicts from the sidecar's own log lines and incidents, and
gives each to the pause it fell in (or to none), and each hang its detection times."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from bench.bench_field_pauses import hang_rows, pause_rows
from bench.field.job import Result, Setting, Spec, read_events

T0 = 1_800_000_000.0


def stamp(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def line(t: float, text: str, level: str = "INFO", name: str = "sidecar.watchdog.machine") -> str:
    return f"{stamp(t)} {level} {name}: {text}"


def transition(t: float, rank: int, old: str, new: str) -> str:
    return line(t, f"rank job-1/{rank} (pid {100 + rank}): {old} -> {new}: 2.5s without progress, timeout 5.0s (steps)")


def result(tmp_path: Path, lines: list[str], records: list[dict], incidents: list[dict], hangs=()) -> Result:
    log = tmp_path / "sidecar.log"
    log.write_text("\n".join(lines) + "\n")
    spec = Spec("monitor", Setting("lowered", 5.0, 8.0), [] if hangs else ["eval", "eval"], list(hangs))
    return Result(spec, records, read_events(log), incidents, 0, 1.0, tmp_path)


def test_verdicts_are_read_from_the_log_with_their_time_and_rank(tmp_path):
    r = result(
        tmp_path,
        [
            transition(T0 + 1, 1, "healthy", "suspect"),
            transition(T0 + 2, 1, "suspect", "stalled"),
            line(
                T0 + 2.2,
                "rank job-1/0 (pid 100): busy, not hung: cpu +2.5s in 2.5s, stack moved",
                "WARNING",
                "sidecar.watchdog.liveness",
            ),  # fmt: skip
            line(
                T0 + 3,
                "job job-1: false alarm: rank 1 progressed again by itself after 9.0s without progress (steps)",
                "WARNING",
                "sidecar.watchdog.shadow",
            ),  # fmt: skip
            transition(T0 + 3, 1, "stalled", "healthy"),
            transition(T0 + 4, 0, "healthy", "gone"),
            "sidecar 0.1.0 listening on http://127.0.0.1:1",
        ],
        [],
        [],
    )
    got = [(round(e.time - T0, 3), e.what, e.rank) for e in r.events]
    assert got == [(1, "suspect", 1), (2, "stalled", 1), (2.2, "busy", 0), (3, "false_alarm", 1), (3, "healthy", 1)]


def test_each_pause_counts_its_verdicts_once_and_the_rest_are_outside(tmp_path):
    records = [
        {"kind": "pause", "pause": "eval", "index": 0, "seconds": 8.0, "time": T0 + 10},
        {"kind": "pause_end", "pause": "eval", "index": 0, "time": T0 + 18},
        {"kind": "pause", "pause": "eval", "index": 1, "seconds": 8.0, "time": T0 + 30},  # killed: no end
    ]
    lines = [
        transition(T0 + 2, 0, "healthy", "suspect"),  # start-up, outside
        transition(T0 + 12.5, 0, "healthy", "suspect"),
        transition(T0 + 12.5, 1, "healthy", "suspect"),
        transition(T0 + 15, 1, "suspect", "stalled"),
        transition(T0 + 20.5, 1, "stalled", "healthy"),  # its return, within the slack
        transition(T0 + 35, 1, "healthy", "stalled"),
    ]
    killed = {"time": T0 + 35, "outcome": "killed", "timeline": [{"event": "sigterm", "time": T0 + 35.1, "ranks": [0]}]}
    spared = {"time": T0 + 15, "outcome": "observe_only", "timeline": []}
    row, outside = pause_rows(result(tmp_path, lines, records, [spared, killed]))
    assert row == {"pauses": 2, "suspect": 1, "stalled": 2, "killed": 1, "not killed: observe_only": 1}
    assert outside == {"suspect": 1}


def test_a_hang_is_timed_from_its_record_to_the_suspect_that_led_to_the_stall_and_the_sigterm(tmp_path):
    records = [
        {"kind": "first_step", "attempt": 0, "rank": 0, "time": T0},
        {"kind": "first_step", "attempt": 0, "rank": 1, "time": T0},
        {"kind": "hang", "hang": "sigstop", "attempt": 0, "rank": 1, "time": T0 + 10},
        {"kind": "first_step", "attempt": 1, "rank": 0, "time": T0 + 19},
        {"kind": "first_step", "attempt": 1, "rank": 1, "time": T0 + 20},
    ]
    lines = [
        transition(T0 + 10.5, 1, "healthy", "suspect"),  # a push that came late: undone at once
        transition(T0 + 11, 1, "suspect", "healthy"),
        transition(T0 + 12.5, 1, "healthy", "suspect"),
        transition(T0 + 15, 1, "suspect", "stalled"),
    ]
    incident = {
        "time": T0 + 15,
        "outcome": "killed",
        "timeline": [{"event": "sigterm", "time": T0 + 15.2, "ranks": [0, 1]}],
    }
    (h,) = hang_rows(result(tmp_path, lines, records, [incident], hangs=["sigstop"]))
    assert (h["hang"], h["outcome"], h["killed"]) == ("sigstop", "killed", True)
    assert [round(h[k], 2) for k in ("suspect", "stalled", "sigterm", "back")] == [2.5, 5.0, 5.2, 10.0]
