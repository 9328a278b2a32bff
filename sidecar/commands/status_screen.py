"""What `sidecar status` shows, as data: the screen (sections of rows of cells) built from the
daemon's `/v1/status`, with the formatting of each value. Rendering it (plain or with rich, every
string through `safetext.printable`) and the command itself are sidecar/commands/status.py's.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar import hang_kinds
from sidecar.commands import status_golive, status_stragglers
from sidecar.commands.verdict import EXIT_HEALTHY, assess, dict_at, dicts_at

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
    if culprit.get("rank") is not None:
        held = f"rank {culprit.get('rank')} on {culprit.get('node')}"
    elif hang_kinds.of(str(culprit.get("kind"))).blames == "node":
        held = f"node {culprit.get('node')}"
    else:
        held = "no rank"  # a stuck collective, a pause
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


def _no_shadow_rows(watchdog: dict) -> str:
    """What an empty table of would-be kills and false alarms means: no stall yet, or stalls each
    acted on, counted by outcome (`none` alone from a sidecar whose status has no such count)."""
    stalls = _number(watchdog.get("stalls"))
    if stalls is None:
        return "none"
    if not stalls:
        return "none (no stall yet)"
    outcomes = {str(k): n for k, v in dict_at(watchdog, "outcomes").items() if (n := _number(v))}
    pending = stalls - sum(outcomes.values())
    ends = [f"{fmt_float(n)} {outcome}" for outcome, n in outcomes.items()]
    ends += [f"{fmt_float(pending)} being handled"] if pending > 0 else []
    return f"none: {fmt_float(stalls)} stall{'' if stalls == 1 else 's'} since start, " + ", ".join(ends)


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
            f"{fmt_text(node.get('checkpoint_dir'))} ({fmt_bytes(node.get('checkpoint_avail_bytes'))} free)"
            if node.get("checkpoint_dir")
            else "not set (checkpoint_dir)",
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
            status_golive.TITLE,
            status_golive.COLUMNS,
            [[Cell(text, style) for text, style in row] for row in status_golive.rows(status)],
            status_golive.EMPTY,
            status_golive.notes(status),
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
            _no_shadow_rows(watchdog),
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
