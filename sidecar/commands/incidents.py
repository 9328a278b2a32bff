"""`sidecar incidents`: the incident records of a diagnostics directory, newest first (a table,
`--full` summaries or `--json`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from sidecar.incidents.store import INCIDENTS_SUBDIR, load_incidents
from sidecar.safetext import printable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sidecar.config import add_settings_arguments

    add_settings_arguments(parser)
    parser.add_argument("--diag-dir", help="diagnostics directory (default: the settings' diag_dir)")
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


def main(args: argparse.Namespace) -> int:
    diag_dir = args.diag_dir
    if not diag_dir:
        from sidecar.config import ConfigError, settings_from_args

        try:
            diag_dir = str(settings_from_args(args).diagnostics_dir)
        except ConfigError as e:
            print(f"sidecar incidents: {e}", file=sys.stderr)
            return 2
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
