"""What checkpoints and a crash cost the bundled trainer (2 ranks, CPU, gloo).

    python -m bench.bench_trainer [--hidden 1024] [--steps 40]

Figures, for a model of `--hidden` width: the training thread's cost of a memory snapshot every
step (median it/s with `checkpoint.memory_every_steps=1` against 0), the median atomic disk
checkpoint (write, fsync, checksums, commit; in the background), and the recovery of a run whose
rank 1 is SIGKILLed: the time from the fault to "resumed from step", where the state came from,
the steps redone, and whether its final parameters are bitwise equal to an uninterrupted run's
(the target: they are).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support import PYTHON, spawned, tail  # noqa: E402

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def run(workdir: Path, hidden: int, steps: int, *settings: str) -> str:
    workdir.mkdir(parents=True)
    log = workdir / "torchrun.log"
    cmd = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "-m",
        "sidecar_trainer",
        "--set",
        f"checkpoint.dir={workdir / 'ckpt'}",
        "--set",
        f"train.steps={steps}",
        "--set",
        "checkpoint.every_steps=10",
        "--set",
        "monitor.enabled=false",
        "--set",
        "train.log_every_steps=10",
        "--set",
        f"model.kwargs={{hidden: {hidden}, layers: 4}}",
    ]
    for s in settings:
        cmd += ["--set", s]
    with spawned(cmd, log) as proc:
        if proc.wait(timeout=900) != 0:
            raise SystemExit(f"trainer failed:\n{tail(log)}")
    return log.read_text(errors="replace")


def found(pattern: str | re.Pattern[str], text: str) -> str:
    """The first group of `pattern`'s first match in `text` (its absence ends the benchmark)."""
    m = re.search(pattern, text)
    if m is None:
        raise SystemExit(f"not in the trainer's log: {pattern}")
    return m[1]


def when(log: str, needle: str) -> datetime:
    line = next(line for line in log.splitlines() if needle in line)
    return datetime.strptime(found(STAMP, line), "%Y-%m-%d %H:%M:%S,%f")


def digest(log: str) -> str:
    return re.findall(r"params_sha256=(\w+)", log)[-1]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    params = 32 * args.hidden + 3 * args.hidden * args.hidden + args.hidden * 8
    with tempfile.TemporaryDirectory() as tmp:
        clean = run(Path(tmp) / "clean", args.hidden, args.steps)
        disk_only = run(Path(tmp) / "disk-only", args.hidden, args.steps, "checkpoint.memory_every_steps=0")
        killed = run(
            Path(tmp) / "killed",
            args.hidden,
            args.steps,
            "faults.kind=sigkill",
            "faults.rank=1",
            f"faults.at_step={args.steps // 2 + 3}",
        )
    saves = [float(s) for s in re.findall(r"checkpoint saved: .* seconds=([0-9.]+)", clean)]
    rates = statistics.median(float(r) for r in re.findall(r"it/s=([0-9.]+)", clean))
    rates_disk_only = statistics.median(float(r) for r in re.findall(r"it/s=([0-9.]+)", disk_only))
    recovery = (when(killed, "resumed from step") - when(killed, "fault injection")).total_seconds()
    resumed = int(found(r"resumed from step (\d+)", killed))
    source = found(r"checkpoint loaded: step=\d+ source=(\w+)", killed)
    exact = digest(clean) == digest(killed) == digest(disk_only)
    print(f"model: ~{params / 1e6:.1f} M parameters (+2x AdamW state), 2 ranks, CPU/gloo")
    print(
        f"memory snapshot every step: {rates:.1f} it/s against {rates_disk_only:.1f} without "
        f"({1000 / rates - 1000 / rates_disk_only:+.1f} ms a step on the training thread)"
    )
    print(f"disk checkpoint (background): median {statistics.median(saves):.3f} s over {len(saves)} saves")
    print(
        f"recovery: {recovery:.1f} s from SIGKILL to 'resumed from step {resumed}' from {source} "
        f"({args.steps // 2 + 3 - 1 - resumed} finished steps redone)"
    )
    print(f"final parameters bitwise equal to the uninterrupted runs: {exact}  {'PASS' if exact else 'FAIL'}")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
