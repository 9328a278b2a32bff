"""Incident records: what the watchdog saw and did about one stall, on disk.

Each detection writes `<diag_dir>/incidents/<UTC time>-<job>.json` (the full record, rewritten
atomically as remediation progresses) and a `.txt` summary for people. `sidecar incidents`
(sidecar/commands/incidents.py) lists them, newest first. They are kept within the settings'
`incident_retention_*` (count, megabytes, days): the oldest go first (`prune`, in the executor, at
most once every RETENTION_CHECK_SECONDS), never one written in the last IN_PROGRESS_SECONDS.

The summary quotes text ranks control (their stack dumps, py-spy's view of them, cgroup names,
exception reports): each of its lines goes through `safetext.printable`, so a rank can neither
send escape sequences to the terminal of whoever reads it nor fake a line of it. Writes are
rendered on the caller's thread and, with `save_async`, written in the executor.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import re
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sidecar import hang_kinds, safetext
from sidecar.config import Settings
from sidecar.host import diagfiles
from sidecar.incidents.drills import DrillMarks
from sidecar.safetext import printable

log = logging.getLogger(__name__)

INCIDENTS_SUBDIR = diagfiles.INCIDENTS
STACK_HEAD_LINES = 12  # lines of each stack dump kept inline (the full dump stays in its file)
RETENTION_CHECK_SECONDS = 60.0  # the incidents directory is looked over at most this often
IN_PROGRESS_SECONDS = 600.0  # a record written this recently may still be updated: never removed
_SUFFIXES = (".json", ".txt", ".fr")


@dataclass(frozen=True)
class Retention:
    """How many incident records, how much disk and how old (0: no limit)."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @classmethod
    def for_settings(cls, settings: Settings) -> Retention:
        return cls(
            settings.incident_retention_count,
            int(settings.incident_retention_megabytes * 1024 * 1024),
            settings.incident_retention_days * 86400.0,
        )


@dataclass
class RankSnapshot:
    """One rank of the hung job as the watchdog saw it at detection."""

    rank: int
    local_rank: int | None
    pid: int
    state: str
    step: int | None
    phase: str | None
    last_progress_age_seconds: float | None
    timeout_seconds: float | None
    stack_file: str | None = None
    stack_head: list[str] = field(default_factory=list)
    stack_bytes: int = 0
    py_spy: str | None = None
    in_collective: bool | None = None
    # Its collective record at the incident (Flight Recorder summary): per group, the collective
    # it is in or last completed ("pg 0 (default_pg): in all_reduce[1000] #5; completed #4").
    collectives: str | None = None


