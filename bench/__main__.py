"""Run every benchmark in bench/ in turn (`make bench` or `python -m bench [NAME ...]`).

Each benchmark is its own module that prints its figures, its targets and PASS/FAIL; this
runner only sequences them and summarises their exit codes.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = [
    "bench_hooks",
    "bench_ingest",
    "bench_metrics",
    "bench_trainer",
    "bench_recovery",
    "bench_recovery --long --nodes 3 --faults mixed",
    "bench_cycles",
    "bench_jobview",
    "bench_race",
    "bench_race --field",
    "bench_jobview_scale",
    "bench_hang_kinds",
    "bench_field_pauses",
    "bench_stragglers",
    "bench_scale",
]


def main(argv: list[str]) -> int:
    names = argv or [n for n in ORDER if (HERE / f"{n.split()[0]}.py").exists()]
    results = []
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        start = time.monotonic()
        module, *args = name.split()  # an entry may carry its options: "bench_race --field"
        rc = subprocess.call([sys.executable, "-m", f"bench.{module}", *args], cwd=HERE.parent)
        results.append((name, rc, time.monotonic() - start))
    print("\n=== summary ===")
    for name, rc, seconds in results:
        print(f"{name:<20} {'PASS' if rc == 0 else f'FAIL (exit {rc})':<14} {seconds:6.1f} s")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
