"""Hang -> kill -> restart cycles for user-shaped scripts: do they come back, and how fast.

    python -m bench.bench_cycles                       # plain, hf, lightning: 10 cycles each (~4 min)
    python -m bench.bench_cycles --cycles 5 plain      # fewer cycles, one script
    python -m bench.bench_cycles --baseline            # torchrun alone, rank 1 SIGKILLed: without / with
                                                       # trainer_hooks.distributed (SIDECAR_ATTEMPT_STORE=0/1)
    python -m bench.bench_cycles --ft-launcher         # the same cycles under NVIDIA's ft_launcher
    python -m bench.bench_cycles --warm                # also under `python -m trainer_hooks.launch --warm`

Each script (bench/cycles/train_*.py) runs 2 ranks with gloo on the CPU under `torchrun
--standalone`; in each of the first N attempts rank 1 SIGSTOPs itself after about 1.5 s of
training; the sidecar (step floor 2 s, grace 1 s) detects the stall and kills the group, and
torchrun starts the next attempt. Recovery time: the hang -> every rank's first step of the next
attempt. Target: every cycle comes back (N/N) and the job finishes.

ft_launcher comes from nvidia-resiliency-ext, not a dependency of this project: installed on first
use into build/nvrx (bench/nvrx.py), or FT_LAUNCHER_PYTHONPATH names a directory that has it.

`--warm` (launcher `warm`): the workers of every attempt are forks of a server that imported torch
and the script's heavy modules once (trainer_hooks/warm.py; WARM_PRELOAD per script).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench import nvrx
from bench.cycles import runner
from bench.cycles.runner import SCRIPTS, run_cycles

# What `--warm` preloads besides trainer_hooks.warm.PRELOAD: each script's heavy imports.
WARM_PRELOAD = {
    "hf": "transformers,transformers.trainer,trainer_hooks.hf",
    "lightning": "lightning.pytorch,trainer_hooks.lightning",
    "unmodified": "trainer_hooks.attach",
}


def warm_command(script: Path, nproc: int, max_restarts: int, attach: bool = False) -> list[str]:
    """`python -m trainer_hooks.launch --warm` with the cycle's torchrun arguments."""
    torchrun = runner.launcher_command("torchrun", script, nproc, max_restarts, attach=attach)
    preload = WARM_PRELOAD.get(script.stem.removeprefix("train_"))
    extra = ["--preload", preload] if preload else []
    return [sys.executable, "-m", "trainer_hooks.launch", "--warm", *extra, *torchrun[3:]]


@contextlib.contextmanager
def warm_launcher() -> Iterator[None]:
    """Within: `run_cycles(..., launcher="warm")` runs the job under the warm launcher."""
    original = runner.launcher_command

    def command(launcher: str, script: Path, nproc: int, max_restarts: int, attach: bool = False) -> list[str]:
        if launcher == "warm":
            return warm_command(script, nproc, max_restarts, attach)
        return original(launcher, script, nproc, max_restarts, attach)

    runner.launcher_command = command
    try:
        yield
    finally:
        runner.launcher_command = original


def ft_available() -> bool:
    """ft_launcher on the path of this process and its children (installed on first use: bench/nvrx.py)."""
    extra = nvrx.ensure()
    if extra:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (extra, os.environ.get("PYTHONPATH")) if p)
        sys.path.insert(0, extra)
    return importlib.util.find_spec("nvidia_resiliency_ext") is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "scripts", nargs="*", default=[], metavar="SCRIPT", help=f"which of {', '.join(SCRIPTS)} (default: all)"
    )
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="torchrun alone with rank 1 SIGKILLed, without and with the remedy (plain script)",
    )
    parser.add_argument("--ft-launcher", action="store_true", help="also run the cycles under ft_launcher")
    parser.add_argument(
        "--warm", action="store_true", help="also run the cycles under `python -m trainer_hooks.launch --warm`"
    )
    parser.add_argument("--no-torchrun", action="store_true", help="skip the cycles under plain torchrun")
    args = parser.parse_args(argv)
    scripts = args.scripts or list(SCRIPTS)
    unknown = [s for s in scripts if s not in SCRIPTS]
    if unknown:
        parser.error(f"unknown script(s) {', '.join(unknown)}; choose from {', '.join(SCRIPTS)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-cycles-") as tmp:
        if args.baseline:
            for fix in ("0", "1"):
                r = run_cycles(
                    "plain",
                    Path(tmp) / f"baseline-{fix}",
                    cycles=args.cycles,
                    sidecar=False,
                    hang_mode="kill",
                    extra_env={"SIDECAR_ATTEMPT_STORE": fix},
                    timeout=300,
                )
                print(f"torchrun alone, SIGKILL, SIDECAR_ATTEMPT_STORE={fix}: {r.line()}", flush=True)
                results.append((r, fix == "1"))
        launchers = (
            ([] if args.no_torchrun else ["torchrun"])
            + (["warm"] if args.warm else [])
            + (["ft_launcher"] if args.ft_launcher else [])
        )
        if args.ft_launcher and not ft_available():
            print("ft_launcher: nvidia-resiliency-ext is not installed; skipped")
            launchers.remove("ft_launcher")
        for launcher in launchers:
            for script in scripts:
                with warm_launcher():
                    r = run_cycles(script, Path(tmp) / f"{launcher}-{script}", cycles=args.cycles, launcher=launcher)
                print(r.line(), flush=True)
                results.append((r, True))
    print("\nscript     launcher    came back   median hang->training")
    for r, _ in results:
        med = f"{r.median:.2f} s" if r.median is not None else "-"
        print(f"{r.script:<10} {r.launcher:<11} {r.came_back:>2}/{r.cycles:<7}  {med}")
    failed = [r for r, must_pass in results if must_pass and (r.came_back != r.cycles or not r.finished)]
    print("PASS" if not failed else f"FAIL: {', '.join(f'{r.script}/{r.launcher}' for r in failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
