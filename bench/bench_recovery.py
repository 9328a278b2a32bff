"""Recovery from a hung rank: how fast the sidecar notices, kills and gets training going again,
next to torchrun on its own.

    python -m bench.bench_recovery            # 3 runs with the sidecar + 1 with torchrun alone (~3 min)
    python -m bench.bench_recovery --runs 5   # more runs
    python -m bench.bench_recovery --long     # also: goodput of a 5-minute job hit by a hang every minute
    python -m bench.bench_recovery --pid-namespace   # as root: each run also with torchrun in its own
                                                     # pid namespace (a pod without hostPID)

A 2-rank CPU job (gloo) where rank 1 sleeps inside step 18, before its all-reduce, while rank 0
blocks in the all-reduce. The sidecar runs with a 5 s step-time floor. Targets, in every run:
detection (hang -> STALLED) <= effective timeout + 1 s; the hung group gone <= grace + 1 s after
STALLED. Without the sidecar, the hang lasts until gloo's collective timeout fails rank 0 (set
here to --pg-timeout seconds; the trainer's default is 600 s, PyTorch's 30 minutes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from demo.job import JobSpec, SidecarClient, SidecarSpec, TrainerLog, event_time, load_incident, wait_for
from demo.processes import Processes, free_port

FLOOR_SECONDS = 5.0
GRACE_SECONDS = 5.0
JOB_TIMEOUT_SECONDS = 300.0


@dataclass
class Run:
    """One hang and what followed, in seconds (None: did not happen)."""

    label: str
    finished: bool
    timeout: float | None = None  # the watchdog's effective timeout at detection
    detect: float | None = None  # hang -> STALLED
    kill: float | None = None  # STALLED -> the hung group's processes gone
    recover: float | None = None  # hang -> first step after the resume
    total: float | None = None  # torchrun start -> torchrun exit

    @property
    def passed(self) -> bool:
        if not self.finished or self.recover is None:
            return False
        if self.timeout is None:  # torchrun alone: recovering at all is the bar
            return True
        return (
            self.detect is not None
            and self.detect <= self.timeout + 1.0
            and self.kill is not None
            and self.kill <= GRACE_SECONDS + 1.0
        )


def hang_job(pg_timeout: float | None = None) -> JobSpec:
    return JobSpec(
        steps=40,
        fault="sleep",
        fault_rank=1,
        fault_step=18,
        checkpoint_every=5,
        step_delay_seconds=0.1,
        max_restarts=3,
        process_group_timeout_seconds=pg_timeout,
    )


def follow(log: TrainerLog, into: dict[str, float]) -> None:
    """Collect the milestones: hang time, resume time, first step after it."""
    for e in log.poll():
        if e.kind == "fault":
            into.setdefault("hang", e.time)
        elif e.kind == "resumed" and "hang" in into:
            into.setdefault("resumed", e.time)
        elif e.kind == "step" and "resumed" in into:
            into.setdefault("first_step", e.time)
        elif e.kind == "finished":
            into["finished"] = e.time


def follow_until_exit(log: TrainerLog, into: dict[str, float], train: subprocess.Popen) -> bool:
    """`follow`, then whether the job has exited (a `wait_for` condition)."""
    follow(log, into)
    return train.poll() is not None


UNSHARE = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]


def run_with_sidecar(workdir: Path, label: str, pid_namespace: bool = False) -> Run:
    """One hang under the sidecar; `pid_namespace`: torchrun and its ranks in a pid namespace
    of their own, the sidecar outside it (as root: unshare)."""
    workdir.mkdir(parents=True)
    sidecar = SidecarSpec(floor_seconds=FLOOR_SECONDS, grace_seconds=GRACE_SECONDS)
    with Processes(workdir) as procs:
        port, sock = free_port(), str(workdir / "sidecar.sock")
        client = SidecarClient(port)
        procs.start("sidecar", sidecar.command(workdir, port, sock))
        if not wait_for(client.ready, 60):
            return Run(label, False)
        started = time.time()
        command = (UNSHARE if pid_namespace else []) + hang_job().command(workdir)
        train = procs.start("torchrun", command, env={"SIDECAR_SOCKET": sock})
        log, seen = TrainerLog(procs.log("torchrun")), dict[str, float]()
        wait_for(lambda: follow_until_exit(log, seen, train), JOB_TIMEOUT_SECONDS, 0.2)
        follow(log, seen)
        run = Run(label, train.poll() == 0 and "finished" in seen, total=time.time() - started)
        status = client.status() or {}
        briefs = status.get("incidents", [])
        incident = load_incident(briefs[-1]["path"]) if briefs else None
        hang = seen.get("hang")
        if incident and hang:
            stalled, gone = incident["time"], event_time(incident, "exit_observed")
            run.timeout, run.detect = incident["timeout_seconds"], stalled - hang
            run.kill = gone - stalled if gone else None
        if hang and "first_step" in seen:
            run.recover = seen["first_step"] - hang
        return run


def run_torchrun_alone(workdir: Path, pg_timeout: float) -> Run:
    workdir.mkdir(parents=True)
    with Processes(workdir) as procs:
        started = time.time()
        job = hang_job(pg_timeout)
        job.extra.append("monitor.enabled=false")
        train = procs.start("torchrun", job.command(workdir))
        log, seen = TrainerLog(procs.log("torchrun")), dict[str, float]()
        wait_for(lambda: follow_until_exit(log, seen, train), pg_timeout + JOB_TIMEOUT_SECONDS, 0.2)
        follow(log, seen)
        run = Run(
            f"torchrun alone (pg timeout {pg_timeout:g}s)",
            train.poll() == 0 and "finished" in seen,
            total=time.time() - started,
        )
        if "hang" in seen and "first_step" in seen:
            run.recover = seen["first_step"] - seen["hang"]
        return run


def goodput_run(workdir: Path, minutes: int) -> tuple[float, int, float]:
    """A job of about `minutes` minutes under the sidecar whose rank 1 is SIGSTOPped once a
    minute (from outside: a frozen process, as a stuck driver call looks). Returns (goodput,
    hangs injected, wall seconds): goodput = steps x median healthy step time / wall time
    from the first step to the end."""
    workdir.mkdir(parents=True)
    # One remediation a minute is the scenario, not a restart storm: lift the cap above it.
    sidecar = SidecarSpec(
        floor_seconds=FLOOR_SECONDS, grace_seconds=GRACE_SECONDS, extra=[f"remediation.max_per_window={minutes + 2}"]
    )
    steps = int(minutes * 60 / 0.12)
    job = JobSpec(steps=steps, fault="none", checkpoint_every=20, step_delay_seconds=0.1, max_restarts=minutes + 3)
    with Processes(workdir) as procs:
        port, sock = free_port(), str(workdir / "sidecar.sock")
        client = SidecarClient(port)
        procs.start("sidecar", sidecar.command(workdir, port, sock))
        if not wait_for(client.ready, 60):
            raise RuntimeError("sidecar did not start")
        train = procs.start("torchrun", job.command(workdir), env={"SIDECAR_SOCKET": sock})
        log = TrainerLog(procs.log("torchrun"))
        step_times: list[tuple[int, float]] = []
        first = next_hang = None
        hangs = 0
        deadline = time.monotonic() + minutes * 60 * 3 + 120
        while train.poll() is None and time.monotonic() < deadline:
            for e in log.poll():
                if e.kind == "step":
                    step_times.append((e.fields["step"], e.time))
                    first = first or e.time
            now = time.time()
            if first and next_hang is None:
                next_hang = first + 60
            if next_hang and now >= next_hang and hangs < minutes:
                status = client.status() or {}
                victims = [r for r in status.get("ranks", []) if r["rank"] == 1 and r["state"] == "healthy"]
                if victims:
                    os.kill(victims[0]["pid"], signal.SIGSTOP)
                    hangs += 1
                    next_hang = now + 60
            time.sleep(0.2)
        for e in log.poll():
            if e.kind == "step":
                step_times.append((e.fields["step"], e.time))
        if train.poll() != 0:
            raise RuntimeError(f"the goodput job did not finish (exit {train.poll()}); see {workdir}")
    gaps = [b[1] - a[1] for a, b in zip(step_times, step_times[1:], strict=False) if b[0] == a[0] + 1]
    healthy = statistics.median(gaps)
    wall = step_times[-1][1] - step_times[0][1]
    return steps * healthy / wall, hangs, wall


def progress(run: Run) -> None:
    print(
        f"  {run.label}: {'finished' if run.finished else 'DID NOT FINISH'}, hang -> training again "
        f"{fmt(run.recover).strip()} s",
        flush=True,
    )


def fmt(value: float | None) -> str:
    return f"{value:7.2f}" if value is not None else "      -"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_recovery", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="runs with the sidecar (default 3)")
    p.add_argument(
        "--pg-timeout", type=float, default=30.0, help="collective timeout for the torchrun-alone run (default 30 s)"
    )
    p.add_argument("--skip-alone", action="store_true", help="skip the torchrun-alone run")
    p.add_argument("--long", action="store_true", help="also measure goodput under a hang every minute (5 min)")
    p.add_argument("--keep", action="store_true", help="keep the working directory (logs, incidents)")
    p.add_argument(
        "--pid-namespace",
        action="store_true",
        help="each run also with torchrun in its own pid namespace (needs root and unshare)",
    )
    args = p.parse_args(argv)
    # Ctrl-C and SIGTERM end in the cleanup of every process started (the `with` blocks).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    runs: list[Run] = []
    try:
        for i in range(args.runs):
            runs.append(run_with_sidecar(root / f"sidecar-{i}", f"sidecar run {i + 1}"))
            progress(runs[-1])
            if args.pid_namespace:
                runs.append(run_with_sidecar(root / f"sidecar-ns-{i}", f"sidecar run {i + 1}, own pid ns", True))
                progress(runs[-1])
        if not args.skip_alone:
            runs.append(run_torchrun_alone(root / "alone", args.pg_timeout))
            progress(runs[-1])
        goodput = goodput_run(root / "goodput", 5) if args.long else None
    except KeyboardInterrupt:
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"\nhang recovery, 2-rank CPU job, step floor {FLOOR_SECONDS:g}s, grace {GRACE_SECONDS:g}s "
        f"(targets: detect <= timeout + 1 s, kill <= grace + 1 s)"
    )
    print(f"{'run':<34} {'timeout':>7} {'detect':>7} {'kill':>7} {'killed':>7} {'recover':>7} {'total':>7}  result")
    for r in runs:
        killed = r.detect + r.kill if r.detect is not None and r.kill is not None else None  # hang -> group gone
        print(
            f"{r.label:<34} {fmt(r.timeout)} {fmt(r.detect)} {fmt(r.kill)} {fmt(killed)} {fmt(r.recover)} "
            f"{fmt(r.total)}  {'PASS' if r.passed else 'FAIL'}"
        )
    with_sidecar = [r.recover for r in runs if r.timeout is not None and r.recover is not None]
    alone = [r.recover for r in runs if r.timeout is None and r.recover is not None]
    if with_sidecar and alone:
        print(
            f"\nhang -> training again: sidecar {statistics.median(with_sidecar):.1f}s (median), torchrun alone "
            f"{alone[0]:.1f}s with a {args.pg_timeout:g}s collective timeout "
            f"({alone[0] / statistics.median(with_sidecar):.1f}x); with the trainer's default 600 s timeout, "
            f"about {600 + alone[0] - args.pg_timeout:.0f}s"
        )
    elif not args.skip_alone:
        print(f"\ntorchrun alone did not recover within {args.pg_timeout + JOB_TIMEOUT_SECONDS:.0f}s")
    if goodput is not None:
        share, hangs, wall = goodput
        print(
            f"goodput with a hang every minute: {share:.1%} of {wall:.0f}s wall time on useful steps "
            f"({hangs} hangs, all recovered by the sidecar)"
        )
    return 0 if all(r.passed for r in runs) and (runs or goodput is not None) else 1


if __name__ == "__main__":
    sys.exit(main())