@dataclass
class Incident:
    id: str
    time: float  # Unix time of detection
    job_id: str
    node: str
    blamed_rank: int | None
    blame_reason: str
    timeout_seconds: float | None
    observe_only: bool
    ranks: list[RankSnapshot]
    outcome: str = (
        "pending"  # killed | unkillable | suppressed | observe_only | unverified | not_killed_no_restart | failed
    )
    timeline: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    path: str = ""
    kind: str = "stall"  # "stall" (the watchdog's) or "exit" (sidecar/exits/incidents.py)
    # The job view (sidecar/jobview/): the job incident every node's record of the same stall
    # shares, the node of the blamed rank, and what the job's verdict said of the culprit.
    job_incident: str | None = None
    blamed_node: str | None = None
    culprit: dict[str, Any] | None = None
    # What kind of hang it was and what judged it (sidecar/jobview/report.py KINDS, EVIDENCE), and
    # the collective it was judged from (group, op, sequence, late ranks, nodes).
    hang_kind: str | None = None
    evidence: str | None = None
    collective: dict[str, Any] | None = None
    # A stuck collective (the network's or the backend's): this node's links as read then
    # (sidecar/collectors/nic.py link_facts: NIC and InfiniBand state, errors, drops, waits).
    links: dict[str, Any] | None = None
    # The ranks' Flight Recorder dumps in torch's format (`fr_trace` reads the directory as it is).
    fr_dumps: str | None = None
    # Where the recovery's time went, once the ranks are gone (sidecar/watchdog/recovery.py).
    recovery: dict[str, Any] | None = None
    # Processes alive after SIGKILL (outcome unkillable): what the kernel said of each
    # (sidecar/host/stuck.py), with `who` and `why`; sidecar/watchdog/unkillable.py fills it.
    unkillable: list[dict[str, Any]] = field(default_factory=list)
    # The kill-and-resume drill (`sidecar drill`, drills.py) this stall was: not a failure of the job.
    drill: str | None = None
    # A crash loop (sidecar/jobview/crashloop.py): the same verdict at the same step came back this many
    # times after its first, and the job is ended (its ranks exit 93), not restarted again. None: no loop.
    crash_loop: dict[str, Any] | None = None
    # The job's Slurm job id, user, account and partition, from its ranks on this node when the incident
    # opened (sidecar/ranks/slurmjob.py job_facts: each where they name one); None: not a Slurm job's.
    slurm: dict[str, str] | None = None

    def event(self, name: str, at: float | None = None, **detail: Any) -> None:
        """Record an action with its Unix time and its offset from detection."""
        at = time.time() if at is None else at
        self.timeline.append(
            {"event": name, "time": round(at, 3), "after_detection_seconds": round(at - self.time, 3), **detail}
        )

    def event_time(self, name: str) -> float | None:
        return next((e["time"] for e in self.timeline if e["event"] == name), None)

    @property
    def blamed(self) -> str:
        """Who is blamed, in words: "rank 2 on node-1", "node node-2 (lost)", "rank 0", "no local rank",
        "no rank (collective_stuck)"."""
        if self.blamed_rank is None and self.hang_kind in hang_kinds.NO_RANK_KINDS - {hang_kinds.NODE_LOST.name}:
            return f"no rank ({self.hang_kind})"
        if self.blamed_rank is None:
            return f"node {self.blamed_node}" if self.blamed_node else "no local rank"
        return f"rank {self.blamed_rank}" + (f" on {self.blamed_node}" if self.blamed_node else "")

    @property
    def summary(self) -> str:
        timeout = f"{self.timeout_seconds:.1f}s" if self.timeout_seconds is not None else "?"
        job_incident = f"; job incident {self.job_incident}" if self.job_incident else ""
        return (
            f"job {self.job_id}: stall blamed on {self.blamed} ({self.blame_reason}){job_incident}; "
            f"timeout {timeout}; {self.outcome}"
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["summary"] = self.summary
        return out

    def brief(self) -> dict[str, Any]:
        """The incident as `/v1/status` lists it."""
        return {
            "id": self.id,
            "time": self.time,
            "job_id": self.job_id,
            "blamed_rank": self.blamed_rank,
            "blamed_node": self.blamed_node,
            "job_incident": self.job_incident,
            "outcome": self.outcome,
            "recovery": self.recovery,
            "summary": self.summary,
            "path": self.path,
            "drill": self.drill,
            "slurm": self.slurm,
        }

    def text(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.time))
        lines = [
            f"Incident {self.id}",
            f"  detected  {when} on {self.node}",
            f"  job       {self.job_id}",
            *slurm_lines(self.slurm),
            f"  blamed    {self.blamed} ({self.blame_reason})",
            *([f"  kind      {self.hang_kind} (judged from {self.evidence})"] if self.hang_kind else []),
            *(
                [f"  job incident {self.job_incident} (every node's record of this stall shares it)"]
                if self.job_incident
                else []
            ),
            f"  timeout   {self.timeout_seconds:.1f}s" if self.timeout_seconds is not None else "  timeout   -",
            f"  outcome   {self.outcome}" + ("  (observe-only mode)" if self.observe_only else ""),
            "",
            "  rank  pid       state        step     phase            no progress for",
        ]
        for r in self.ranks:
            age = f"{r.last_progress_age_seconds:.1f}s" if r.last_progress_age_seconds is not None else "-"
            lines.append(
                f"  {r.rank:<5} {r.pid:<9} {r.state:<12} {str(r.step if r.step is not None else '-'):<8} "
                f"{str(r.phase or '-'):<16} {age}"
            )
        if self.links:
            lines += ["", "  this node's links (counters since boot)"]
            for n in self.links.get("nics", []):
                lines.append("    " + " ".join(f"{k}={v}" for k, v in n.items() if v is not None))
            for port in self.links.get("ib_ports", []):
                lines.append("    " + " ".join(f"{k}={v}" for k, v in port.items() if v is not None))
        recorded = [r for r in self.ranks if r.collectives]
        if recorded:
            lines += ["", "  collectives (Flight Recorder)" + (f": {self.fr_dumps}" if self.fr_dumps else "")]
            lines += [f"    rank {r.rank}: {r.collectives}" for r in recorded]
        lines += ["", "  timeline"]
        for e in self.timeline:
            extra = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("event", "time", "after_detection_seconds"))
            lines.append(f"    +{e['after_detection_seconds']:7.3f}s  {e['event']}" + (f"  ({extra})" if extra else ""))
        lines += recovery_lines(self.recovery)
        lines += unkillable_lines(self.unkillable)
        for r in self.ranks:
            if r.stack_file or r.py_spy:
                lines += ["", f"  stacks of rank {r.rank} (pid {r.pid}): {r.stack_file or 'py-spy only'}"]
                lines += [f"    {line}" for line in r.stack_head]
                if r.py_spy:
                    lines += ["    -- py-spy --"] + [f"    {line}" for line in r.py_spy.split("\n")[:STACK_HEAD_LINES]]
        for note in self.notes:
            lines.append(f"  note: {note}")
        return document(lines)


