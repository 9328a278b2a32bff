"""`make lint`'s module size check: no module of the project over LIMIT lines.

A module past the limit is split along the seams it has. One that has none may be listed in
pyproject.toml's [tool.sidecar.module_size] `over` as `"path" = {cap = N, why = "..."}`: the size
it may not grow past and, in words, why it cannot be split (an entry without a reason fails). The
cap is a ratchet: an entry whose module shrank below it must be lowered, one back under the limit
removed. Tests, fixtures and generated files are not counted.

    python scripts/module_size.py            # exit 1, naming each module, when the rule is broken
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 520
COUNTED = ("sidecar", "trainer_hooks", "sidecar_trainer", "bench", "demo", "harness", "alerts", "dashboards", "scripts")


def sizes(root: Path = ROOT) -> dict[str, int]:
    out = {}
    for top in COUNTED:
        for path in sorted((root / top).rglob("*.py")):
            if "__pycache__" in path.parts or "tests" in path.parts:
                continue
            if path.is_symlink() or any(p.is_symlink() for p in path.relative_to(root).parents if p != Path(".")):
                continue  # sidecar/assets links to the generators: counted where they live
            out[path.relative_to(root).as_posix()] = len(path.read_text().splitlines())
    return out


def allowed(root: Path = ROOT) -> dict[str, object]:
    config = tomllib.loads((root / "pyproject.toml").read_text())
    return dict(config.get("tool", {}).get("sidecar", {}).get("module_size", {}).get("over", {}))


def problems(found: dict[str, int], over: dict[str, object], limit: int = LIMIT) -> list[str]:
    out, caps = [], {}
    for name, entry in sorted(over.items()):
        cap = entry.get("cap") if isinstance(entry, dict) else None
        why = entry.get("why") if isinstance(entry, dict) else None
        if type(cap) is not int or not isinstance(why, str) or not why.strip():
            out.append(f'{name}: listed as {entry!r}: write {{cap = N, why = "why it cannot be split"}}')
        else:
            caps[name] = cap
    for name, lines in sorted(found.items()):
        cap = caps.get(name)
        if cap is None and name not in over and lines > limit:
            out.append(f"{name}: {lines} lines, over the {limit}-line limit: split it along its seams")
        elif cap is not None and lines > cap:
            out.append(f"{name}: {lines} lines, grew past its listed {cap} (limit {limit}): split it, do not grow it")
        elif cap is not None and lines <= limit:
            out.append(f"{name}: {lines} lines, back under the limit: remove it from [tool.sidecar.module_size] over")
        elif cap is not None and lines < cap:
            out.append(f"{name}: {lines} lines, listed at {cap}: lower its entry to {lines}")
    for name in sorted(set(caps) - set(found)):
        out.append(f"{name}: listed in [tool.sidecar.module_size] over, but no such module")
    return out


def main() -> int:
    found = problems(sizes(), allowed())
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
