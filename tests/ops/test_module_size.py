"""scripts/module_size.py, the module size rule `make lint` checks: a module over the limit fails
unless listed with a cap it has not grown past and the reason it cannot be split; a listed one that
shrank must be lowered or removed; the tree itself keeps the rule."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import module_size  # noqa: E402

WHY = "a generated table of one piece"


def listed(cap: int) -> dict:
    return {"cap": cap, "why": WHY}


def test_a_module_over_the_limit_fails_unless_listed_and_not_grown():
    assert module_size.problems({"a.py": 600}, {}, limit=520) == [
        "a.py: 600 lines, over the 520-line limit: split it along its seams"
    ]
    assert module_size.problems({"a.py": 600}, {"a.py": listed(600)}, limit=520) == []
    assert "grew past its listed 590" in module_size.problems({"a.py": 600}, {"a.py": listed(590)}, limit=520)[0]


def test_a_module_listed_without_the_reason_it_cannot_be_split_fails():
    for entry in (600, {"cap": 600}, {"cap": 600, "why": "  "}, {"why": WHY}):
        found = module_size.problems({"a.py": 600}, {"a.py": entry}, limit=520)
        assert len(found) == 1 and "why it cannot be split" in found[0], (entry, found)


def test_a_listed_module_that_shrank_is_lowered_or_removed_and_a_stale_entry_fails():
    assert "lower its entry to 560" in module_size.problems({"a.py": 560}, {"a.py": listed(600)}, limit=520)[0]
    assert "back under the limit" in module_size.problems({"a.py": 500}, {"a.py": listed(600)}, limit=520)[0]
    assert "no such module" in module_size.problems({}, {"gone.py": listed(700)}, limit=520)[0]
    assert module_size.problems({"small.py": 10}, {}, limit=520) == []


def test_the_tree_keeps_the_rule():
    assert module_size.problems(module_size.sizes(), module_size.allowed()) == []