def document(lines: list[str]) -> str:
    """A summary for people from its lines: each escaped whole (safetext.printable), so a line
    break or escape sequence inside one field shows as `\\x0a`, never as a line of its own."""
    return "".join(printable(line) + "\n" for line in lines)


def slurm_lines(slurm: dict[str, str] | None) -> list[str]:
    """The summary's line on the job's Slurm job and owner (none for a job that is no Slurm job's)."""
    if not slurm:
        return []
    return [
        "  slurm     "
        + ", ".join(f"{key} {slurm[key]}" for key in ("job_id", "user", "account", "partition") if key in slurm)
    ]


def unkillable_lines(processes: list[dict[str, Any]]) -> list[str]:
    """The summary's section on processes that outlived SIGKILL."""
    if not processes:
        return []
    lines = ["", "  alive after SIGKILL (the node is unfit until they are gone)"]
    for p in processes:
        lines.append(f"    {p.get('who')} (pid {p.get('pid')}, {p.get('name') or '?'}): {p.get('why')}")
        memory = p.get("gpu_memory_bytes") or {}
        held = [*(p.get("gpu_files") or []), *(f"GPU {g}: {n} bytes" for g, n in sorted(memory.items()))]
        if held:
            lines.append(f"      holds {', '.join(held)}")
        if p.get("kernel_stack"):
            lines += [f"      {frame}" for frame in p["kernel_stack"][:STACK_HEAD_LINES]]
        elif p.get("kernel_stack_error"):
            lines.append(f"      kernel stack {p['kernel_stack_error']}")
    return lines


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:80] or "job"


