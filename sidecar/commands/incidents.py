"""`sidecar incidents`: the incident records of a diagnostics directory, newest first (a table,
`--full` summaries or `--json`).

Which directory: `--diag-dir`; else the running daemon's, as its `/v1/status` names it (found as
`sidecar status` finds it: `--socket`/`--url`, SIDECAR_SOCKET/SIDECAR_URL, the settings' socket,
the default socket), so a daemon started with its own `diag_dir` is read where it writes; else,
when no sidecar answers, the settings' `diag_dir` (said on stderr)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from sidecar.commands.client import StatusError, fetch_json, resolve_endpoint
from sidecar.config import DEFAULT_SOCKET, ConfigError, Settings, add_settings_arguments, settings_from_args
from sidecar.incidents.store import INCIDENTS_SUBDIR, load_incidents
from sidecar.safetext import printable

DAEMON_TIMEOUT_SECONDS = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser)
    parser.add_argument(
        "--diag-dir",
        help="diagnostics directory (default: the running sidecar's, else the settings' diag_dir)",
    )
    parser.add_argument("--url", help="the running sidecar's HTTP address, to ask for its diag dir (also SIDECAR_URL)")
    parser.add_argument("--last", type=int, default=20, metavar="N", help="show the N newest (default 20)")
    parser.add_argument("--json", action="store_true", help="print the full records as a JSON list")
    parser.add_argument(
        "--full",
        action="store_true",
        help="print each incident's summary: ranks, timeline and the first lines of every stack dump",
    )


def _row(record: dict[str, Any]) -> list[str]:
    return [printable(cell) for cell in _cells(record)]


def _cells(record: dict[str, Any]) -> list[str]:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(record.get("time", 0)))
    blamed = record.get("blamed_rank")
    timeline = {e.get("event"): e.get("after_detection_seconds") for e in record.get("timeline", [])}
    exited = timeline.get("exit_observed")
    return [
        when,
        str(record.get("job_id", "?")),
        f"rank {blamed}" if blamed is not None else "-",
        str(record.get("outcome", "?")),
        f"+{exited:.1f}s" if exited is not None else "-",
        str(record.get("path", "")),
    ]


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def daemon_diag_dir(settings: Settings, socket: str | None, url: str | None) -> str:
    """The running sidecar's diagnostics directory; StatusError when none answers or says."""
    configured = socket or (settings.socket if settings.socket != DEFAULT_SOCKET else None)
    endpoint = resolve_endpoint(configured, url, os.environ)
    node = fetch_json(endpoint, timeout=DAEMON_TIMEOUT_SECONDS).get("node")
    diag_dir = node.get("diag_dir") if isinstance(node, dict) else None
    if not isinstance(diag_dir, str) or not diag_dir:
        raise StatusError(f"the sidecar at {endpoint} does not name its diag dir (an older sidecar)")
    return diag_dir


def main(args: argparse.Namespace) -> int:
    diag_dir = args.diag_dir
    if not diag_dir:
        try:
            settings = settings_from_args(args)
        except ConfigError as e:
            print(f"sidecar incidents: {e}", file=sys.stderr)
            return 2
        try:
            diag_dir = daemon_diag_dir(settings, args.socket, args.url)
        except StatusError as e:
            diag_dir = str(settings.diagnostics_dir)
            print(f"sidecar incidents: {e}; reading the settings' diag dir {diag_dir}", file=sys.stderr)
    if args.last is not None and args.last < 1:
        print("sidecar incidents: --last must be >= 1", file=sys.stderr)
        return 2
    records = load_incidents(diag_dir, args.last)
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    if not records:
        print(f"no incidents in {Path(diag_dir) / INCIDENTS_SUBDIR}")
        return 0
    if args.full:
        for record in records:
            summary = Path(str(record.get("path", ""))).with_suffix(".txt")
            try:
                # The sidecar escaped what ranks wrote into it; a file from an older version may not be.
                print(printable(summary.read_text(errors="replace"), keep_newlines=True))
            except OSError:
                print(f"(no summary at {summary})\n")
        return 0
    header = ["detected (UTC)", "job", "blamed", "outcome", "exited", "record"]
    print(_table([header] + [_row(r) for r in records]))
    return 0
