"""The demo's live narrative: start a sidecar and a 2-rank torchrun job whose rank 1 hangs at
one step, then tell what happens, from the trainer's log and the sidecar's status API, and
end with a table of timings."""

from __future__ import annotations

import re
import signal
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from harness.job import JobSpec, SidecarClient, SidecarSpec, TrainerLog, event_time, load_incident, wait_for
from harness.processes import Processes, free_port

DEADLINE_SECONDS = 240.0  # the whole demo gives up after this (it takes well under 90 s)
STACK_LINES_SHOWN = 6


class Story:
    """Turns trainer-log events and sidecar status snapshots into narrative lines, once each."""

    def __init__(self, console: Console, job: JobSpec, sidecar: SidecarSpec, workdir: Path):
        self.console, self.job, self.sidecar, self.workdir = console, job, sidecar, workdir
        self.t0 = time.time()
        self.states: dict[tuple[int, int], str] = {}  # (pid, rank) -> last state told
        self.registered: set[int] = set()
        self.incidents_told: set[str] = set()
        self.incident: dict | None = None
        self.kill_told: set[str] = set()
        self.hang_at: float | None = None
        self.hang_step: int | None = None
        self.resumed_step: int | None = None
        self.resumed_at: float | None = None
        self.first_step_after_resume: float | None = None
        self.finished: dict | None = None
        self.attempt = 0

    def say(self, text: str, style: str = "", at: float | None = None) -> None:
        offset = (at or time.time()) - self.t0
        self.console.print(f"[dim]{offset:6.1f}s[/dim]  {text}", style=style, highlight=False)

    # ------------------------------------------------------------ the trainer's log

    def on_log(self, e) -> None:
        f = e.fields
        if e.kind == "rendezvous":
            self.attempt = f["attempt"]
            if self.attempt == 0:
                self.say(f"torchrun started {f['world_size']} ranks; rendezvous done", at=e.time)
            else:
                self.say(
                    f"torchrun restarted the worker group (attempt {self.attempt}); rendezvous done",
                    "bold cyan",
                    at=e.time,
                )
        elif e.kind == "fault":
            self.hang_at, self.hang_step = e.time, f["step"]
            self.say(
                f"HANG INJECTED: rank {f['rank']} calls time.sleep() inside step {f['step']}, before its "
                f"all-reduce; rank 0 now blocks in the all-reduce. Nothing crashes.",
                "bold red",
                at=e.time,
            )
        elif e.kind == "resumed":
            self.resumed_step, self.resumed_at = f["step"], e.time
            redo = (
                f"steps {f['step'] + 1}..{self.hang_step - 1} are redone, bit for bit"
                if self.hang_step and self.hang_step - 1 > f["step"]
                else "no step is lost"
            )
            self.say(f"resumed from checkpoint step {f['step']} ({redo})", "bold cyan", at=e.time)
        elif e.kind == "step":
            if self.resumed_at is not None and self.first_step_after_resume is None:
                self.first_step_after_resume = e.time
                self.say(f"training continues: step {f['step']}/{f['steps']} loss {f['loss']:.4f}", "cyan", at=e.time)
            elif f["step"] % 5 == 0 or f["step"] == 1:
                self.say(f"step {f['step']:>3}/{f['steps']}  loss {f['loss']:.4f}  {f['its']:.1f} it/s", at=e.time)
        elif e.kind == "finished":
            self.finished = f
            self.say(
                f"training finished at step {f['step']} (parameters sha256 {f['sha256'][:16]}...)",
                "bold green",
                at=e.time,
            )

    # ------------------------------------------------------------ the sidecar

    def on_status(self, status: dict) -> None:
        for brief in reversed(status.get("incidents", [])):
            self._tell_incident(brief)
        for r in status.get("ranks", []):
            key = (r["pid"], r["rank"])
            if r["pid"] not in self.registered and r["state"] != "gone":
                self.registered.add(r["pid"])
                self.say(f"sidecar: rank {r['rank']} registered (pid {r['pid']}, restart {r['restart_count']})")
            old = self.states.get(key)
            if r["state"] != old:
                self.states[key] = r["state"]
                self._tell_state(r, old)

    def _tell_state(self, r: dict, old: str | None) -> None:
        state = r["state"]
        age = r.get("last_progress_age_seconds")
        timeout = r.get("timeout_seconds")
        why = f"no progress for {age:.1f}s of {timeout:.1f}s" if age is not None and timeout else ""
        if state == "suspect":
            self.say(f"sidecar: rank {r['rank']} SUSPECT ({why})", "yellow")
        elif state == "stalled":
            self.say(f"sidecar: rank {r['rank']} STALLED ({why})", "bold red")
        elif state == "remediating":
            self.say(
                f"sidecar: rank {r['rank']} STALLED -> REMEDIATING (its worker group is dumped, then killed)", "red"
            )
        elif state == "healthy" and old in (None, "starting"):
            self.say(
                f"sidecar: rank {r['rank']} healthy, step timeout {timeout:.1f}s "
                f"(max of the {self.sidecar.floor_seconds:g}s floor and 8 x p99 step time)"
            )
        elif state == "gone" and old == "remediating":
            self.say(f"sidecar: rank {r['rank']} (pid {r['pid']}) exited", "red")

    def _tell_incident(self, brief: dict) -> None:
        record = load_incident(brief["path"])
        if record is None:
            return
        if brief["id"] not in self.incidents_told:
            self.incidents_told.add(brief["id"])
            self.incident = record
            ranks = record["ranks"]
            self.say(
                f"DETECTED: ranks {', '.join(str(r['rank']) for r in ranks)} STALLED at step "
                f"{min((r['step'] or 0) for r in ranks)}: no progress for "
                f"{max(r['last_progress_age_seconds'] for r in ranks):.1f}s, timeout "
                f"{record['timeout_seconds']:.1f}s",
                "bold red",
                at=record["time"],
            )
        self.incident = record
        for e in record.get("timeline", []):
            tag = f"{brief['id']}/{e['event']}"
            if tag in self.kill_told:
                continue
            if e["event"] == "dumps_received":
                self.kill_told.add(tag)
                self._tell_stacks(record, e["time"])
            elif e["event"] == "sigterm":
                self.kill_told.add(tag)
                self.say(f"BLAMED: rank {record['blamed_rank']} ({record['blame_reason']})", "bold red", at=e["time"])
                self.say(f"sidecar: SIGTERM to the process groups of ranks {e['ranks']}", "red", at=e["time"])
            elif e["event"] == "sigkill":
                self.kill_told.add(tag)
                self.say(f"sidecar: SIGKILL to what was left of ranks {e['ranks']}", "red", at=e["time"])
            elif e["event"] == "exit_observed":
                self.kill_told.add(tag)
                self.say(
                    f"sidecar: hung worker group gone {e['after_detection_seconds']:.2f}s after detection; "
                    f"torchrun will restart it",
                    "red",
                    at=e["time"],
                )

    def _tell_stacks(self, record: dict, at: float) -> None:
        for r in record["ranks"]:
            if not r.get("stack_head"):
                continue
            where = "waits for its peers" if r.get("in_collective") else "NOT waiting for its peers"
            self.say(
                f"stacks saved: rank {r['rank']} ({where}): {_short(r['stack_file'], self.workdir)}", "magenta", at=at
            )
            for line in r["stack_head"][1 : STACK_LINES_SHOWN + 1]:
                self.console.print(f"          [dim]{_short_frame(line)}[/dim]", highlight=False)

    # ------------------------------------------------------------ the end

    def summary(self, workdir: Path) -> Table:
        table = Table(title="Recovery timings", show_header=True, header_style="bold")
        table.add_column("interval")
        table.add_column("seconds", justify="right")
        detected = self.incident["time"] if self.incident else None
        killed = event_time(self.incident, "exit_observed") if self.incident else None

        def row(name: str, a: float | None, b: float | None) -> None:
            table.add_row(name, f"{b - a:.2f}" if a is not None and b is not None else "-")

        row("hang -> detected (STALLED)", self.hang_at, detected)
        row("detected -> group killed", detected, killed)
        row("hang -> first step after resume", self.hang_at, self.first_step_after_resume)
        row("total demo", self.t0, time.time())
        if self.incident:
            table.add_row("effective timeout", f"{self.incident['timeout_seconds']:.2f}")
        if self.hang_step is not None and self.resumed_step is not None:
            table.add_row("steps redone", str(self.hang_step - 1 - self.resumed_step))
        return table


