"""`sidecar status`: this node's health on one screen, read from the daemon's `/v1/status`.

The exit status is the verdict (`sidecar.commands.verdict`), so node checks and scripts need not parse
anything: 0 healthy, 1 degraded (a rank suspect, stalled or remediating, a failing collector,
an unfit node, any problem the daemon reports), 2 no answer or a broken one. `--check node` asks
only whether the node is fit (sidecar/fitness.py) and answers in one line, with exit status 0
fit, 1 unfit, 2 unknown: node-problem-detector's custom-plugin protocol, which turns it into a
NodeCondition (deploy/kubernetes/components/node-problem-detector). On a terminal the screen is drawn
with `rich`; piped, it is plain aligned text without escape codes. The daemon is reached with
`sidecar.commands.client`.

Much of the document is text that ranks and peers wrote (job ids, phases, a coordinator's verdict:
its job incident id, the culprit's node, reasons; incident summaries quoting them): every string
printed, in every mode, goes through `safetext.printable`, so no escape sequence, C1 control or
bidirectional override reaches the terminal raw (issue 28, row 8). `--json` needs nothing:
`json.dumps` escapes every control and non-ASCII character. The culprit's stack frame is not in
`/v1/status` (every local user reads it); the screen names the culprit and points to
`sidecar incidents --job`, root's, for the frame.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from sidecar.commands.client import (
    DEFAULT_TIMEOUT_SECONDS,
    Endpoint,
    StatusError,
    Unreachable,
    fetch_json,
    resolve_endpoint,
    with_credentials,
)
from sidecar.commands.status_screen import (  # noqa: F401  (build_screen and the model: tests import them from here)
    Cell,
    Screen,
    Section,
    build_screen,
)
from sidecar.commands.verdict import (
    EXIT_DEGRADED,
    EXIT_HEALTHY,
    EXIT_UNREACHABLE,
    Verdict,
    assess,
    dict_at,
)
from sidecar.config import DEFAULT_SOCKET
from sidecar.safetext import printable


def safe(screen: Screen) -> Screen:
    """The screen with every text escaped (safetext.printable): what ranks and peers wrote, and
    the rest alike, so that no field is ever printed raw; before widths are measured."""
    return Screen(
        [Cell(printable(c.text), c.style) for c in screen.headline],
        [(printable(k), printable(v)) for k, v in screen.facts],
        [
            Section(
                printable(s.title),
                [printable(c) for c in s.columns],
                [[Cell(printable(c.text), c.style) for c in row] for row in s.rows],
                printable(s.empty),
                [printable(n) for n in s.notes],
            )
            for s in screen.sections
        ],
        [printable(p) for p in screen.problems],
        screen.exit_code,
    )


def render_plain(screen: Screen) -> str:
    """Aligned text without escape codes, for pipes, logs and grep."""
    screen = safe(screen)
    out = ["  ".join(c.text for c in screen.headline)]
    out.append("  ".join(f"{k}: {v}" for k, v in screen.facts))
    if screen.problems:
        out.append("Problems:")
        out.extend(f"  - {p}" for p in screen.problems)
    else:
        out.append("Problems: none")
    for s in screen.sections:
        out.append("")
        if not s.rows:
            out.append(f"{s.title}: {s.empty}")
            continue
        out.append(f"{s.title}:")
        table = [s.columns] + [[c.text for c in row] for row in s.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(s.columns))]
        for row in table:
            out.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        out.extend(f"  {n}" for n in s.notes)
    return "\n".join(out) + "\n"


def render_rich(screen: Screen):
    """A rich renderable of the screen (tables with colours)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    screen = safe(screen)  # rich strips a few C0 controls itself, never ESC, C1 or bidi
    parts: list[Any] = []
    headline = Text()
    for i, c in enumerate(screen.headline):
        headline.append(("   " if i else "") + c.text, style=c.style)
    parts.append(headline)
    facts = Text()
    for i, (k, v) in enumerate(screen.facts):
        facts.append(("  " if i else "") + k + " ", style="dim")
        facts.append(v)
    parts.append(facts)
    if screen.problems:
        problems = Text("Problems:", style="bold red")
        for p in screen.problems:
            problems.append(f"\n  - {p}", style="red")
        parts.append(problems)
    else:
        parts.append(Text("Problems: none", style="green"))
    for s in screen.sections:
        if not s.rows:
            parts.append(Text.assemble((f"\n{s.title}: ", "bold"), (s.empty, "dim")))
            continue
        table = Table(
            title=Text(s.title, style="bold"),  # a Text: a str title would be read as rich markup
            title_justify="left",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            expand=False,
        )
        for col in s.columns:
            table.add_column(Text(col), overflow="fold")
        for row in s.rows:
            table.add_row(*(Text(c.text, style=c.style) for c in row))
        parts.append(table)
        parts.extend(Text(f"  {n}", style="dim") for n in s.notes)
    return Group(*parts)


