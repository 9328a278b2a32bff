"""docs/changes-to-others.md names every place the hooks and the bundled trainer change another
project's behaviour (issue 31, item 11): each such construct in trainer_hooks/ and
sidecar_trainer/ carries a `# changes: <id>` marker on or at most three lines above it, each
marker's id is a row of the table, and each row still has a marker in the code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "changes-to-others.md"
SCANNED = ("trainer_hooks", "sidecar_trainer")
MARKER = re.compile(r"#\s*changes:\s*([\w-]+)")
ABOVE = 3

# What changes another project's behaviour from inside the training process: an attribute or a
# handler table of another module replaced, a hook or callback registered with torch or Python,
# a finder on sys.meta_path, a signal handler, an environment variable of another library set, a
# module loaded and run in another's place.
CONSTRUCTS = {
    "setattr": re.compile(r"\bsetattr\("),
    "handler table": re.compile(r"\bhandlers\[[^\]]+\]\s*="),
    "python hook": re.compile(r"\b(sys|threading)\.(excepthook|displayhook|settrace|setprofile|breakpointhook)\s*="),
    "import system": re.compile(r"\bsys\.(meta_path|path_hooks)\b.*(\.insert\(|\.append\(|\[:\]\s*=)"),
    "signal": re.compile(r"\b(faulthandler\.register|signal\.signal|signal\.setitimer)\("),
    "torch hook": re.compile(r"\bregister_\w*(hook|callback)\("),
    "environment": re.compile(
        r"""(environ|env)(\[\s*(["'](?!SIDECAR_)[A-Z][A-Z0-9_]*["']|[A-Z][A-Z0-9_]*_ENV)\s*\]\s*=|"""
        r"""\.setdefault\(\s*["'](?!SIDECAR_)[A-Z][A-Z0-9_]*["'])"""
    ),
    "module run": re.compile(r"\bexec_module\("),
}


def table_ids() -> set[str]:
    return set(re.findall(r"^\| `([\w-]+)` \|", TABLE.read_text(), re.MULTILINE))


def sources() -> list[Path]:
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


# What a script runner sets as the interpreter would for the script it runs (`python script.py`):
# the script's own argv, not a change to another project.
RUNNER_SETS = frozenset({"sys.argv"})


def module_attributes(text: str) -> set[int]:
    """Lines that assign an attribute of an imported module (`dynamic_rendezvous._delay = f`) or a
    class's dunder method (`holder.__init__ = f`): another project's function replaced in place."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return set()
    imported = {
        (alias.asname or alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    lines = set()
    for node in ast.walk(tree):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        for t in targets:
            if not isinstance(t, ast.Attribute):
                continue
            dunder = t.attr.startswith("__") and t.attr.endswith("__") and t.attr != "__wrapped__"
            module = isinstance(t.value, ast.Name) and t.value.id in imported
            if module and isinstance(t.value, ast.Name) and f"{t.value.id}.{t.attr}" in RUNNER_SETS:
                continue
            if dunder or module:
                lines.add(t.lineno)
    return lines


def find_changes(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, construct, the marker's id or None) for every construct in `text`."""
    lines = text.splitlines()
    assigned = module_attributes(text)
    found = []
    for i, line in enumerate(lines):
        code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        kinds = [name for name, pattern in CONSTRUCTS.items() if pattern.search(code)]
        if i + 1 in assigned:
            kinds.append("module attribute")
        for name in kinds:
            if name != "module attribute" and ("def " in code or "import " in code):
                continue
            marker = None
            for j in range(i, max(-1, i - ABOVE - 1), -1):
                m = MARKER.search(lines[j])
                if m:
                    marker = m.group(1)
                    break
            found.append((i + 1, name, marker))
    return found


def test_every_change_to_another_project_is_marked_and_in_the_table():
    ids = table_ids()
    assert len(ids) >= 10, ids
    unmarked, unknown = [], []
    for path in sources():
        for line, name, marker in find_changes(path.read_text()):
            where = f"{path.relative_to(ROOT)}:{line} ({name})"
            if marker is None:
                unmarked.append(where)
            elif marker not in ids:
                unknown.append(f"{where}: {marker}")
    assert not unmarked, "changes to other projects without a `# changes: <id>` marker: " + ", ".join(unmarked)
    assert not unknown, "markers naming no row of docs/changes-to-others.md: " + ", ".join(unknown)


def test_every_row_of_the_table_is_still_in_the_code():
    used = {m for path in sources() for m in MARKER.findall(path.read_text())}
    assert table_ids() - used == set(), "rows whose change is gone from the code: " + ", ".join(table_ids() - used)


def test_the_scan_finds_each_kind_of_change_and_its_marker():
    """The scan itself: each construct is found, with and without a marker, and plain code is not."""
    text = "\n".join(
        [
            "setattr(torch, 'save', wrapper)",
            "# changes: stack-signal (docs/changes-to-others.md)",
            "faulthandler.register(signum, file=f)",
            "sys.excepthook = hook",
            "sys.meta_path.insert(0, Finder())",
            "handlers[scheme] = wrap(current)",
            "register_optimizer_step_post_hook(cb)",
            'os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")',
            "env[BUFFER_ENV] = '64'",
            'os.environ.setdefault("SIDECAR_ATTACHED_PID", "1")',  # our own variable: not a change
            "spec.loader.exec_module(module)",
            "x = getattr(torch, 'save')",
            "from torch.distributed.elastic.rendezvous import dynamic_rendezvous",
            "dynamic_rendezvous._delay = fast",
            "holder.__init__ = init",
            "self.count = 1",  # an object's own attribute: not a change
        ]
    )
    found = find_changes(text)
    assert [(line, name) for line, name, _ in found] == [
        (1, "setattr"), (3, "signal"), (4, "python hook"), (5, "import system"), (6, "handler table"),
        (7, "torch hook"), (8, "environment"), (9, "environment"), (11, "module run"), (14, "module attribute"),
        (15, "module attribute"),
    ]  # fmt: skip
    markers = {line: marker for line, _, marker in found}
    assert markers[3] == "stack-signal" and markers[4] == "stack-signal"  # within three lines above
    assert markers[1] is None and markers[9] is None
