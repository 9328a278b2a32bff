"""Stragglers: how soon the sidecar names a slowed rank, by how much it is slowed, and how often it
names one in a healthy job (issue 30).

    python -m bench.bench_stragglers --quick    # one run per slowdown, a 3-minute healthy job (~7 min)
    python -m bench.bench_stragglers            # three runs per slowdown, a 10-minute healthy job (make bench, ~25 min)
    python -m bench.bench_stragglers --ratios 0.2 --runs 1 --healthy-seconds 0
    python -m bench.bench_stragglers --ratios 0.2 --runs 1 --healthy-seconds 0 --recover   # and it ends

Each run is a real sidecar (observe-only: nothing is ever killed for lateness) and a data-parallel
job of real gloo ranks with `trainer_hooks.Monitor`: each step computes `--step` seconds (a sleep,
as a GPU kernel leaves the CPU idle) times 1 + a uniform noise of +-`--noise` drawn per rank and
step (the noisy step times of a real job), then all-reduces. From `--slow-from` seconds on, rank 1
computes `ratio` x step longer. The job's step time grows for every rank (each waits for rank 1 at
every all-reduce), so the step times cannot name it; the sidecar judges from the ranks' Flight
Recorder entry times. Polled every 0.5 s: /v1/status `stragglers` (this node's judgement), the time
from the slowdown to rank 1 named (and the lateness shown), any other rank named (a false finding),
and at the end the straggler incidents written. With `--recover`, once rank 1 is named its slowdown
ends: printed, the time until it is no longer named and until its incident is closed (`recovered`).

The healthy job (same noise, no slowdown) runs `--healthy-seconds`; every straggler incident it
opens is a false finding, reported per hour. Targets (issue 30): a rank slowed by 20% named within
60 s; no false finding in a healthy hour (this bench runs a shorter healthy job: 0 findings in it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support import ROOT, Sidecar, kill_tree

RANK = r"""
import os, random, sys, time
rank, world, store, release = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
step_s, noise, ratio, slow_at = float(sys.argv[5]), float(sys.argv[6]), float(sys.argv[7]), float(sys.argv[8])
recovered = sys.argv[9]  # once this file exists, rank 1 is slow no more
from trainer_hooks import Monitor
mon = Monitor(job_id=os.environ["JOB"], rank=rank, local_rank=rank, world_size=world, local_world_size=world)
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
t = torch.ones(1024)
rng = random.Random(rank)
step = 0
while not os.path.exists(release):
    step += 1
    extra = ratio * step_s if rank == 1 and time.time() >= slow_at and not os.path.exists(recovered) else 0.0
    time.sleep(step_s * (1 + rng.uniform(-noise, noise)) + extra)
    dist.all_reduce(t)
    mon.step(step)
mon.close()
dist.destroy_process_group()
"""


WARMUP_SECONDS = 60.0  # a healthy job's most lateness is taken after this (its ranks start at different times)


@dataclass
class Run:
    ratio: float
    named_after: float | None  # seconds from the slowdown to rank 1 named; None: not within the window
    lateness: float | None  # rank 1's lateness when named (seconds); a healthy job: the most any rank was shown
    false_findings: int  # other ranks named, or straggler incidents of a healthy job
    seconds: float  # how long the job ran
    cleared_after: float | None = None  # --recover: from the slowdown's end to rank 1 no longer named
    cause: str | None = None  # --recover: the cause its node gave (before the slowdown ends)
    closed_after: float | None = None  # --recover: from the slowdown's end to its incident closed (recovered)


class Job:
    def __init__(self, tmp: Path, sidecar: Sidecar, job_id: str, world: int, args, ratio: float, slow_at: float):
        self.tmp, self.release, self.job_id = tmp, tmp / "release", job_id
        self.recovered = tmp / "recovered"
        env = {**os.environ, **sidecar.hook_env(), "JOB": job_id, "PYTHONPATH": str(ROOT)}
        for name in ("SIDECAR_FLUSH_INTERVAL", "TORCH_FR_BUFFER_SIZE", "SIDECAR_COLLECTIVES"):
            env.pop(name, None)
        argv = [str(tmp / "store"), str(self.release), str(args.step), str(args.noise), str(ratio), str(slow_at),
                str(self.recovered)]  # fmt: skip
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, str(r), str(world), *argv],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=open(tmp / f"rank{r}.err", "w"),
            )
            for r in range(world)
        ]

    def alive(self) -> None:
        for r, p in enumerate(self.procs):
            if p.poll() is not None:
                raise SystemExit(f"rank {r} exited {p.returncode}: {(self.tmp / f'rank{r}.err').read_text()[-2000:]}")

    def close(self) -> None:
        self.release.touch()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            kill_tree(p)


def named(sidecar: Sidecar, job_id: str) -> dict[int, float | None]:
    """rank -> lateness, for the ranks this node's judgement names now."""
    out: dict[int, float | None] = {}
    for j in sidecar.status().get("stragglers") or []:
        if j.get("job_id") == job_id and j.get("judged_by") == "node":
            for s in j.get("stragglers") or []:
                out[int(s["rank"])] = s.get("lateness_seconds")
    return out