# ---------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "exit status: 0 healthy, 1 degraded (a rank suspect/stalled/remediating, a failing "
        "collector, an unfit node, any problem), 2 no sidecar or a broken answer; "
        "with --check node: 0 fit, 1 unfit, 2 unknown"
    )
    parser.add_argument("--socket", help=f"the sidecar's Unix socket (also SIDECAR_SOCKET; default {DEFAULT_SOCKET})")
    parser.add_argument("--url", help="the sidecar's HTTP address, e.g. http://127.0.0.1:9402 (also SIDECAR_URL)")
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="send the token in FILE as `Authorization: Bearer` to --url (a proxy in front of the sidecar, "
        "such as components/kube-rbac-proxy's; read at every request)",
    )
    parser.add_argument(
        "--cacert",
        metavar="FILE",
        help="verify an https --url's certificate with the CA certificates in FILE (PEM) instead of the system's",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print {exit_code, problems, target, status} as JSON (status: the raw /v1/status)",
    )
    parser.add_argument(
        "--check",
        choices=["node"],
        help="node: print one line saying whether this node can run a job (what outlives jobs: unkillable "
        "processes, GPUs held or missing) and exit 0 fit, 1 unfit, 2 unknown (node-problem-detector's "
        "custom-plugin protocol)",
    )
    parser.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        help=f"seconds to wait for the sidecar (default {DEFAULT_TIMEOUT_SECONDS:g})",
    )


@dataclass
class Reading:
    """One look at the sidecar: its status document or why there is none."""

    endpoint: Endpoint
    status: dict | None = None
    error: str | None = None
    verdict: Verdict = field(default_factory=lambda: Verdict(EXIT_UNREACHABLE))

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    def as_json(self) -> dict:
        return {
            "exit_code": self.exit_code,
            "problems": self.verdict.problems,
            "error": self.error,
            "target": str(self.endpoint),
            "status": self.status,
        }


def read(endpoint: Endpoint, timeout: float) -> Reading:
    try:
        status = fetch_json(endpoint, "/v1/status", timeout)
    except StatusError as e:
        message = str(e)
        if isinstance(e, Unreachable):
            message += f"; is `sidecar run` running? try {endpoint.alternative}"
        return Reading(endpoint, error=message)
    return Reading(endpoint, status, verdict=assess(status))


def _show(reading: Reading, args: argparse.Namespace, console) -> None:
    if args.json:
        print(json.dumps(reading.as_json()), flush=True)  # ensure_ascii: every control escaped
    elif reading.error or reading.status is None:
        print(printable(f"sidecar status: {reading.error}"), file=sys.stderr, flush=True)
    elif console is not None:
        console.print(render_rich(build_screen(reading.status)))
    else:
        sys.stdout.write(render_plain(build_screen(reading.status)))
        sys.stdout.flush()


def _rich_console():
    """A rich console when stdout is a terminal, else None: plain text (rich itself honours NO_COLOR)."""
    if not sys.stdout.isatty():
        return None
    from rich.console import Console

    return Console()


def _watch(endpoint: Endpoint, args: argparse.Namespace, console) -> int:
    interval = max(0.2, args.watch)
    if console is None or args.json:
        while True:
            _show(read(endpoint, args.timeout), args, console)
            if not args.json:
                print("-" * 40, flush=True)
            time.sleep(interval)
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    def frame():
        reading = read(endpoint, args.timeout)
        stamp = Text(f"every {interval:g}s, {datetime.datetime.now():%H:%M:%S}; Ctrl-C to quit", style="dim")
        if reading.status is None:
            return Text.assemble(stamp, "\n", (printable(f"sidecar status: {reading.error}"), "bold red"))
        return Group(stamp, render_rich(build_screen(reading.status)))

    # The alternate screen, like watch(1): a frame taller than the terminal is cropped at the
    # bottom, where the least urgent sections are (the problems come first).
    with Live(frame(), console=console, auto_refresh=False, screen=True) as live:
        while True:
            time.sleep(interval)
            live.update(frame(), refresh=True)


MAX_CHECK_LINE = 512  # node-problem-detector keeps max_output_length of it as the condition's message


def node_check(reading: Reading) -> tuple[int, str]:
    """`--check node`: (exit status, the one line), the reasons first (a cut line keeps them);
    escaped (safetext.printable): findings quote process and cgroup names."""
    if reading.status is None:
        return EXIT_UNREACHABLE, printable(" ".join(f"unknown: {reading.error}".split()))
    unfit = reading.verdict.unfit
    if not unfit:
        return EXIT_HEALTHY, "fit"
    reasons = ", ".join(str(r) for r in dict_at(reading.status, "fitness").get("reasons") or ["?"])
    line = printable(f"unfit ({reasons}): " + "; ".join(unfit))
    return EXIT_DEGRADED, " ".join(line.split())[:MAX_CHECK_LINE]


def main(args: argparse.Namespace) -> int:
    try:
        endpoint = with_credentials(resolve_endpoint(args.socket, args.url), args.token_file, args.cacert)
    except StatusError as e:
        print(printable(f"sidecar status: {e}"), file=sys.stderr, flush=True)
        return EXIT_UNREACHABLE
    if args.check == "node":
        code, line = node_check(read(endpoint, args.timeout))
        print(line, flush=True)
        return code
    console = None if args.json else _rich_console()
    if args.watch is not None:
        try:
            return _watch(endpoint, args, console)
        except KeyboardInterrupt:
            return EXIT_HEALTHY
    reading = read(endpoint, args.timeout)
    try:
        _show(reading, args, console)
    except BrokenPipeError:  # `sidecar status | head`: the reader left early, the verdict stands
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return reading.exit_code
