"""`sidecar status`'s go-live section (sidecar/commands/status_golive.py) from a `/v1/status` document:
each check in a row, and a warning repeated under the table, escaped like every printed text."""

from __future__ import annotations

from sidecar.commands.status import render_plain
from sidecar.commands.status_screen import build_screen

WARNING = "rank 3 uses 31.2 GiB, the others 22.0-22.4 GiB (+41%)"


def document() -> dict:
    return {
        "health": "healthy",
        "problems": [],
        "golive": {
            "run-42": {
                "state": "warning",
                "checks": {
                    "ranks_joined": {"state": "ok", "text": "4 of 4 local ranks registered (world size 8)"},
                    "gpu_memory": {"state": "warning", "text": WARNING},
                    "loss": {"state": "pending", "text": "at step 20 of 1-50"},
                    "evil": {"state": "ok", "text": "\x1b[2Jcleared"},
                },
            },
            "junk": "not a job",
        },
    }


def test_the_section_lists_each_check_and_repeats_a_warning_at_a_glance():
    text = render_plain(build_screen(document()))
    assert "Go-live checks" in text
    assert "ranks_joined" in text and "OK" in text and "PENDING" in text
    assert f"WARNING job run-42 gpu_memory: {WARNING}" in text
    assert "\x1b" not in text, "a rank's text is escaped"


def test_no_job_says_so():
    text = render_plain(build_screen({"health": "healthy", "problems": []}))
    assert "no job here" in text
