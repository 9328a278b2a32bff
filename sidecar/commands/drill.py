"""`sidecar drill --job ID [--rank R] [--timeout S]`: the kill-and-resume check of the operations
guide on a live job. As root, it asks this node's sidecar (over its Unix socket: `POST /v1/drills`) to
stop one rank of the job (SIGSTOP; the sidecar picks and checks the process, sidecar/watchdog/drill.py),
then follows the drill (`GET /v1/drills/ID`) and prints, as they happen, when the watchdog detected the
stall, sent the kill, the ranks were gone, torchrun restarted them and the job trained again, and the
step it resumed from. The stall's incident is recorded as a drill; its exits are not failures.

Exit status: 0 the job trained again; 1 refused, not killed or timed out (the rank is continued);
2 no sidecar, or not root.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
from typing import Any
from urllib.parse import quote

from sidecar.commands.client import Endpoint, UnixHTTPConnection, resolve_endpoint
from sidecar.config import DEFAULT_SOCKET
from sidecar.safetext import printable

POLL_SECONDS = 0.5
DEFAULT_TIMEOUT_SECONDS = 600.0
# (key of the drill's answer, what it means): printed once each, as it becomes known
MILESTONES = (
    ("detected_after_seconds", "detected the stall"),
    ("kill_sent_after_seconds", "sent the kill (SIGTERM)"),
    ("ranks_gone_after_seconds", "the job's ranks were gone"),
    ("restarted_after_seconds", "torchrun started the new ranks"),
    ("training_again_after_seconds", "training again"),
)


class DrillFailed(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "root only. Refused for a job that nothing would restart (no torchrun, its restarts used up, hooks "
        "that do not say, observe-only). Exit status: 0 trained again, 1 refused/not killed/timed out, 2 no "
        "sidecar or not root."
    )
    parser.add_argument("--job", required=True, help="the job_id of a job with ranks on this node")
    parser.add_argument("--rank", type=int, help="the rank to stop (default: the job's highest rank on this node)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        help=f"seconds to wait for the job to train again (10-3600, default {DEFAULT_TIMEOUT_SECONDS:g}); "
        "past it the rank is continued",
    )
    parser.add_argument("--socket", help=f"the sidecar's Unix socket (also SIDECAR_SOCKET; default {DEFAULT_SOCKET})")
    parser.add_argument("--json", action="store_true", help="print the drill's final answer as JSON")


def request(endpoint: Endpoint, method: str, path: str, body: dict | None = None, timeout: float = 10.0) -> dict:
    """One request to the sidecar's Unix socket; the JSON answer, or DrillFailed with its error."""
    assert endpoint.socket is not None
    conn = UnixHTTPConnection(endpoint.socket, timeout)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        conn.request(method, path, body=payload, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    except (OSError, http.client.HTTPException) as e:
        raise DrillFailed(f"no sidecar at {endpoint} ({getattr(e, 'strerror', None) or e})", 2) from None
    finally:
        conn.close()
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise DrillFailed(f"{method} {path} at {endpoint}: HTTP {resp.status}, not a JSON object", 2)
    if resp.status != 200:
        raise DrillFailed(f"{answer.get('error') or f'HTTP {resp.status}'}", 2 if resp.status == 403 else 1)
    return answer


def _s(value: Any) -> str:
    return f"{value:.1f}s" if isinstance(value, (int, float)) else "-"


def report_lines(drill: dict) -> list[str]:
    """The drill's figures, once it ended."""
    lines = [
        f"drill {drill.get('id')} of job {drill.get('job_id')}: {drill.get('finished') or 'running'}",
        f"  stopped rank {drill.get('rank')} (pid {drill.get('pid')}) at step {drill.get('step_at_stop')}",
        f"  detection:      {_s(drill.get('detected_after_seconds'))} after the stop"
        + (f" (incident {drill.get('incident')})" if drill.get("incident") else ""),
        f"  kill sent:      {_s(drill.get('kill_sent_after_seconds'))}",
        f"  ranks gone:     {_s(drill.get('ranks_gone_after_seconds'))}",
        f"  restarted:      {_s(drill.get('restarted_after_seconds'))}",
        f"  training again: {_s(drill.get('training_again_after_seconds'))}",
        f"  resumed from step {drill.get('resumed_from_step') if drill.get('resumed_from_step') is not None else '-'}"
        + (f" ({drill.get('steps_redone')} steps redone)" if drill.get("steps_redone") is not None else ""),
        "  recorded as a drill, not counted as a failure",
    ]
    return [printable(line) for line in lines]


def follow(endpoint: Endpoint, drill: dict, deadline: float, out=sys.stdout) -> dict:
    """Poll the drill until it ends, printing each milestone once."""
    path = f"/v1/drills/{quote(str(drill.get('id')), safe='')}"
    shown: set[str] = set()
    started = time.monotonic()
    last_tick = started
    while True:
        for key, words in MILESTONES:
            if key not in shown and drill.get(key) is not None:
                shown.add(key)
                extra = f" (incident {drill.get('incident')})" if key == "detected_after_seconds" else ""
                print(printable(f"  {_s(drill[key]):>7} {words}{extra}"), file=out, flush=True)
        if drill.get("finished"):
            return drill
        now = time.monotonic()
        if now - last_tick >= 15:
            last_tick = now
            print(f"  ... waiting ({now - started:.0f}s)", file=out, flush=True)
        if now > deadline:
            raise DrillFailed("the sidecar did not end the drill in time (its own timeout should have)")
        time.sleep(POLL_SECONDS)
        drill = request(endpoint, "GET", path).get("drill") or {}


def main(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("sidecar drill: root only (it stops a rank of a live job); run it with sudo", file=sys.stderr)
        return 2
    endpoint = resolve_endpoint(args.socket, None)
    if endpoint.socket is None:
        print("sidecar drill: the Unix socket only (SIDECAR_URL is not enough: drills need root's credentials)")
        return 2
    body: dict[str, Any] = {"job_id": args.job, "timeout_seconds": args.timeout}
    if args.rank is not None:
        body["rank"] = args.rank
    try:
        drill = request(endpoint, "POST", "/v1/drills", body).get("drill") or {}
        if not args.json:
            print(
                printable(
                    f"drill {drill.get('id')}: stopped rank {drill.get('rank')} of job {drill.get('job_id')} "
                    f"(pid {drill.get('pid')}) at step {drill.get('step_at_stop')}; waiting for the watchdog"
                ),
                flush=True,
            )
        final = follow(endpoint, drill, time.monotonic() + args.timeout + 60, sys.stderr if args.json else sys.stdout)
    except DrillFailed as e:
        print(printable(f"sidecar drill: {e}"), file=sys.stderr)
        return e.code
    if args.json:
        print(json.dumps(final, indent=2))
    else:
        print("\n".join(report_lines(final)))
    return 0 if final.get("finished") == "resumed" else 1