def incidents(sidecar: Sidecar, job_id: str) -> int:
    return len(straggler_incidents(sidecar, job_id))


def straggler_incidents(sidecar: Sidecar, job_id: str) -> list[dict]:
    found = sidecar.status().get("incidents") or []
    return [i for i in found if i.get("kind") == "straggler" and i.get("job_id") == job_id]


def cause_of(sidecar: Sidecar, job: Job, wait: float = 30.0) -> str | None:
    """The cause this node gives rank 1 once it has looked at its counters (not `unknown`)."""
    deadline = time.time() + wait
    while time.time() < deadline:
        job.alive()
        for j in sidecar.status().get("stragglers") or []:
            if j.get("job_id") == job.job_id:
                for s in j.get("stragglers") or []:
                    if s.get("rank") == 1 and s.get("cause") not in (None, "unknown"):
                        return str(s["cause"])
        time.sleep(0.5)
    return None


def recovery(sidecar: Sidecar, job: Job, args) -> tuple[float | None, float | None]:
    """Rank 1 computes as its peers do again: seconds until it is no longer named, and until its
    straggler incident is closed (`recovered`: the episode ends once it has gone unnamed for
    straggler_incidents.CLOSE_AFTER_SECONDS, 60 s), each None if not within the wait."""
    job.recovered.touch()
    ended, cleared, closed = time.time(), None, None
    while time.time() < ended + args.window + 90.0 and closed is None:
        job.alive()
        if cleared is None and 1 not in named(sidecar, job.job_id):
            cleared = time.time() - ended
        if any(i.get("outcome") == "recovered" for i in straggler_incidents(sidecar, job.job_id)):
            closed = time.time() - ended
        time.sleep(0.5)
    return cleared, closed


def slowed_run(sidecar: Sidecar, tmp: Path, args, ratio: float, index: int) -> Run:
    job_id = f"slow-{int(ratio * 100)}-{index}"
    slow_at = time.time() + args.slow_from
    (tmp / job_id).mkdir()
    job = Job(tmp / job_id, sidecar, job_id, args.world, args, ratio, slow_at)
    found, late, others = None, None, set()
    try:
        while time.time() < slow_at + args.window:
            job.alive()
            now = named(sidecar, job_id)
            others |= {r for r in now if r != 1}
            if 1 in now and time.time() >= slow_at:
                found, late = time.time() - slow_at, now[1]
                break
            time.sleep(0.5)
        cause = cause_of(sidecar, job) if args.recover and found is not None else None
        cleared, closed = recovery(sidecar, job, args) if args.recover and found is not None else (None, None)
    finally:
        job.close()
    run = Run(ratio, found, late, len(others), time.time() - slow_at + args.slow_from)
    run.cleared_after, run.closed_after, run.cause = cleared, closed, cause
    return run


def healthy_run(sidecar: Sidecar, tmp: Path, args) -> Run:
    job_id = "healthy"
    (tmp / job_id).mkdir()
    job = Job(tmp / job_id, sidecar, job_id, args.world, args, 0.0, float("inf"))
    start, most = time.time(), 0.0
    seen: set[int] = set()
    try:
        while time.time() < start + args.healthy_seconds:
            job.alive()
            if time.time() > start + WARMUP_SECONDS:  # the first collectives wait for every rank's start
                most = max([most, *shown_lateness(sidecar, job_id).values()])
            now = named(sidecar, job_id)
            for rank in sorted(set(now) - seen):  # a false finding: when, which rank, how late
                print(f"  healthy job: rank {rank} named after {time.time() - start:.0f} s, {now[rank]} s late",
                      flush=True)  # fmt: skip
            seen |= set(now)
            time.sleep(1.0)
        found = incidents(sidecar, job_id)
    finally:
        job.close()
    run = Run(0.0, None, None, max(found, len(seen)), time.time() - start)
    run.lateness = most
    return run


