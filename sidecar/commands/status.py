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
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.commands import status_stragglers
from sidecar.commands.client import (
    DEFAULT_TIMEOUT_SECONDS,
    Endpoint,
    StatusError,
    Unreachable,
    fetch_json,
    resolve_endpoint,
)
from sidecar.commands.verdict import (
    EXIT_DEGRADED,
    EXIT_HEALTHY,
    EXIT_UNREACHABLE,
    Verdict,
    assess,
    dict_at,
    dicts_at,
)
from sidecar.config import DEFAULT_SOCKET
from sidecar.safetext import printable

INCIDENTS_SHOWN = 5
# Clock events that slow a GPU down; `gpu_idle` and friends are normal and not shown.
SLOWDOWN_EVENTS = {
    "hw_slowdown": "red",
    "hw_thermal_slowdown": "red",
    "hw_power_brake_slowdown": "red",
    "sw_thermal_slowdown": "red",
    "sw_power_cap": "yellow",
}
RANK_STATE_STYLES = {
    "healthy": "green",
    "starting": "cyan",
    "suspect": "yellow",
    "stalled": "bold red",
    "remediating": "bold red",
    "gone": "dim",
}


# ---------------------------------------------------------------- formatting values


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):  # non-finite values travel as "nan", "inf", "-inf"
        try:
            return float(value)
        except ValueError:
            return None
    return None


def fmt_bytes(value: Any) -> str:
    v = _number(value)
    if v is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return "-"  # pragma: no cover


def fmt_ratio(value: Any) -> str:
    v = _number(value)
    return "-" if v is None else f"{v * 100:.0f}%"


def fmt_float(value: Any, digits: int = 4) -> str:
    v = _number(value)
    if v is None:
        return "-"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.{digits}g}"


def fmt_duration(value: Any) -> str:
    v = _number(value)
    if v is None or not math.isfinite(v):
        return "-"
    if v < 10:
        return f"{v:.2f}s"
    if v < 60:
        return f"{v:.0f}s"
    if v < 3600:
        return f"{int(v // 60)}m{int(v % 60):02d}s"
    if v < 86400:
        return f"{int(v // 3600)}h{int(v % 3600 // 60):02d}m"
    return f"{int(v // 86400)}d{int(v % 86400 // 3600):02d}h"


def fmt_time(value: Any) -> str:
    v = _number(value)
    if v is None or not math.isfinite(v):
        return "-"
    return datetime.datetime.fromtimestamp(v).strftime("%Y-%m-%d %H:%M:%S")


