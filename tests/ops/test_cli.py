"""`sidecar --help` is written for the people who run it: what the program is in one line, then
every subcommand with its own line, and where to read on."""

from __future__ import annotations

from sidecar.cli import SUBCOMMANDS
from tests.ops.helpers import run_cli


def test_help_says_what_the_sidecar_is_and_lists_every_command():
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    usage, description, *rest = out.stdout.split("\n\n")
    assert usage.startswith("usage: sidecar")
    assert "training" in description and "watchdog" in description
    for developer_words in ("console script", "module", "lazily", "add_arguments"):
        assert developer_words not in out.stdout, developer_words
    listed = "\n".join(rest)
    assert all(f"    {name}" in listed for name in SUBCOMMANDS), listed
    assert "sidecar COMMAND --help" in out.stdout


def test_no_command_prints_the_same_help_and_exits_2():
    out = run_cli()
    assert out.returncode == 2 and out.stdout == run_cli("--help").stdout
