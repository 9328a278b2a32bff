"""`sidecar incidents`: the incident records of a diagnostics directory, newest first (a table,
`--full` summaries or `--json`).

Which directory: `--diag-dir`; else the running daemon's, as its `/v1/status` names it (found as
`sidecar status` finds it: `--socket`/`--url`, SIDECAR_SOCKET/SIDECAR_URL, the settings' socket,
the default socket), so a daemon started with its own `diag_dir` is read where it writes; else,
when no sidecar answers, the settings' `diag_dir` (said on stderr).

With `--job ID`: the job's story across its nodes, from the job's coordinator through this node's
sidecar: the job incident every node's record shares, the culprit, each node's part and its
recovery's stages side by side (recovery_table.py), each rank's innermost frame, one timeline;
this node's own records when the coordinator cannot be reached.

Everything printed is escaped (`safetext.printable`) line by line: records and summaries quote
what ranks wrote, and a story is what the job's coordinator answered, a host the job's owner
chose, which nothing parses (issue 28, rows 8 and 9): it may hold escape sequences, C1 controls
and bidi overrides anywhere, or have any shape at all, and is printed escaped either way."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from sidecar.commands.client import StatusError, fetch_json, resolve_endpoint
from sidecar.commands.recovery_table import recovery_table
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
    parser.add_argument(
        "--job",
        metavar="ID",
        help="a job_id or a job incident id: the job's story across its nodes (latest job incident of a job_id)",
    )


def _row(record: dict[str, Any]) -> list[str]:
    return [printable(cell) for cell in _cells(record)]


def _cells(record: dict[str, Any]) -> list[str]:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(record.get("time", 0)))
    blamed = record.get("blamed_rank")
    timeline = {e.get("event"): e.get("after_detection_seconds") for e in record.get("timeline", [])}
    exited = timeline.get("exit_observed")
    recovery: dict[str, Any] = record["recovery"] if isinstance(record.get("recovery"), dict) else {}
    again = recovery.get("hang_to_training_seconds")
    node = record.get("blamed_node")
    return [
        when,
        str(record.get("job_id", "?")),
        (f"rank {blamed}" if blamed is not None else f"node {node}" if node else "-")
        + (f" on {node}" if node and blamed is not None else ""),
        str(record.get("outcome", "?")),
        f"+{exited:.1f}s" if exited is not None else "-",
        f"{again:.1f}s" if isinstance(again, (int, float)) else "-",
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
            print(printable(f"sidecar incidents: {e}"), file=sys.stderr)
            return 2
        try:
            diag_dir = daemon_diag_dir(settings, args.socket, args.url)
        except StatusError as e:
            diag_dir = str(settings.diagnostics_dir)
            print(printable(f"sidecar incidents: {e}; reading the settings' diag dir {diag_dir}"), file=sys.stderr)
    if args.last is not None and args.last < 1:
        print("sidecar incidents: --last must be >= 1", file=sys.stderr)
        return 2
    if args.job:
        return job_story(args, diag_dir)
    records = load_incidents(diag_dir, args.last)
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    if not records:
        print(printable(f"no incidents in {Path(diag_dir) / INCIDENTS_SUBDIR}"))
        return 0
    if args.full:
        for record in records:
            summary = Path(str(record.get("path", ""))).with_suffix(".txt")
            try:
                # The sidecar escaped what ranks wrote into it; a file from an older version may not be.
                print(printable(summary.read_text(errors="replace"), keep_newlines=True))
            except OSError:
                print(printable(f"(no summary at {summary})") + "\n")
        return 0
    header = ["detected (UTC)", "job", "blamed", "outcome", "exited", "training again", "record"]
    print(_table([header] + [_row(r) for r in records]))
    return 0


# ---------------------------------------------------------------- --job


def job_story(args: argparse.Namespace, diag_dir: str) -> int:
    """The story of a job incident (by job incident id) or of a job's latest one (by job_id)."""
    wanted = args.job
    local = [r for r in load_incidents(diag_dir) if wanted in (r.get("job_id"), r.get("job_incident"))]
    job_id = local[0]["job_id"] if local else wanted
    job_incident = wanted if any(r.get("job_incident") == wanted for r in local) else None
    story, why = _fetch_story(args, job_id, job_incident)
    if job_incident is None and story is not None:
        job_incident = _obj(story.get("verdict")).get("job_incident")
    mine = [r for r in local if job_incident is None or r.get("job_incident") == job_incident]
    if args.json:
        print(json.dumps({"story": story, "local_records": mine}, indent=2))  # ensure_ascii: escaped
        return 0 if story is not None or mine else 1
    if story is None and not mine:
        print(printable(f"sidecar incidents: no job incident of {wanted!r} here ({why})"), file=sys.stderr)
        return 1
    print(render_story(story, mine, why))
    return 0


