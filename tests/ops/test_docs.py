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
