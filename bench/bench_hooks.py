"""What the hooks cost the training thread.

    python -m bench.bench_hooks               # hook call latency, sidecar live and absent
    python -m bench.bench_hooks --training    # also: 2-rank CPU training, hooks on vs off

Hook call: `mon.step` with 6 scalar metrics, timed one call at a time with perf_counter_ns
(which itself costs a few tens of ns, included), with 10 us of busy "work" between calls so
that the sender thread batches and posts (or retries) while calls are timed. Each
measurement runs in its own process (the sidecar refuses registrations from its ancestors).
Targets: median <= 2 us, p99 <= 20 us, judged with the sidecar live and absent. Lines for
hooks disabled and for a paced loop (1000 calls/s, cold caches) are for comparison. Each
line also gives the sender thread's CPU use: what the hooks cost beyond the calls themselves.

Training (--training): mean step time of 2-rank `torchrun -m sidecar_trainer` on the CPU with the
monitor on (against a real sidecar) and off, in alternating runs, and their ratio.
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/bench_hooks.py` from anywhere
    sys.path.insert(0, str(ROOT))

from tests.support import PYTHON, Sidecar, spawned, tail  # noqa: E402
from trainer_hooks import Monitor  # noqa: E402

MEDIAN_TARGET_US = 2.0
P99_TARGET_US = 20.0


def time_calls(mon: Monitor, calls: int, gap_ns: int) -> list[int]:
    """Nanoseconds of each `mon.step` call with 6 scalar metrics, with `gap_ns` of busy
    "training work" between calls (so the sender thread runs while calls are timed)."""
    clock = time.perf_counter_ns
    out = [0] * calls
    step = mon.step
    for i in range(calls):
        t0 = clock()
        step(i, loss=2.31, grad_norm=0.9, lr=3e-4, samples=64, tokens=32768, step_time_seconds=0.101)
        t1 = clock()
        out[i] = t1 - t0
        while clock() - t1 < gap_ns:
            pass
    return out


def quantile(sorted_ns: list[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1000.0


def worker(label: str, socket_path: str | None, calls: int, gap_us: float, judged: bool) -> int:
    """One measurement in this process: it is the rank (the sidecar refuses its own ancestors)."""
    if socket_path is None:
        mon = Monitor(enabled=False)
    else:
        mon = Monitor(
            job_id="bench-hooks",
            rank=0,
            world_size=1,
            socket=socket_path,
            diag_dir=tempfile.mkdtemp(prefix="bench-hooks-diag-"),
        )
        if "live" in label:
            deadline = time.monotonic() + 15
            while not mon.registered and time.monotonic() < deadline:
                time.sleep(0.05)
            if not mon.registered:
                print(f"hook call, {label}: the monitor did not register with the sidecar")
                return 1
    time_calls(mon, min(calls, 10_000), 0)  # warm up
    gc.collect()
    start = time.monotonic()
    samples = sorted(time_calls(mon, calls, int(gap_us * 1000)))
    seconds = time.monotonic() - start
    sent_during, sender_cpu = mon.sent, mon.sender_cpu_seconds
    mon.close()
    median, p99, p999 = quantile(samples, 0.5), quantile(samples, 0.99), quantile(samples, 0.999)
    ok = median <= MEDIAN_TARGET_US and p99 <= P99_TARGET_US
    verdict = (
        f"{'PASS' if ok else 'FAIL'} (median <= {MEDIAN_TARGET_US} us, p99 <= {P99_TARGET_US} us)"
        if judged
        else "(for information)"
    )
    print(
        f"hook call, {label:<22} {calls / seconds:8.0f} calls/s for {seconds:4.1f} s  median={median:5.2f} us  "
        f"p99={p99:5.2f} us  p99.9={p999:6.2f} us  max={samples[-1] / 1000:8.1f} us  "
        f"sent={sent_during} dropped={mon.dropped}  sender thread CPU={100 * sender_cpu / seconds:4.1f}% "
        f"of a core  {verdict}",
        flush=True,
    )
    return 0 if ok or not judged else 1


def bench_hook_calls(calls: int, gap_us: float, workdir: Path) -> bool:
    def measure(
        label: str, socket_path: str | None, calls: int = calls, gap_us: float = gap_us, judged: bool = True
    ) -> bool:
        cmd = [PYTHON, "-m", "bench.bench_hooks", "--worker", label, "--calls", str(calls), "--gap-us", str(gap_us)]
        if socket_path:
            cmd += ["--socket", socket_path]
        if not judged:
            cmd += ["--informational"]
        return subprocess.call(cmd, cwd=ROOT) == 0

    with Sidecar(workdir / "live", "watchdog.observe_only=true") as sidecar:
        ok = measure("sidecar live", sidecar.socket)
        # 1000 steps/s with 1 ms of busy work between calls: every record is delivered, and
        # each call starts with cold CPU caches, which costs the interpreter's call machinery
        # itself about as much (see the disabled line); for information, not judged.
        measure("sidecar live, 1k/s", sidecar.socket, calls=5000, gap_us=1000, judged=False)
    ok &= measure("sidecar absent", str(workdir / "absent.sock"))
    measure("disabled", None, judged=False)
    measure("disabled, 1k/s", None, calls=5000, gap_us=1000, judged=False)
    return ok


ITS_RE = re.compile(r"it/s=([0-9.]+)")


def _mean_step_time(log: Path) -> float | None:
    """Mean step time from rank 0's periodic `it/s=` log lines (equal windows of steps),
    leaving out the first window (warm-up)."""
    rates = [float(m.group(1)) for m in ITS_RE.finditer(log.read_text(errors="replace"))][1:]
    rates = [r for r in rates if r > 0]
    return statistics.fmean(1.0 / r for r in rates) if rates else None


def run_training(workdir: Path, enabled: bool, steps: int, sidecar: Sidecar, attempt: int) -> float | None:
    name = f"{'on' if enabled else 'off'}-{attempt}"
    log = workdir / f"train-{name}.log"
    cmd = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "-m",
        "sidecar_trainer",
        "--set",
        f"monitor.enabled={'true' if enabled else 'false'}",
        "--set",
        f"train.steps={steps}",
        "--set",
        "train.log_every_steps=10",
    ]
    with spawned(cmd, log, env=sidecar.hook_env(), cwd=ROOT) as proc:
        try:
            rc = proc.wait(timeout=600)
        except Exception:
            rc = None
    if rc != 0:
        print(f"training with monitor {name} failed (exit {rc}):\n{tail(log, 20)}")
        return None
    return _mean_step_time(log)


def bench_training(workdir: Path, steps: int, rounds: int) -> bool:
    """Alternate off/on runs so that load from elsewhere on the machine hits both alike."""
    times: dict[bool, list[float]] = {False: [], True: []}
    with Sidecar(workdir / "train-sidecar", "watchdog.observe_only=true") as sidecar:
        for attempt in range(rounds):
            for enabled in (False, True):
                mean = run_training(workdir, enabled, steps, sidecar, attempt)
                if mean is None:
                    print("training comparison: no step times in the trainer's log (expected 'it/s=' lines)")
                    return False
                times[enabled].append(mean)
    off, on = statistics.fmean(times[False]), statistics.fmean(times[True])
    print(
        f"2-rank CPU training, {rounds} x {steps} steps each: mean step time hooks off={off * 1000:.2f} ms  "
        f"on={on * 1000:.2f} ms  ratio on/off={on / off:.3f}  "
        f"(runs off: {', '.join(f'{t * 1000:.2f}' for t in times[False])}; "
        f"on: {', '.join(f'{t * 1000:.2f}' for t in times[True])} ms)"
    )
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000, help="hook calls per measurement")
    parser.add_argument(
        "--gap-us", type=float, default=10.0, help="busy 'training work' between timed calls, in microseconds"
    )
    parser.add_argument("--worker", metavar="LABEL", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--informational", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--training", action="store_true", help="also compare 2-rank training, hooks on vs off")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (--training)")
    parser.add_argument("--rounds", type=int, default=2, help="off/on run pairs (--training)")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.socket, args.calls, args.gap_us, judged=not args.informational)
    with tempfile.TemporaryDirectory(prefix="bench-hooks-") as tmp:
        workdir = Path(tmp)
        ok = bench_hook_calls(args.calls, args.gap_us, workdir)
        if args.training:
            ok &= bench_training(workdir, args.steps, args.rounds)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