def shown_lateness(sidecar: Sidecar, job_id: str) -> dict[int, float]:
    """rank -> `sidecar_rank_lateness_seconds` as /metrics shows it now."""
    out = {}
    for line in sidecar.metrics().splitlines():
        if line.startswith("sidecar_rank_lateness_seconds{") and f'job_id="{job_id}"' in line:
            head, _, value = line.rpartition(" ")
            out[int(head.split('rank="')[1].split('"')[0])] = float(value)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one run per slowdown and a 3-minute healthy job")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.5, 1.0], help="rank 1's extra compute")
    p.add_argument("--runs", type=int, default=None, help="runs per slowdown (default 3; 1 with --quick)")
    p.add_argument("--world", type=int, default=2, help="ranks of the job (one node)")
    p.add_argument("--step", type=float, default=0.3, help="each rank's compute per step, seconds")
    p.add_argument("--noise", type=float, default=0.1, help="uniform noise on each step's compute, +- this share")
    p.add_argument("--slow-from", type=float, default=15.0, help="seconds after the start rank 1 slows down")
    p.add_argument("--window", type=float, default=90.0, help="seconds after the slowdown a run waits to be named")
    p.add_argument("--healthy-seconds", type=float, default=None, help="the healthy job's length (600; 180 quick)")
    p.add_argument("--recover", action="store_true",
                   help="once named, rank 1 is slow no more: time until unnamed and its incident closed")  # fmt: skip
    args = p.parse_args(argv)
    runs = args.runs if args.runs is not None else (1 if args.quick else 3)
    if args.healthy_seconds is None:
        args.healthy_seconds = 180.0 if args.quick else 600.0
    results: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-stragglers-") as d:
        tmp = Path(d)
        with Sidecar(tmp / "sidecar", "watchdog.observe_only=true", "hooks_flush_interval_seconds=1") as sidecar:
            for index in range(runs):
                for ratio in args.ratios:
                    r = slowed_run(sidecar, tmp, args, ratio, index)
                    shown = (
                        f"{r.named_after:5.1f} s, {r.lateness * 1000:6.1f} ms"
                        if r.named_after is not None and r.lateness is not None
                        else "not named"
                    )
                    if args.recover:
                        shown += f", cause {r.cause}"
                        shown += (
                            f"; recovered: unnamed after {r.cleared_after:.1f} s, incident closed after "
                            f"{r.closed_after:.1f} s"
                            if r.cleared_after is not None and r.closed_after is not None
                            else f"; recovered: unnamed after {r.cleared_after}, incident closed after {r.closed_after}"
                        )
                    print(f"  run {index + 1}: +{ratio:.0%} -> {shown} (others named: {r.false_findings})", flush=True)
                    results.append(r)
            healthy = healthy_run(sidecar, tmp, args) if args.healthy_seconds > 0 else None
            if healthy is not None:  # at once: an hour's figure is not left to the summary alone
                print(f"  healthy job: {healthy.seconds / 60:.1f} min, {healthy.false_findings} false findings, "
                      f"most lateness after its first minute {(healthy.lateness or 0) * 1000:.1f} ms")  # fmt: skip
    load = os.getloadavg()[0]
    print(f"\n{args.world} ranks, step {args.step * 1000:.0f} ms +-{args.noise:.0%}, slowed from "
          f"{args.slow_from:.0f} s, window {args.window:.0f} s, load {load:.2f} on {os.cpu_count()} CPUs")  # fmt: skip
    print(
        "| slowdown | runs | named | time to name (median, max) | lateness shown (median) | expected | others named |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for ratio in args.ratios:
        rs = [r for r in results if r.ratio == ratio]
        times = [r.named_after for r in rs if r.named_after is not None]
        lates = [r.lateness for r in rs if r.lateness is not None]
        when = f"{statistics.median(times):.1f} s, {max(times):.1f} s" if times else "-"
        late = f"{statistics.median(lates) * 1000:.0f} ms" if lates else "-"
        expected = ratio * args.step * 1000
        print(f"| +{ratio:.0%} | {len(rs)} | {len(times)}/{len(rs)} | {when} | {late} | {expected:.0f} ms "
              f"| {sum(r.false_findings for r in rs)} |")  # fmt: skip
        if ratio >= 0.2 and (len(times) < len(rs) or max(times, default=0.0) > 60):
            ok = False
        if any(r.false_findings for r in rs):
            ok = False
        if args.recover and any(r.named_after is not None and r.closed_after is None for r in rs):
            ok = False  # named, then never closed once the slowdown ended
    if healthy is not None:
        per_hour = healthy.false_findings * 3600 / healthy.seconds
        minutes = healthy.seconds / 60
        print(f"\nhealthy job, {minutes:.1f} min: {healthy.false_findings} false findings ({per_hour:.1f} per hour), "
              f"most lateness shown after its first minute {(healthy.lateness or 0) * 1000:.1f} ms (a straggler: above "
              f"max(20 ms, 10% of the interval between collectives))")  # fmt: skip
        ok = ok and healthy.false_findings == 0
    print(f"\ntargets: every slowdown of 20% or more named within 60 s, no other rank named, no false finding "
          f"in the healthy job: {'PASS' if ok else 'FAIL'}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
