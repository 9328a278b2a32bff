"""What the hooks cost the training thread.

    python -m bench.bench_hooks               # hook call latency, sidecar live and absent
    python -m bench.bench_hooks --training    # also: 2-rank CPU training, hooks on vs off
    python -m bench.bench_hooks --collectives [--steps 3000 --rounds 3]   # only: the Flight Recorder's cost
    python -m bench.bench_hooks --pauses      # only: the inferred phases' wrappers (also in the default run)

Hook call: `mon.step` with 6 scalar metrics, timed one call at a time with perf_counter_ns
(which itself costs a few tens of ns, included), with 10 us of busy "work" between calls so
that the sender thread batches and posts (or retries) while calls are timed. Each
measurement runs in its own process (the sidecar refuses registrations from its ancestors).
Targets: median <= 2 us, p99 <= 20 us, judged with the sidecar live and absent. Lines for
hooks disabled and for a paced loop (1000 calls/s, cold caches) are for comparison. Each
line also gives the sender thread's CPU use: what the hooks cost beyond the calls themselves.

Inferred phases (--pauses; trainer_hooks/pauses.py): what the flag-writing wrappers add per call, in
one process: a DataLoader iterator's `__next__` (judged: <= 1 us per batch, the wrapper around the
cheapest `__next__`), a real DataLoader batch, `.eval()` + `.train()` on 1 and 101 modules, a small
torch.save; bare against wrapped, the fastest of 7 timeit runs.

Training (--training): mean step time of 2-rank `torchrun -m sidecar_trainer` on the CPU with the
monitor on (against a real sidecar) and off, in alternating runs, and their ratio.

Flight Recorder (--collectives): what the collective record (trainer_hooks/collectives.py) costs.
1. A read: `collectives.read()` on a full ring of 64 entries (the hooks' TORCH_FR_BUFFER_SIZE) and of
   2000 (a user's own setting; torch's usual size for NCCL), split into torch's dump, json.loads and
   `summarize`, and `dump_json()` (an incident's whole dump); a 1-rank gloo group, three groups used.
2. The training step: a 1-rank gloo loop (an MLP, 6 gradient all-reduces per step, torch on one
   thread) with the Monitor pushing to a real sidecar, FR off (SIDECAR_COLLECTIVES=0,
   TORCH_FR_BUFFER_SIZE=0) against FR on (64, read at most once a second: READ_EVERY_SECONDS), FR on
   read with every push, and FR 2000; alternating runs; the mean step, its p99, and one all-reduce
   alone (torch records each collective on the training thread, with its Python stack).
3. The hooks' thread: Sender.collectives_cpu_seconds (its CPU time reading the record), reads made,
   and its whole CPU time, as a share of a core.
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

from bench.hooks_collectives import bench_collectives, fr_read_worker, fr_training_worker  # noqa: E402
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


PAUSE_TARGET_NS = 1000.0  # what the data loader wrapper may add to a batch


def _per_call_ns(fn, number: int) -> float:
    """The fastest of 7 runs of `number` calls, per call, in ns."""
    import timeit

    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e9


def bench_pauses(reps: int) -> bool:
    """What the wrappers of the inferred phases (trainer_hooks/pauses.py) add on the training
    thread, in this process (no sidecar needed: they only write flags): a DataLoader iterator's
    `__next__` around the cheapest `__next__` there is (the wrapper alone) and around a real batch,
    `Module.train` / `.eval()` on a model of 1 and of 101 modules, and torch.save of a small dict."""
    import io

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from trainer_hooks import pauses

    class Bare:
        def __next__(self) -> int:
            return 1

    bare = Bare()
    plain = _per_call_ns(lambda: next(bare), reps)
    Bare.__next__ = pauses._wrap_next(Bare.__next__)  # type: ignore[method-assign]
    wrapped = _per_call_ns(lambda: next(bare), reps)
    ok = wrapped - plain <= PAUSE_TARGET_NS
    print(
        f"pause wrapper, __next__ alone      bare {plain:6.0f} ns  wrapped {wrapped:6.0f} ns  "
        f"+{wrapped - plain:4.0f} ns per batch  {'PASS' if ok else 'FAIL'} (<= {PAUSE_TARGET_NS:.0f} ns)",
        flush=True,
    )

    def cost(label: str, make, number: int) -> None:
        pauses.uninstall()
        before = _per_call_ns(make(), number)
        pauses.install()
        after = _per_call_ns(make(), number)
        pauses.uninstall()
        print(
            f"pause wrapper, {label:<20} bare {before / 1000:6.2f} us  wrapped {after / 1000:6.2f} us  "
            f"{after - before:+5.0f} ns per call (for information)",
            flush=True,
        )

    class Numbers(Dataset):
        def __len__(self) -> int:
            return 10**9

        def __getitem__(self, i: int) -> int:
            return i

    def batches():
        it = iter(DataLoader(Numbers(), batch_size=1))
        return lambda: next(it)

    def switch(model: nn.Module):
        def both() -> None:
            model.eval()
            model.train()

        return both

    cost("DataLoader batch", batches, max(1, reps // 20))
    one, many = nn.Linear(8, 8), nn.Sequential(*[nn.Linear(8, 8) for _ in range(100)])
    for label, model in (("eval()+train(), 1", one), ("eval()+train(), 101", many)):
        pauses.uninstall()
        before = _per_call_ns(switch(model), max(1, reps // 200))
        pauses.install()
        after = _per_call_ns(switch(model), max(1, reps // 200))
        pauses.uninstall()
        print(
            f"pause wrapper, {label:<20} bare {before / 2000:6.2f} us  wrapped {after / 2000:6.2f} us  "
            f"{(after - before) / 2:+5.0f} ns per call (for information)",
            flush=True,
        )
    state = {"w": torch.zeros(4)}
    cost("torch.save, small", lambda: lambda: torch.save(state, io.BytesIO()), max(1, reps // 200))
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


# ---------------------------------------------------------------- --collectives: the Flight Recorder


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
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps per run (--training: 300, --collectives: 3000)"
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="alternating runs of each kind (--training: 2, --collectives: 4)"
    )
    parser.add_argument(
        "--collectives", action="store_true", help="only the Flight Recorder's cost: reads, step time FR on vs off"
    )
    parser.add_argument("--fr-worker", metavar="KIND", help=argparse.SUPPRESS)
    parser.add_argument(
        "--pauses", action="store_true", help="only the inferred phases' wrappers: DataLoader, Module.train, torch.save"
    )
    args = parser.parse_args(argv)
    if args.fr_worker == "read":
        return fr_read_worker(args.calls)
    if args.fr_worker:
        return fr_training_worker(args.fr_worker, args.socket, args.steps)
    if args.steps is None:
        args.steps = 3000 if args.collectives else 300
    if args.rounds is None:
        args.rounds = 4 if args.collectives else 2
    if args.worker:
        return worker(args.worker, args.socket, args.calls, args.gap_us, judged=not args.informational)
    if args.pauses:
        return 0 if bench_pauses(args.calls) else 1
    with tempfile.TemporaryDirectory(prefix="bench-hooks-") as tmp:
        workdir = Path(tmp)
        if args.collectives:
            return 0 if bench_collectives(workdir, args.steps, args.rounds) else 1
        ok = bench_hook_calls(args.calls, args.gap_us, workdir)
        ok &= (
            subprocess.call([PYTHON, "-m", "bench.bench_hooks", "--pauses", "--calls", str(args.calls)], cwd=ROOT) == 0
        )
        if args.training:
            ok &= bench_training(workdir, args.steps, args.rounds)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