def fmt_text(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


# ---------------------------------------------------------------- the screen, as data


@dataclass
class Cell:
    text: str
    style: str = ""  # a rich style; ignored in plain text


@dataclass
class Section:
    title: str
    columns: list[str]
    rows: list[list[Cell]]
    empty: str = "none"
    notes: list[str] = field(default_factory=list)  # lines under the table


@dataclass
class Screen:
    headline: list[Cell]  # node, version, uptime, verdict
    facts: list[tuple[str, str]]  # node summary
    sections: list[Section]
    problems: list[str]
    exit_code: int


def _cell(text: Any, style: str = "") -> Cell:
    return Cell(text if isinstance(text, str) else fmt_text(text), style)


def _gpu_rows(gpus: Iterable[dict]) -> list[list[Cell]]:
    rows = []
    for g in gpus:
        temp, slow = _number(g.get("temperature_celsius")), _number(g.get("slowdown_temperature_celsius"))
        temp_style = ""
        if temp is not None and slow is not None:
            temp_style = "bold red" if temp >= slow else "yellow" if temp >= slow - 5 else ""
        temp_text = "-" if temp is None else f"{temp:.0f}" + (f"/{slow:.0f}" if slow is not None else "") + " C"
        events = [e for e in g.get("clock_events") or [] if e in SLOWDOWN_EVENTS]
        events_style = "red" if any(SLOWDOWN_EVENTS[e] == "red" for e in events) else "yellow" if events else ""
        ecc, xid = _number(g.get("ecc_uncorrected")), _number(g.get("xid_total"))
        power = _number(g.get("power_watts"))
        rows.append(
            [
                _cell(g.get("gpu")),
                _cell(g.get("name")),
                _cell(fmt_ratio(g.get("utilization_ratio"))),
                _cell(f"{fmt_bytes(g.get('memory_used_bytes'))} / {fmt_bytes(g.get('memory_total_bytes'))}"),
                Cell(temp_text, temp_style),
                _cell("-" if power is None else f"{power:.0f} W"),
                Cell(",".join(events) or "-", events_style),
                Cell(fmt_float(ecc), "bold red" if ecc else ""),
                Cell(fmt_float(xid), "red" if xid else ""),
            ]
        )
    return rows


def _nic_rows(nics: Iterable[dict]) -> list[list[Cell]]:
    rows = []
    for n in nics:
        speed = _number(n.get("speed_bytes"))
        errors = _number(n.get("errors_total"))
        rows.append(
            [
                _cell(n.get("device")),
                Cell("up", "green") if n.get("up") else Cell("DOWN", "bold red"),
                _cell("-" if not speed else f"{speed * 8 / 1e9:g} Gb/s"),
                _cell(fmt_bytes(n.get("receive_bytes_total"))),
                _cell(fmt_bytes(n.get("transmit_bytes_total"))),
                Cell(fmt_float(errors), "yellow" if errors else ""),
            ]
        )
    return rows


def _ib_rows(ports: Iterable[dict]) -> list[list[Cell]]:
    rows = []
    for p in ports:
        rate = _number(p.get("rate_bytes_per_second"))
        rows.append(
            [
                _cell(p.get("device")),
                _cell(p.get("port")),
                Cell(fmt_text(p.get("state")), "green" if p.get("up") else "bold red"),
                _cell("-" if not rate else f"{rate * 8 / 1e9:g} Gb/s"),
            ]
        )
    return rows


def _rank_rows(ranks: Iterable[dict]) -> list[list[Cell]]:
    rows = []
    for r in sorted(ranks, key=lambda r: (str(r.get("job_id")), _number(r.get("rank")) or 0)):
        state = fmt_text(r.get("state"))
        if r.get("exit_reason"):  # a gone rank: why its process exited
            state = f"{state} ({r['exit_reason']})"
        age, timeout = _number(r.get("last_progress_age_seconds")), _number(r.get("timeout_seconds"))
        age_style = ""
        if age is not None and timeout:
            age_style = "red" if age >= timeout else "yellow" if age >= timeout / 2 else ""
        loss = _number(r.get("loss"))
        rows.append(
            [
                _cell(r.get("job_id")),
                _cell(r.get("rank")),
                _cell(r.get("pid")),
                Cell(state, RANK_STATE_STYLES.get(state.split(" ")[0], "")),
                _cell(r.get("step")),
                _cell(fmt_duration(r.get("step_time_seconds"))),
                _cell(fmt_float(r.get("iterations_per_second"), 3)),
                Cell(fmt_float(loss), "red" if loss is not None and not math.isfinite(loss) else ""),
                _cell(fmt_float(r.get("grad_norm"))),
                _cell(r.get("phase")),
                Cell(fmt_duration(age) + (" ago" if age is not None else ""), age_style),
                _cell(fmt_duration(timeout)),
                _cell(r.get("restart_count")),
            ]
        )
    return rows


def _collector_rows(collectors: Mapping[str, Any]) -> list[list[Cell]]:
    rows = []
    for name, c in sorted(collectors.items()):
        if not isinstance(c, dict):
            continue
        ok = c.get("success")
        rows.append(
            [
                _cell(name),
                Cell("ok", "green") if ok else Cell("FAILING" if ok is False else "-", "bold red"),
                _cell(fmt_duration(c.get("duration_seconds"))),
                _cell(fmt_duration(c.get("age_seconds"))),
                _cell(c.get("error")),
            ]
        )
    return rows


def _incident_rows(incidents: list[dict]) -> list[list[Cell]]:
    latest = sorted(incidents, key=lambda i: _number(i.get("time")) or 0, reverse=True)[:INCIDENTS_SHOWN]
    return [
        [
            _cell(fmt_time(i.get("time"))),
            _cell(i.get("job_id")),
            _cell(i.get("blamed_rank")),
            _cell(i.get("summary")),
            _cell(i.get("path")),
        ]
        for i in latest
    ]


def _culprit(verdict: dict) -> dict | None:
    return verdict["culprit"] if isinstance(verdict.get("culprit"), dict) else None


def _held_up_by(culprit: dict) -> str:
    """The culprit in words: its rank and node, step and kind (its frame is root's, by `sidecar
    incidents --job`: /v1/status does not carry it)."""
    who = f"rank {culprit.get('rank')} on " if culprit.get("rank") is not None else "node "
    held = who + str(culprit.get("node"))
    if culprit.get("step") is not None:
        held += f", step {culprit.get('step')}"
    return held + (f" ({culprit.get('kind')})" if culprit.get("kind") else "")


def _job_views(jobs: dict) -> list[tuple[str, dict]]:
    return [(str(job_id), view) for job_id, view in sorted(jobs.items()) if isinstance(view, dict)]


def _job_notes(jobs: dict) -> list[str]:
    """Where root reads what the table leaves out: the culprit's innermost frame, the story."""
    named = [job_id for job_id, view in _job_views(jobs) if _culprit(dict_at(view, "verdict")) is not None]
    return [
        f"the culprit's stack frame and the job's story: sidecar incidents --job {job_id} (root)" for job_id in named
    ]


def _job_rows(jobs: dict) -> list[list[Cell]]:
    rows = []
    for job_id, view in _job_views(jobs):
        verdict = dict_at(view, "verdict")
        culprit = _culprit(verdict)
        held = "-" if culprit is None else _held_up_by(culprit)
        incident = verdict.get("job_incident") if verdict and not verdict.get("closed") else None
        reachable = view.get("reachable")
        rows.append(
            [
                _cell(job_id),
                _cell(view.get("coordinator")),
                Cell("yes", "green") if reachable else Cell("no", "red"),
                _cell(incident),
                _cell(held) if culprit is None or verdict.get("closed") else Cell(held, "bold red"),
            ]
        )
    return rows


def _shadow_rows(shadow: dict) -> list[list[Cell]]:
    """Per job: the kills an observe-only watchdog would have made, the stalls that ended by
    themselves, the longest of those per phase, and the floor that would have killed none of them
    (sidecar/watchdog/shadow.py)."""
    rows = []
    for job_id, figures in sorted(shadow.items()):
        if not isinstance(figures, dict):
            continue
        phases = dict_at(figures, "phases")
        longest = ", ".join(
            f"{phase} {fmt_duration(dict_at(phases, phase).get('longest_pause_seconds'))}" for phase in sorted(phases)
        )
        learned = dict_at(figures, "learned_budgets_seconds")
        would, alarms = _number(figures.get("would_kill")), _number(figures.get("false_alarms"))
        rows.append(
            [
                _cell(str(job_id)),
                _cell("observe-only" if figures.get("observe_only") else "enforcing"),
                Cell(fmt_float(would), "yellow" if would else ""),
                Cell(fmt_float(alarms), "yellow" if alarms else ""),
                _cell(longest or "-"),
                _cell(fmt_duration(figures.get("floor_killing_none_seconds"))),
                _cell(", ".join(f"{k} {fmt_duration(v)}" for k, v in sorted(learned.items())) or "-"),
            ]
        )
    return rows


def _last_exit(last: Any) -> str:
    if not isinstance(last, dict):
        return "-"
    return (
        f"{fmt_text(last.get('job_id'))}/{fmt_text(last.get('rank'))} {fmt_text(last.get('reason'))} "
        f"at {fmt_time(last.get('time'))}"
    )


def build_screen(status: Mapping[str, Any]) -> Screen:
    verdict = assess(status)
    node, watchdog = dict_at(status, "node"), dict_at(status, "watchdog")
    if verdict.exit_code == EXIT_HEALTHY:
        overall = Cell("HEALTHY", "bold green")
    else:
        overall = Cell("UNFIT" if verdict.unfit else "DEGRADED", "bold red")
    headline = [
        Cell(f"node {fmt_text(node.get('name') or node.get('hostname'))}", "bold"),
        Cell(f"sidecar {fmt_text(status.get('version'))}"),
        Cell(f"up {fmt_duration(status.get('uptime_seconds'))}"),
        overall,
    ]
    mem_total, mem_avail = node.get("memory_total_bytes"), node.get("memory_available_bytes")
    facts = [
        ("kernel", fmt_text(node.get("kernel"))),
        ("os", fmt_text(node.get("os"))),
        ("cpu", fmt_ratio(node.get("cpu_utilization_ratio"))),
        ("memory available", f"{fmt_bytes(mem_avail)} of {fmt_bytes(mem_total)}"),
        (
            "checkpoints",
            f"{fmt_text(node.get('checkpoint_dir'))} ({fmt_bytes(node.get('checkpoint_avail_bytes'))} free)",
        ),
        ("driver", fmt_text(node.get("driver_version"))),
        ("cuda", fmt_text(node.get("cuda_version"))),
        (
            "watchdog",
            ("observe-only" if watchdog.get("observe_only") else "enforcing")
            + f", {fmt_text(watchdog.get('remediations_in_window'))}/{fmt_text(watchdog.get('max_per_window'))}"
            " remediations in window",
        ),
        ("last exit", _last_exit(dict_at(status, "exits").get("last"))),
        (
            "node fit",
            "no: " + ", ".join(dict_at(status, "fitness").get("reasons") or ["?"]) if verdict.unfit else "yes",
        ),
    ]
    sections = [
        Section(
            "GPUs",
            ["GPU", "NAME", "UTIL", "MEMORY", "TEMP/SLOWDOWN", "POWER", "THROTTLE", "ECC UNCORR", "XID"],
            _gpu_rows(dicts_at(status, "gpus")),
            "read by dcgm-exporter (collectors.gpu_source: dcgm)"
            if node.get("gpu_source") == "dcgm"
            else "none (no NVIDIA driver or no GPU)",
        ),
        Section("NICs", ["DEVICE", "LINK", "SPEED", "RX", "TX", "ERRORS"], _nic_rows(dicts_at(status, "nics"))),
        Section("InfiniBand", ["DEVICE", "PORT", "STATE", "RATE"], _ib_rows(dicts_at(status, "infiniband"))),
        Section(
            "Ranks",
            [
                "JOB",
                "RANK",
                "PID",
                "STATE",
                "STEP",
                "STEP TIME",
                "IT/S",
                "LOSS",
                "GRAD NORM",
                "PHASE",
                "PROGRESS",
                "TIMEOUT",
                "RESTARTS",
            ],
            _rank_rows(dicts_at(status, "ranks")),
            "none registered",
        ),
        Section(
            "Jobs across nodes",
            ["JOB", "COORDINATOR", "REACHABLE", "JOB INCIDENT", "HELD UP BY"],
            _job_rows(dict_at(status, "jobs")),
            "no multi-node job (or job_view.enabled off)",
            _job_notes(dict_at(status, "jobs")),
        ),
        Section(
            status_stragglers.TITLE,
            status_stragglers.COLUMNS,
            [[Cell(text, style) for text, style in row] for row in status_stragglers.rows(status)],
            status_stragglers.EMPTY,
        ),
        Section(
            "Would-be kills and false alarms",
            ["JOB", "MODE", "WOULD KILL", "FALSE ALARMS", "LONGEST PAUSE (PHASE)", "FLOOR KILLING NONE", "LEARNED"],
            _shadow_rows(dict_at(watchdog, "shadow")),
            "none (no stall yet)",
        ),
        Section(
            "Collectors",
            ["COLLECTOR", "STATUS", "DURATION", "AGE", "ERROR"],
            _collector_rows(dict_at(status, "collectors")),
        ),
        Section(
            "Last incidents",
            ["TIME", "JOB", "BLAMED RANK", "SUMMARY", "PATH"],
            _incident_rows(dicts_at(status, "incidents")),
        ),
    ]
    return Screen(headline, facts, sections, verdict.problems, verdict.exit_code)


# ---------------------------------------------------------------- rendering


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
    endpoint = resolve_endpoint(args.socket, args.url)
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