class IncidentStore:
    """Incidents of one diag directory. Writing never raises: a full disk must not stop the
    watchdog from remediating (the failure is logged and kept in memory). Files are written
    as `diagfiles` says (no symlink followed, no directory others may write), with
    `file_mode` (settings incident_file_mode, 0600 by default) and group `gid`."""

    def __init__(
        self, diag_dir: Path | str, file_mode: int = 0o600, gid: int | None = None, node: str = "",
        retention: Retention | None = None,
    ):  # fmt: skip
        self.diag_dir = Path(diag_dir)
        self.node = node or socket.gethostname()  # the node_name setting
        self.directory = self.diag_dir / INCIDENTS_SUBDIR
        self.file_mode, self.gid = file_mode, gid
        self.recent: list[Incident] = []
        self.retention = retention or Retention()
        self._pruned_at = -RETENTION_CHECK_SECONDS
        self.drills = DrillMarks()  # the job being drilled now (`sidecar drill`): its stall is recorded as a drill
        # job_id -> its Slurm facts (set by the daemon: sidecar/ranks/slurmjob.py job_facts), for each incident
        self.slurm_of: Callable[[str], dict[str, str] | None] = lambda job_id: None

    @classmethod
    def for_settings(cls, settings: Settings) -> IncidentStore:
        return cls(
            settings.diagnostics_dir, settings.incident_file_mode_int, settings.incident_group_id(), settings.node_name,
            Retention.for_settings(settings),
        )  # fmt: skip

    def open(self, job_id: str, cls: type[Incident] = Incident, save: bool = True, **fields: Any) -> Incident:
        """A new incident, detected now; written at once unless `save` is False (the caller
        saves it later)."""
        now = time.time()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
        ident = base = f"{stamp}-{_safe_name(job_id)}"
        taken = {i.id for i in self.recent}  # two of a job in one millisecond (a busy node decides exits late)
        n = 1
        while ident in taken:
            n += 1
            ident = f"{base}-{n}"
        incident = cls(id=ident, time=now, job_id=job_id, node=self.node, **fields)
        incident.slurm = self.slurm_of(job_id)
        incident.path = str(self.directory / f"{incident.id}.json")
        incident.event("detected", at=now)
        if incident.kind == "stall" and (drill := self.drills.claim(job_id, incident.id)) is not None:
            incident.drill = drill
            incident.notes.append(f"drill {drill} (`sidecar drill`): a rank was stopped on purpose; not a failure")
        self.recent.append(incident)
        del self.recent[:-50]
        if save:
            self.save(incident)
        self._prune_soon()
        return incident

    def _prune_soon(self) -> None:
        """Look the directory over (in the executor when a loop runs) if the last look is old enough."""
        r, now = self.retention, time.monotonic()
        if not (r.count or r.bytes or r.seconds) or now - self._pruned_at < RETENTION_CHECK_SECONDS:
            return
        self._pruned_at = now
        try:
            asyncio.get_running_loop().run_in_executor(None, self.prune)
        except RuntimeError:  # no loop (a command, a test): now
            self.prune()

    def prune(self, now: float | None = None) -> list[str]:
        """Remove the oldest incident records beyond the retention's count, bytes and age; returns
        the names removed. Files are named relative to the directory's descriptor and never followed:
        a link planted in the directory is removed itself, never what it points to. Never raises."""
        r, now = self.retention, time.time() if now is None else now
        try:
            with diagfiles.opened(self.diag_dir, INCIDENTS_SUBDIR) as dir_fd:
                records = _records(dir_fd)
                total, count = sum(size for _, size, _ in records.values()), len(records)
                removed = []
                for name in sorted(records):  # the stems begin with the UTC time: oldest first
                    mtime, size, parts = records[name]
                    if now - mtime < IN_PROGRESS_SECONDS:
                        continue
                    old = bool(r.seconds) and now - mtime > r.seconds
                    if not (old or (r.count and count > r.count) or (r.bytes and total > r.bytes)):
                        continue
                    for part in parts:
                        _remove(dir_fd, part)
                    removed.append(name)
                    total, count = total - size, count - 1
        except OSError as e:
            log.error("cannot look over the incident records for retention: %s", e)
            return []
        if removed:
            log.info(
                "incident retention (%d records, %.0f MiB, %g days): removed the %d oldest, %d left",
                r.count, r.bytes / 1048576, r.seconds / 86400, len(removed), count,
            )  # fmt: skip
        return removed

    def save(self, incident: Incident) -> None:
        try:
            rendered = self._render(incident)
        except Exception as e:  # writing never raises: remediation goes on
            log.error("cannot render incident %s: %s: %s", incident.id, type(e).__name__, e)
            return
        self._write(rendered)

    def save_fr_dumps(self, incident: Incident, dumps: dict[int, bytes]) -> None:
        """The ranks' Flight Recorder dumps (each the JSON a rank sent, checked for shape and size)
        as `<incident>.fr/rank_<N>` in torch's pickle format, so that
        `python -m torch.distributed.flight_recorder.fr_trace <incident>.fr` reads them. The
        pickles are written here from parsed JSON: plain values only, whatever a rank sent, every
        string's terminal controls escaped (`fr_trace` prints them raw in whoever's terminal runs it)."""
        if not dumps:
            return
        name = Path(incident.path).stem + ".fr"
        try:
            with diagfiles.opened(self.diag_dir, INCIDENTS_SUBDIR, name) as dir_fd:
                for rank, raw in sorted(dumps.items()):
                    data = pickle.dumps(json.loads(safetext.printable_json(raw.decode())), protocol=4)
                    diagfiles.write_atomic(dir_fd, f"rank_{rank}", data, self.file_mode, self.gid)
        except (OSError, ValueError, RecursionError) as e:
            log.error("cannot write the Flight Recorder dumps of incident %s: %s", incident.id, e)
            return
        incident.fr_dumps = str(self.directory / name)

    async def save_async(self, incident: Incident) -> None:
        """`save`, with the files written in the executor: rendered now (later changes to the
        incident wait for its next save), so the event loop only pays for the rendering."""
        rendered = self._render(incident)
        await asyncio.get_running_loop().run_in_executor(None, self._write, rendered)

    def _render(self, incident: Incident) -> tuple[str, str, bytes, bytes]:
        # backslashreplace: a lone surrogate that got into a record must not stop its writing
        record = (json.dumps(incident.to_dict(), indent=2) + "\n").encode("utf-8", "backslashreplace")
        return incident.path, Path(incident.path).stem, record, incident.text().encode("utf-8", "backslashreplace")

    def _write(self, rendered: tuple[str, str, bytes, bytes]) -> None:
        path, name, record, summary = rendered
        try:
            with diagfiles.opened(self.diag_dir, INCIDENTS_SUBDIR) as dir_fd:
                diagfiles.write_atomic(dir_fd, name + ".json", record, self.file_mode, self.gid)
                diagfiles.write_atomic(dir_fd, name + ".txt", summary, self.file_mode, self.gid)
        except OSError as e:
            log.error("cannot write incident %s: %s", path, e)

    def latest(self, limit: int = 5) -> list[dict[str, Any]]:
        return [i.brief() for i in reversed(self.recent[-limit:])] if limit > 0 else []


