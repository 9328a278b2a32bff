"""Recovery from a hung rank: how fast the sidecar notices, kills and gets training going again,
next to torchrun on its own.

    python -m bench.bench_recovery            # 3 runs with the sidecar + 1 with torchrun alone (~3 min)
    python -m bench.bench_recovery --runs 5   # more runs
    python -m bench.bench_recovery --long     # also: goodput of a ~5.5-minute job hit by a hang every minute (5 hangs)
    python -m bench.bench_recovery --long --nodes 3 --faults mixed   # only: 3 simulated nodes, >= 10 minutes,
                                  # a fault a minute in rotation: stop, deadlock, spin, crash, DataLoader worker
                                  # stopped, a healthy all-rank pause (bench/mixed_faults.py, recovery_mixed.py)
    python -m bench.bench_recovery --pid-namespace   # as root: each run also with torchrun in its own
                                                     # pid namespace (a pod without hostPID)

A 2-rank CPU job (gloo) where rank 1 sleeps inside step 18, before its all-reduce, while rank 0
blocks in the all-reduce. The sidecar runs with a 5 s step-time floor. Targets, in every run:
detection (hang -> STALLED) <= effective timeout + 1 s; the hung group gone <= grace + 1 s after
STALLED. Without the sidecar, the hang lasts until gloo's collective timeout fails rank 0 (set
here to --pg-timeout seconds; the trainer's default is 600 s, PyTorch's 30 minutes).

Each recovery is also taken apart, stage by stage (`Anatomy`): hang -> detected -> SIGTERM sent
(stack dumps) -> ranks gone (the sidecar's incident record) -> restarted process started ->
imports done -> process group formed -> model built -> checkpoint loaded -> first step (the trainer's start-up
milestones, sidecar_trainer/startup.py), and the steps trained again after the resume.
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

from bench import mixed_faults, recovery_mixed
from bench.mixed_faults import KINDS
from bench.recovery_anatomy import STAGES, Anatomy, anatomy, fmt, incidents_in, print_anatomies  # noqa: F401
from bench.recovery_goodput import account, cpu_times, live_goodput, steal_share  # noqa: F401
from harness.job import JobSpec, LogEvent, SidecarClient, SidecarSpec, TrainerLog, event_time, load_incident, wait_for
from harness.processes import Processes, free_port

FLOOR_SECONDS = 5.0
GRACE_SECONDS = 5.0
# --faults mixed: a floor a user can keep (bench_race --field found 1 s killing none of a real job's
# pauses: a 20 s evaluation, a 10 s checkpoint, 5 s data waits), with margin for a loaded machine
MIXED_FLOOR_SECONDS = 3.0
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
    anatomy: Anatomy | None = None

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


# The points in time of one recovery, in order; a stage is the time between two consecutive ones.
# The sidecar's points (its incident record), then the trainer's start-up milestones.
def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def hang_job(pg_timeout: float | None = None, launcher: str = "torchrun") -> JobSpec:
    return JobSpec(
        launcher=launcher,
        steps=40,
        fault="sleep",
        fault_rank=1,
        fault_step=18,
        checkpoint_every=5,
        step_delay_seconds=0.1,
        max_restarts=3,
        process_group_timeout_seconds=pg_timeout,
    )


def follow(log: TrainerLog, into: dict[str, float], startup: list[LogEvent] | None = None) -> None:
    """Collect the milestones: hang time, resume time, first step after it (and the last step
    before the hang, and the start-up milestones into `startup`)."""
    for e in log.poll():
        if e.kind == "startup" and startup is not None:
            startup.append(e)
        if e.kind == "step" and "hang" not in into:
            into["last_step"] = e.fields["step"]
        if e.kind == "fault":
            into.setdefault("hang", e.time)
        elif e.kind == "resumed" and "hang" in into:
            into.setdefault("resumed", e.time)
        elif e.kind == "step" and "resumed" in into:
            into.setdefault("first_step", e.time)
        elif e.kind == "finished":
            into["finished"] = e.time


def follow_until_exit(
    log: TrainerLog, into: dict[str, float], train: subprocess.Popen, startup: list[LogEvent] | None = None
) -> bool:
    """`follow`, then whether the job has exited (a `wait_for` condition)."""
    follow(log, into, startup)
    return train.poll() is not None


UNSHARE = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]


def run_with_sidecar(workdir: Path, label: str, pid_namespace: bool = False, launcher: str = "torchrun") -> Run:
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
        command = (UNSHARE if pid_namespace else []) + hang_job(launcher=launcher).command(workdir)
        train = procs.start("torchrun", command, env={"SIDECAR_SOCKET": sock})
        log, seen, startup = TrainerLog(procs.log("torchrun")), dict[str, float](), list[LogEvent]()
        wait_for(lambda: follow_until_exit(log, seen, train, startup), JOB_TIMEOUT_SECONDS, 0.2)
        follow(log, seen, startup)
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
        if hang:
            last = seen.get("last_step")
            run.anatomy = anatomy(hang, int(last) if last is not None else None, incident, startup)
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


@dataclass
class Goodput:
    share: float  # steps x median healthy step time / wall time from the first step to the last
    hangs: int
    wall: float
    step_seconds: float  # the median healthy step time
    anatomies: list[Anatomy]
    per_minute: float | None  # goodput from the first hang to the last: whole minutes with one hang each
    hang_seconds: float  # wall time of the hung steps and the first step after each resume, beyond a healthy step
    slow_seconds: float  # wall time of every other step beyond the median (a slower machine, the snapshot writer)
    steal: float | None  # share of the CPUs' time the hypervisor took during the run (/proc/stat)
    live: dict[str, float]  # the sidecar's own sidecar_job_seconds_total{state} for the job at its end


def goodput_run(workdir: Path, minutes: int, launcher: str) -> Goodput:
    """A job of about `minutes` minutes under the sidecar whose rank 1 is SIGSTOPped once a
    minute (from outside: a frozen process, as a stuck driver call looks)."""
    workdir.mkdir(parents=True)
    # One remediation a minute is the scenario, not a restart storm: lift the cap above it.
    sidecar = SidecarSpec(
        floor_seconds=FLOOR_SECONDS, grace_seconds=GRACE_SECONDS, extra=[f"remediation.max_per_window={minutes + 2}"]
    )
    # Long enough that the last hang (at `minutes` minutes) always comes: a faster recovery must not
    # mean one hang fewer. About `minutes` minutes of steps at this machine's ~0.108 s a step.
    steps = int(minutes * 60 / 0.105)
    job = JobSpec(
        steps=steps,
        fault="none",
        checkpoint_every=20,
        step_delay_seconds=0.1,
        max_restarts=minutes + 3,
        launcher=launcher,
    )
    with Processes(workdir) as procs:
        port, sock = free_port(), str(workdir / "sidecar.sock")
        client = SidecarClient(port)
        procs.start("sidecar", sidecar.command(workdir, port, sock))
        if not wait_for(client.ready, 60):
            raise RuntimeError("sidecar did not start")
        train = procs.start("torchrun", job.command(workdir), env={"SIDECAR_SOCKET": sock})
        log = TrainerLog(procs.log("torchrun"))
        step_times: list[tuple[int, float]] = []
        startup: list[LogEvent] = []
        hang_times: list[float] = []
        first = next_hang = None
        deadline = time.monotonic() + minutes * 60 * 3 + 120

        def read_log() -> None:
            for e in log.poll():
                if e.kind == "step":
                    step_times.append((e.fields["step"], e.time))
                elif e.kind == "startup":
                    startup.append(e)

        cpu_before = cpu_times()
        while train.poll() is None and time.monotonic() < deadline:
            read_log()
            first = first or (step_times[0][1] if step_times else None)
            now = time.time()
            if first and next_hang is None:
                next_hang = first + 60
            if next_hang and now >= next_hang and len(hang_times) < minutes:
                status = client.status() or {}
                victims = [r for r in status.get("ranks", []) if r["rank"] == 1 and r["state"] == "healthy"]
                if victims:
                    os.kill(victims[0]["pid"], signal.SIGSTOP)
                    hang_times.append(now)
                    next_hang = now + 60
            time.sleep(0.2)
        read_log()
        steal = steal_share(cpu_before, cpu_times())
        if train.poll() != 0:
            raise RuntimeError(f"the goodput job did not finish (exit {train.poll()}); see {workdir}")
        live = live_goodput(client)
    spent = account(step_times)
    healthy, wall, hang_seconds, slow_seconds = spent.healthy, spent.wall, spent.fault_seconds, spent.slow_seconds
    incidents = incidents_in(workdir / "diag")
    anatomies = []
    for hang in hang_times:
        incident = next((i for i in incidents if i["time"] > hang), None)
        last = max((step for step, t in step_times if t <= hang), default=None)
        anatomies.append(anatomy(hang, last, incident, startup))
    per_minute = None
    if len(hang_times) > 1:  # the steps finished between the first hang and the last
        inside = sum(1 for _, t in step_times if hang_times[0] <= t < hang_times[-1])
        per_minute = inside * healthy / (hang_times[-1] - hang_times[0])
    return Goodput(
        steps * healthy / wall,
        len(hang_times),
        wall,
        healthy,
        anatomies,
        per_minute,
        hang_seconds,
        slow_seconds,
        steal,
        live,
    )


def progress(run: Run) -> None:
    print(
        f"  {run.label}: {'finished' if run.finished else 'DID NOT FINISH'}, hang -> training again "
        f"{fmt(run.recover).strip()} s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_recovery", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="runs with the sidecar (default 3)")
    p.add_argument(
        "--pg-timeout", type=float, default=30.0, help="collective timeout for the torchrun-alone run (default 30 s)"
    )
    p.add_argument("--skip-alone", action="store_true", help="skip the torchrun-alone run")
    p.add_argument(
        "--long", action="store_true", help="also measure goodput under a hang every minute (five hangs, about 6 min)"
    )
    p.add_argument("--keep", action="store_true", help="keep the working directory (logs, incidents)")
    p.add_argument(
        "--faults",
        choices=("sigstop", "mixed"),
        default="sigstop",
        help="--long's faults: `sigstop` (one node, rank 1 SIGSTOPped each minute; the default) or `mixed` (only "
        "this run: --nodes simulated nodes, the field's faults in rotation, bench/mixed_faults.py)",
    )
    p.add_argument("--nodes", type=int, default=1, help="simulated nodes of --faults mixed (3 in the issue)")
    p.add_argument(
        "--minutes", type=float, default=10.0, help="--faults mixed: minutes of faults (the target needs >= 10)"
    )
    p.add_argument("--every", type=float, default=60.0, help="--faults mixed: seconds between faults (default 60)")
    p.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"--faults mixed: the faults, in rotation (default {','.join(KINDS)})",
    )
    p.add_argument(
        "--floor",
        type=float,
        default=MIXED_FLOOR_SECONDS,
        help=f"--faults mixed: the watchdog's floor (default {MIXED_FLOOR_SECONDS:g} s; the pause: twice it)",
    )
    p.add_argument(
        "--launcher",
        choices=("warm", "torchrun"),
        default="warm",
        help="how the sidecar runs start the trainer: `warm` (python -m sidecar_trainer.launch: torchrun whose workers "
        "are forked from a process that imported torch once; the default) or plain `torchrun -m sidecar_trainer`",
    )
    p.add_argument(
        "--pid-namespace",
        action="store_true",
        help="each run also with torchrun in its own pid namespace (needs root and unshare)",
    )
    args = p.parse_args(argv)
    if args.faults == "mixed":
        kinds = tuple(k for k in args.kinds.split(",") if k)
        if not args.long or args.nodes < 1 or not kinds or set(kinds) - set(KINDS):
            p.error(f"--faults mixed needs --long, --nodes >= 1 and --kinds from {','.join(KINDS)}")
        return mixed_main(args, kinds)
    if args.nodes != 1:
        p.error("--nodes needs --faults mixed (the one-node runs are one node)")
    # Ctrl-C and SIGTERM end in the cleanup of every process started (the `with` blocks).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    runs: list[Run] = []
    try:
        for i in range(args.runs):
            runs.append(run_with_sidecar(root / f"sidecar-{i}", f"sidecar run {i + 1}", launcher=args.launcher))
            progress(runs[-1])
            if args.pid_namespace:
                runs.append(
                    run_with_sidecar(
                        root / f"sidecar-ns-{i}", f"sidecar run {i + 1}, own pid ns", True, launcher=args.launcher
                    )
                )
                progress(runs[-1])
        if not args.skip_alone:
            runs.append(run_torchrun_alone(root / "alone", args.pg_timeout))
            progress(runs[-1])
        load_before = load_average()
        goodput = goodput_run(root / "goodput", 5, args.launcher) if args.long else None
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
    rows = [(r.label[:16], r.anatomy) for r in runs if r.anatomy is not None]
    if rows:
        print_anatomies(rows)
    if goodput is not None:
        print_anatomies([(f"hang {i + 1}", a) for i, a in enumerate(goodput.anatomies)], goodput.step_seconds)
        print(
            f"goodput with a hang every minute ({args.launcher} launcher): {goodput.share:.1%} of {goodput.wall:.0f}s "
            "wall time on useful steps "
            f"({goodput.hangs} hangs, all recovered by the sidecar; healthy step {goodput.step_seconds:.3f}s); "
            f"{load_before} before, {load_average()} after"
        )
        if goodput.per_minute is not None:
            print(
                f"  steady state, from the first hang to the last ({goodput.hangs - 1} whole minutes, each with its "
                f"hang): {goodput.per_minute:.1%}"
            )
        steal = "unknown" if goodput.steal is None else f"{goodput.steal:.1%}"
        print(
            f"  the {goodput.wall:.0f}s: useful steps {goodput.wall * goodput.share:.1f}s, hangs and their recoveries "
            f"{goodput.hang_seconds:.1f}s, steps slower than the median {goodput.slow_seconds:.1f}s "
            f"(CPU time taken by the hypervisor meanwhile: {steal})"
        )
        live = goodput.live
        if live and sum(live.values()) > 0:
            print(
                f"  the sidecar's own goodput for the job (sidecar_job_seconds_total): "
                f"{live.get('productive', 0.0) / sum(live.values()):.1%} productive of {sum(live.values()):.0f}s ("
                + ", ".join(f"{k} {v:.1f}s" for k, v in sorted(live.items()))
                + ")"
            )
    return 0 if all(r.passed for r in runs) and (runs or goodput is not None) else 1


def mixed_main(args: argparse.Namespace, kinds: tuple[str, ...]) -> int:
    """`--long --faults mixed`: the mixed run alone; 0 when the target is met (under 10 minutes: when
    every hang was killed and recovered and nothing was killed falsely)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-mixed-"))
    try:
        run = mixed_faults.run(root, args.minutes, args.floor, args.nodes, args.every, kinds, progress=print_flush)
        report = recovery_mixed.analyse(run)
        recovery_mixed.print_report(report, "warm")
    except KeyboardInterrupt:
        return 130
    finally:
        if args.keep:
            print(f"working directory kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0 if (report.passed if report.judged else report.behaved) else 1


def print_flush(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