def _with_recovery(incident: dict) -> dict | None:
    record = load_incident(incident["path"])
    return record if record and (record.get("recovery") or {}).get("complete") else None


def recovery_table(recovery: dict) -> Table:
    """The incident's `recovery` section: seconds per stage, as the sidecar measured them."""
    table = Table(title="Where the recovery went (the incident's recovery section)", header_style="bold")
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    for stage, seconds in recovery["stages_seconds"].items():
        table.add_row(stage, f"{seconds:.2f}" if seconds is not None else "unknown")
    total = recovery.get("hang_to_training_seconds")
    table.add_row("hang -> training again", f"{total:.2f}" if total is not None else "-", style="bold")
    return table


def _short(path: str, root: Path) -> str:
    p = Path(path)
    return str(p.relative_to(root)) if p.is_relative_to(root) else path


def _short_frame(line: str) -> str:
    """`File "/long/venv/.../site-packages/torch/autograd/graph.py", line 9 in f` without the prefix."""
    return re.sub(r'File "(?:[^"]*/site-packages/|[^"]*/(?=sidecar_trainer/|trainer_hooks/))', 'File "', line.strip())


def main() -> int:
    console = Console(soft_wrap=True)  # piped output keeps one line per event
    job, sidecar = JobSpec(), SidecarSpec()
    workdir = Path(tempfile.mkdtemp(prefix="sidecar-demo-"))
    # Ctrl-C and SIGTERM both end in the cleanup below (even when started with SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    story = Story(console, job, sidecar, workdir)
    console.rule("training-node sidecar demo")
    console.print(
        f"A 2-rank torchrun job ({job.steps} steps, checkpoint every {job.checkpoint_every}) under a "
        f"node sidecar. Rank {job.fault_rank} will hang at step {job.fault_step}.\n"
        f"Everything lives in {workdir}.",
        highlight=False,
    )
    ok = False
    try:
        with Processes(workdir) as procs:
            port, sock = free_port(), str(workdir / "sidecar.sock")
            client = SidecarClient(port)
            sc = procs.start("sidecar", sidecar.command(workdir, port, sock))
            if not wait_for(lambda: sc.poll() is not None or client.ready(), 60) or sc.poll() is not None:
                console.print(f"[red]the sidecar did not start; see {procs.log('sidecar')}[/red]")
                return 1
            story.say(
                f"sidecar up on {client.url} (socket {sock}); watchdog floor {sidecar.floor_seconds:g}s, "
                f"grace {sidecar.grace_seconds:g}s"
            )
            train = procs.start("torchrun", job.command(workdir), env={"SIDECAR_SOCKET": sock})
            story.say(
                f"torchrun --standalone --nproc-per-node {job.nproc} --max-restarts {job.max_restarts} "
                f"-m sidecar_trainer (faults.kind={job.fault})"
            )
            log = TrainerLog(procs.log("torchrun"))
            deadline = time.monotonic() + DEADLINE_SECONDS
            while time.monotonic() < deadline:
                for e in log.poll():
                    story.on_log(e)
                status = client.status()
                if status:
                    story.on_status(status)
                if train.poll() is not None:
                    for e in log.poll():
                        story.on_log(e)
                    break
                time.sleep(0.2)
            rc = train.poll()
            ok = (
                rc == 0
                and story.finished is not None
                and story.incident is not None
                and story.incident.get("outcome") == "killed"
            )
            if rc is None:
                story.say("the job did not finish in time", "bold red")
            elif not ok:
                story.say(f"torchrun exited with {rc}; see {procs.log('torchrun')}", "bold red")
    except KeyboardInterrupt:
        console.print("\n[yellow]interrupted: every process the demo started has been stopped[/yellow]")
        return 130
    console.print(story.summary(workdir))
    if story.incident:
        # The sidecar follows the next attempt and writes where the recovery's time went.
        record = wait_for(lambda: _with_recovery(story.incident), 5.0, 0.2) if story.incident else None
        if record is not None:
            console.print(recovery_table(record["recovery"]))
        else:
            ok = False
            story.say("the incident has no recovery section", "bold red")
    if story.incident:
        console.print(
            f"incident: {story.incident['path']} (and .txt); list with "
            f"`sidecar incidents --diag-dir {workdir / 'diag'}`",
            highlight=False,
        )
    console.print(f"logs: {workdir}/sidecar.log, {workdir}/torchrun.log", highlight=False)
    console.rule("[green]demo passed[/green]" if ok else "[red]demo failed[/red]")
    return 0 if ok else 1
