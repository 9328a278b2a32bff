"""Run a command beside a CPU hog that keeps the machine's load near a stated multiple of its cores.

    python scripts/cpu_hog.py [--load 2.0] [--log FILE] -- COMMAND [ARGS...]

`make test-under-load` runs the suite under it: a CI machine is seldom idle (other jobs, other
builds), and a suite that passes only on an idle machine is a suite that fails at random.

The load is the kernel's own count of runnable tasks (`procs_running` of /proc/stat, what the load
average averages), sampled ten times a second. The hog is a set of busy-looping processes at normal
priority; once a second it adds one when the last ten seconds' mean is below the target
(`--load` x cores) by more than half a task, and stops one when above it by as much, between 0 and
four per core. The command's own processes count toward the load, so the hog fills what the
command leaves. When the command ends (or the hog is interrupted), every spinner is stopped and a
summary line goes to stderr: the mean runnable tasks, the 1-minute load average's mean, the
spinners' mean. The exit status is the command's.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time


def _spin() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    x = 0
    while True:
        x += 1


def runnable() -> int:
    """The kernel's count of runnable tasks now (this process's sampling thread included)."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("procs_running "):
                return int(line.split()[1])
    raise RuntimeError("/proc/stat has no procs_running line")


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


class Hog:
    def __init__(self, target: float, cores: int, log=None):
        self.target, self.most, self.log = target, 4 * cores, log
        self.spinners: list[multiprocessing.Process] = []
        self.samples: collections.deque[int] = collections.deque(maxlen=100)  # ten seconds
        self.totals = {"runnable": 0.0, "loadavg": 0.0, "spinners": 0.0, "n": 0}
        self.stop = threading.Event()
        self.ctx = multiprocessing.get_context("fork")

    def _add(self) -> None:
        p = self.ctx.Process(target=_spin, daemon=True)
        p.start()
        self.spinners.append(p)

    def _remove(self) -> None:
        p = self.spinners.pop()
        p.kill()
        p.join()

    def run(self) -> None:
        """Sample and steer until `stop` is set."""
        tick = 0
        while not self.stop.wait(0.1):
            self.samples.append(runnable() - 1)  # not this sampling thread
            tick += 1
            if tick % 10:
                continue
            mean = sum(self.samples) / len(self.samples)
            if mean < self.target - 0.5 and len(self.spinners) < self.most:
                self._add()
            elif mean > self.target + 0.5 and self.spinners:
                self._remove()
            la = loadavg()
            for k, v in (("runnable", mean), ("loadavg", la), ("spinners", len(self.spinners))):
                self.totals[k] += v
            self.totals["n"] += 1
            if self.log is not None:
                self.log.write(
                    f"{time.time():.1f} runnable {mean:.2f} loadavg {la:.2f} spinners {len(self.spinners)}\n"
                )
                self.log.flush()

    def close(self) -> None:
        self.stop.set()
        while self.spinners:
            self._remove()

    def summary(self) -> str:
        n = max(1, int(self.totals["n"]))
        return (
            f"cpu_hog: target {self.target:.1f} runnable tasks; mean runnable {self.totals['runnable'] / n:.2f}, "
            f"1-min load average {self.totals['loadavg'] / n:.2f}, spinners {self.totals['spinners'] / n:.2f} "
            f"over {n} s"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", type=float, default=2.0, help="target runnable tasks per core (default 2)")
    parser.add_argument("--log", help="write the load each second to this file")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (cpu_hog.py [--load N] -- COMMAND ...)")
    if args.load <= 0:
        parser.error(f"--load must be above 0, got {args.load}")
    cores = os.cpu_count() or 1
    log = open(args.log, "w") if args.log else None  # noqa: SIM115 - closed below
    hog = Hog(args.load * cores, cores, log)
    steer = threading.Thread(target=hog.run, name="cpu-hog", daemon=True)
    print(f"cpu_hog: keeping about {args.load * cores:.0f} runnable tasks on {cores} cores beside: "
          f"{' '.join(command)}", file=sys.stderr, flush=True)  # fmt: skip
    child = subprocess.Popen(command)
    steer.start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    try:
        rc = child.wait()
    finally:
        hog.stop.set()
        steer.join(timeout=5)
        hog.close()
        if log is not None:
            log.close()
        print(hog.summary(), file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
