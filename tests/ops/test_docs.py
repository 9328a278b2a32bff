"""The operator guide's links lead somewhere: files exist, runbook anchors name real sections."""

from __future__ import annotations

import re

from tests.support import ROOT

GUIDE = ROOT / "docs" / "operator-guide.md"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def test_every_link_of_the_operator_guide_resolves():
    text = GUIDE.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith("http"):
            continue
        file, _, anchor = target.partition("#")
        path = GUIDE.parent / file if file else GUIDE
        if not path.exists():
            broken.append(target)
        elif anchor and anchor not in _anchors(path):
            broken.append(target)
    assert broken == []


def test_every_relative_link_of_every_doc_resolves():
    """README, CONTRIBUTING and docs/ (its pages in docs/architecture/ too): files exist, anchors name headings."""
    docs = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for doc in docs:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http", "mailto")):
                continue
            file, _, anchor = target.partition("#")
            path = doc.parent / file if file else doc
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_guide_links_the_runbook_for_each_troubleshooting_case():
    section = GUIDE.read_text().split("## Troubleshooting", 1)[1]
    for case in (
        "Rendezvous or communication timeouts",
        "Out of memory",
        "Silent hangs",
        "A node that fails its restart",
    ):
        body = section.split(f"### {case}", 1)[1].split("\n### ", 1)[0]
        assert "runbook.md#" in body, case


# A Python file of the repository, named from one of its top-level directories (not the tail of
# a longer path such as `/run/sidecar/...`); `{a,b}` stands for both names, as in a shell.
SOURCE_PATH = re.compile(
    r"(?<![\w./~-])((?:sidecar|trainer_hooks|trainer|tests|alerts|dashboards|bench|demo|harness|scripts|packaging|examples)"
    r"/[\w./{},-]*?\.py)\b"
)


def _expand(path: str) -> list[str]:
    found = re.search(r"\{([^{}]*)\}", path)
    if not found:
        return [path]
    return [p for alt in found[1].split(",") for p in _expand(path[: found.start()] + alt + path[found.end() :])]


def test_every_python_file_the_docs_name_exists():
    docs = [ROOT / "README.md", *ROOT.glob("CONTRIBUTING.md"), *sorted((ROOT / "docs").rglob("*.md"))]
    missing = [
        f"{doc.relative_to(ROOT)}: {path}"
        for doc in docs
        for named in SOURCE_PATH.findall(doc.read_text())
        for path in _expand(named)
        if not (ROOT / path).is_file()
    ]
    assert missing == []
