"""What the hooks cost the training thread.

    python -m bench.bench_hooks               # hook call latency, sidecar live and absent
    python -m bench.bench_hooks --training    # also: 2-rank CPU training, hooks on vs off

Hook call: `mon.step` with 6 scalar metrics, timed one call at a time with perf_counter_ns
(which itself costs a few tens of ns, included) while the sender thread is live. Targets:
median <= 2 us, p99 <= 20 us. Training: mean step time of `torchrun -m trainer` with the
monitor on (against a real sidecar) and off, and their ratio.
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/bench_hooks.py` from anywhere
    sys.path.insert(0, str(ROOT))

from tests.support import PYTHON, Sidecar, free_port, spawned, tail  # noqa: E402
from trainer_hooks import Monitor  # noqa: E402

MEDIAN_TARGET_US = 2.0
P99_TARGET_US = 20.0


def time_calls(mon: Monitor, calls: int) -> list[int]:
    """Nanoseconds of each `mon.step` call with 6 scalar metrics."""
    clock = time.perf_counter_ns
    out = [0] * calls
    step = mon.step
    for i in range(calls):
        t0 = clock()
        step(i, loss=2.31, grad_norm=0.9, lr=3e-4, samples=64, tokens=32768, step_time_seconds=0.101)
        out[i] = clock() - t0
    return out


def quantile(sorted_ns: list[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1000.0


def bench_call(label: str, mon: Monitor, calls: int) -> bool:
    time_calls(mon, min(calls, 10_000))  # warm up
    gc.collect()
    samples = sorted(time_calls(mon, calls))
    median, p99, p999 = quantile(samples, 0.5), quantile(samples, 0.99), quantile(samples, 0.999)
    ok = median <= MEDIAN_TARGET_US and p99 <= P99_TARGET_US
    print(f"hook call, {label:<16} calls={calls:>7}  median={median:6.2f} us  p99={p99:6.2f} us  "
          f"p99.9={p999:7.2f} us  sent={mon.sent} dropped={mon.dropped}  "
          f"{'PASS' if ok else 'FAIL'} (targets: median <= {MEDIAN_TARGET_US} us, p99 <= {P99_TARGET_US} us)",
          flush=True)
    return ok


def bench_hook_calls(calls: int, workdir: Path) -> bool:
    ok = True
    with Sidecar(workdir / "live", "watchdog.observe_only=true") as sidecar:
        mon = Monitor(job_id="bench-hooks", rank=0, world_size=1, socket=sidecar.socket,
                      diag_dir=str(workdir / "diag"))
        ok &= bench_call("sidecar live", mon, calls)
        mon.close()
    mon = Monitor(job_id="bench-hooks", rank=0, world_size=1, socket=str(workdir / "absent.sock"),
                  diag_dir=str(workdir / "diag"))
    ok &= bench_call("sidecar absent", mon, calls)
    mon.close()
    mon = Monitor(enabled=False)
    bench_call("disabled", mon, calls)
    return ok


STEP_TIME_RE = re.compile(r"step_time(?:_seconds)?[=:]\s*([0-9.]+)")


def _mean_step_time(log: Path) -> float | None:
    values = [float(m.group(1)) for m in STEP_TIME_RE.finditer(log.read_text(errors="replace"))]
    values = values[len(values) // 5:]  # skip warm-up
    return statistics.fmean(values) if values else None


def run_training(workdir: Path, enabled: bool, steps: int, sidecar: Sidecar) -> float | None:
    name = "on" if enabled else "off"
    run_dir = workdir / f"train-{name}"
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "torchrun.log"
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "-m", "trainer",
           "--set", f"monitor.enabled={'true' if enabled else 'false'}",
           "--set", f"train.steps={steps}",
           "--set", f"checkpoint.dir={run_dir / 'ckpt'}"]
    with spawned(cmd, log, env=sidecar.hook_env(), cwd=ROOT) as proc:
        try:
            rc = proc.wait(timeout=600)
        except Exception:
            rc = None
    if rc != 0:
        print(f"training with monitor {name} failed (exit {rc}):\n{tail(log, 20)}")
        return None
    return _mean_step_time(log)


def bench_training(workdir: Path, steps: int) -> bool:
    with Sidecar(workdir / "train-sidecar", "watchdog.observe_only=true") as sidecar:
        off = run_training(workdir, False, steps, sidecar)
        on = run_training(workdir, True, steps, sidecar)
    if off is None or on is None:
        print("training comparison: could not read step times from the trainer's log "
              "(expected 'step_time=<seconds>' lines)")
        return False
    ratio = on / off
    print(f"2-rank CPU training, {steps} steps: mean step time hooks off={off * 1000:.2f} ms  "
          f"on={on * 1000:.2f} ms  ratio on/off={ratio:.3f}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000, help="hook calls per measurement")
    parser.add_argument("--training", action="store_true", help="also compare 2-rank training, hooks on vs off")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (--training)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-hooks-") as tmp:
        workdir = Path(tmp)
        ok = bench_hook_calls(args.calls, workdir)
        if args.training:
            ok &= bench_training(workdir, args.steps)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