def _fetch_story(args: argparse.Namespace, job_id: str, job_incident: str | None) -> tuple[dict | None, str]:
    from urllib.parse import quote

    endpoint = resolve_endpoint(getattr(args, "socket", None), getattr(args, "url", None))
    path = f"/v1/jobs/{quote(job_id, safe='')}/story" + (f"?incident={quote(job_incident)}" if job_incident else "")
    try:
        story = fetch_json(endpoint, path, timeout=15.0).get("story")
    except StatusError as e:
        return None, str(e)
    return (story, "") if isinstance(story, dict) else (None, "the sidecar answered no story")


def _obj(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _seq(value: Any) -> list:
    return value if isinstance(value, list) else []


def _seconds(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _when(value: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(_seconds(value)))
    except (OverflowError, OSError, ValueError):
        return f"? ({value!r})"


def render_story(story: dict | None, records: list[dict[str, Any]], why: str) -> str:
    """The story for people. A story of any shape prints (what does not fit shows as `?` or
    `-`), and each line is escaped whole (safetext.printable)."""
    lines: list[str] = []
    if story is not None:
        v = _obj(story.get("verdict"))
        lines += [f"Job incident {v.get('job_incident')}", f"  job       {v.get('job_id')}"]
        lines.append(f"  opened    {_when(v.get('opened', 0))}")
        c = v.get("culprit")
        if isinstance(c, dict):
            who = f"rank {c.get('rank')} on {c.get('node')}" if c.get("rank") is not None else f"node {c.get('node')}"
            lines.append(f"  culprit   {who}, step {c.get('step')} ({c.get('reason')})")
            if c.get("stack_top"):
                lines.append(f"            at {c.get('stack_top')}")
            lines.append(f"  kind      {c.get('kind')} (judged from {c.get('evidence')})")
            coll = c.get("collective")
            if isinstance(coll, dict):
                ops = _obj(coll.get("ops"))
                what = "; ".join(
                    f"{sig} on ranks {', '.join(map(str, _seq(r)))}" for sig, r in ops.items()
                ) or coll.get("op")  # fmt: skip
                where = ", ".join(map(str, _seq(coll.get("nodes"))))
                late = _seq(coll.get("late"))
                lines.append(
                    f"  collective pg {coll.get('pg')} #{coll.get('seq')} {what or ''} on {where}"
                    + (f"; late: {', '.join(map(str, late))}" if late else "")
                    + ("; the same desync as the previous incident" if coll.get("repeat") else "")
                )
        else:
            lines.append("  culprit   not named")
        if _seq(v.get("lost_nodes")):
            lines.append(f"  lost      {', '.join(map(str, _seq(v.get('lost_nodes'))))}")
        lines.append(f"  state     {'closed: the job trains again' if v.get('closed') else 'open'}")
        nodes = sorted(_obj(story.get("nodes")).items())
        lines += ["", "  node             outcome             record"]
        for node, part in nodes:
            p = _obj(_obj(part).get("part"))
            lines.append(f"  {node:<16} {str(p.get('outcome', '-')):<19} {p.get('incident', '-')}")
        lines += recovery_table(story)
        lines += ["", "  rank  node             state        step     waits  innermost frame"]
        for node, part in nodes:
            for r in _seq(_obj(part).get("ranks")):
                r = _obj(r)
                waiting = r.get("waiting")
                waits = "yes" if waiting is True else "NO" if waiting is False else "?"
                lines.append(
                    f"  {r.get('rank')!s:<5} {node:<16} {r.get('state')!s:<12} {r.get('step')!s:<8} {waits:<6} "
                    f"{r.get('stack_top') or '-'}"
                )
                if r.get("collectives"):
                    lines.append(f"        collectives: {r.get('collectives')}")
        lines += ["", "  timeline"]
        start = _seconds(v.get("opened", 0))
        for e in _seq(story.get("timeline")):
            e = _obj(e)
            lines.append(f"    +{_seconds(e.get('time', 0)) - start:7.3f}s  {e.get('node')!s:<16} {e.get('event')}")
    else:
        lines.append(f"(no story from the job's coordinator: {why}; this node's records only)")
    if records:
        lines += ["", "  this node's records"]
        lines += [f"    {r.get('id')}: {r.get('summary')}" for r in records]
    # A story carries text ranks and peers wrote (frames, op names): each line escaped whole.
    return "".join(printable(line) + "\n" for line in lines)