def _records(dir_fd: int) -> dict[str, tuple[float, int, list[str]]]:
    """stem -> (newest mtime, bytes, its names) of the incident records in the directory."""
    records: dict[str, tuple[float, int, list[str]]] = {}
    for name in os.listdir(dir_fd):
        stem, suffix = os.path.splitext(name)
        if suffix not in _SUFFIXES or not stem:
            continue
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        size = st.st_size if suffix != ".fr" else _dir_bytes(dir_fd, name)
        mtime, total, parts = records.get(stem, (0.0, 0, []))
        records[stem] = (max(mtime, st.st_mtime), total + size, [*parts, name])
    return records


def _dir_bytes(dir_fd: int, name: str) -> int:
    try:
        fd = os.open(name, diagfiles.DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return 0
    try:
        return sum(os.stat(e, dir_fd=fd, follow_symlinks=False).st_size for e in os.listdir(fd))
    except OSError:
        return 0
    finally:
        os.close(fd)


def _remove(dir_fd: int, name: str) -> None:
    """A record's file, or its Flight Recorder directory and the files in it; a link is removed
    itself (O_NOFOLLOW: never what it points to)."""
    try:
        fd = os.open(name, diagfiles.DIR_FLAGS, dir_fd=dir_fd)
    except OSError:  # not a directory, or a link: the name alone goes
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError as e:
            log.warning("incident retention: cannot remove %s: %s", name, e)
        return
    try:
        for entry in os.listdir(fd):
            try:
                os.unlink(entry, dir_fd=fd)
            except OSError as e:  # a directory inside (we write none): left, and so is its parent
                log.warning("incident retention: cannot remove %s/%s: %s", name, entry, e)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError as e:
        log.warning("incident retention: cannot remove %s: %s", name, e)


def load_incidents(diag_dir: Path | str, last: int | None = None) -> list[dict[str, Any]]:
    """Incident records of a diag directory, newest first; unreadable files are skipped."""
    directory = Path(diag_dir) / INCIDENTS_SUBDIR
    records = []
    for path in sorted(directory.glob("*.json"), reverse=True):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            records.append(record)
        if last is not None and len(records) >= last:
            break
    return records


def recovery_lines(recovery: dict[str, Any] | None) -> list[str]:
    """The incident's `recovery` section for people: seconds per stage, unknown ones as `?`."""
    if not recovery:
        return []
    total = recovery.get("hang_to_training_seconds")
    head = f"hang -> training again {total:.2f}s" if isinstance(total, (int, float)) else "not training again yet"
    lines = ["", f"  recovery  {head}" + ("" if recovery.get("complete") else " (still following)")]
    for stage, seconds in (recovery.get("stages_seconds") or {}).items():
        shown = f"{seconds:8.3f}s" if isinstance(seconds, (int, float)) else "       ?"
        lines.append(f"    {stage:<11}{shown}")
    redone = recovery.get("steps_redone")
    if redone is not None:
        lines.append(f"    steps redone: {redone} (from checkpoint step {recovery.get('checkpoint_step')})")
    return lines
