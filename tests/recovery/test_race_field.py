"""bench_race --field's own judgement (bench/race_field.py): which restarts were false kills and
which pause each cut, the settings each side runs at, and the code change the sections API takes.
The race itself runs in `make bench` (minutes per run)."""

from __future__ import annotations

import ast
from pathlib import Path

from bench import race_field
from harness.cluster import AGENTS
from sidecar.config import Settings


def rec(kind: str, rank: int, t: float, **fields) -> dict:
    return {"kind": kind, "rank": rank, "time": t, **fields}


def pause(kind: str, start: float, end: float | None, ranks: int = 2) -> list[dict]:
    out = [rec("pause", r, start, pause=kind, step=30) for r in range(ranks)]
    if end is not None:
        out += [rec("pause_end", r, end, pause=kind, step=30) for r in range(ranks)]
    return out


def firsts(t: float, ranks: int = 2) -> list[dict]:
    return [rec("first_step", r, t + 0.01 * r) for r in range(ranks)]


def test_the_one_restart_a_hang_needs_is_no_false_kill():
    recs = [*firsts(10), *pause("eval", 12, 32), rec("hang", 1, 40), *firsts(45)]
    assert race_field.false_kills(recs, 40) == []


def test_a_restart_inside_a_pause_is_a_false_kill_named_by_that_pause():
    recs = [*firsts(10), *pause("eval", 12, None), *firsts(30)]  # killed mid-eval: it never ended
    assert race_field.false_kills(recs, None) == ["eval"]


def test_restarts_beyond_the_hangs_are_false_kills_outside_any_pause_named_training():
    recs = [*firsts(10), *pause("checkpoint", 12, 22), rec("hang", 1, 40), *firsts(45), *firsts(50), *firsts(55)]
    assert race_field.false_kills(recs, 40) == ["training", "training"]


def test_a_false_kill_before_the_hang_leaves_the_hangs_own_restart_counted_once():
    recs = [*firsts(10), *pause("data", 12, None), *firsts(20), rec("hang", 1, 40), *firsts(45)]
    assert race_field.false_kills(recs, 40) == ["data"]


def test_the_shipped_setting_is_the_sidecars_own_defaults_and_the_lowered_one_changes_the_floor(tmp_path: Path):
    d = Settings()
    a = race_field.spec_for("a", [1, 1, 1], "stop", 2.0, "/nvrx", tmp_path)
    assert a.sidecar.floor_seconds == d.watchdog.floor_seconds == 30.0
    assert a.sidecar.grace_seconds == d.remediation.grace_seconds
    assert f"watchdog.check_interval_seconds={d.watchdog.check_interval_seconds}" in a.sidecar.extra
    b = race_field.spec_for("b", [1, 1, 1], "stop", 2.0, "/nvrx", tmp_path)
    assert b.sidecar.floor_seconds == 2.0 and b.launcher == AGENTS["warm"][0]
    # the hang is on the middle node's last rank only
    assert [n.env.get("CYCLE_HANGS") for n in b.nodes] == [None, "1", None]


def test_nvrx_runs_just_above_the_longest_pause_with_the_same_cadence_and_grace(tmp_path: Path):
    c = race_field.spec_for("c", [2], "spin", 2.0, "/nvrx", tmp_path)
    longest = max(race_field.DATA_SECONDS, race_field.EVAL_SECONDS, race_field.CKPT_SECONDS)
    assert longest < race_field.NVRX_TIMEOUT <= longest + 5
    assert f"--ft-rank-heartbeat-timeout={race_field.NVRX_TIMEOUT}" in c.agent_args
    assert f"--ft-workload-check-interval={race_field.CHECK}" in c.agent_args and not c.with_sidecars
    d = race_field.spec_for("d", [2], "spin", 2.0, "/nvrx", tmp_path)
    assert d.script == race_field.SECTIONS_SCRIPT
    sections = next(a for a in d.agent_args if a.startswith("--ft-rank-section-timeouts="))
    assert {s.split(":")[0] for s in sections.split("=", 1)[1].split(",")} == {
        "setup", "data", "step", "eval", "checkpointing"}  # fmt: skip


def test_the_sections_script_is_the_plain_one_plus_the_change_a_user_makes():
    for script in (race_field.SCRIPT, race_field.SECTIONS_SCRIPT):
        ast.parse(script.read_text())
    plain, sections = race_field.SCRIPT.read_text(), race_field.SECTIONS_SCRIPT.read_text()
    assert "start_section" not in plain and "send_heartbeat" in plain
    for call in ("start_section", "end_section", "calculate_and_set_section_timeouts", "load_state_dict"):
        assert call in sections
    added, removed = (int(x) for x in race_field.code_change().replace("+", "").replace("-", "").split()[:2])
    assert added > 20 and removed > 5


def test_training_again_is_the_last_rank_back_after_the_hang_and_none_until_all_are():
    from bench.bench_race import training_again

    recs = [*firsts(10, ranks=3), rec("hang", 1, 40), rec("first_step", 0, 45), rec("first_step", 2, 46)]
    assert training_again(recs, 40, 3) is None  # rank 1 not back yet
    recs.append(rec("first_step", 1, 47.5))
    assert training_again(recs, 40, 3) == 7.5
