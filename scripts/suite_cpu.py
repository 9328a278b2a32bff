"""Sum the CPU time per test that `SUITE_CPU_DIR=<dir> make test` recorded (tests/support/cpu_account.py):
the total, the time per area (the tests' first directory) and the N costliest tests.

    python scripts/suite_cpu.py <dir> [N]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(argv: list[str]) -> int:
    if not argv or not Path(argv[0]).is_dir():
        print(__doc__.strip(), file=sys.stderr)
        return 2
    top = int(argv[1]) if len(argv) > 1 else 25
    records = [json.loads(line) for f in sorted(Path(argv[0]).glob("*.jsonl")) for line in f.read_text().splitlines()]
    if not records:
        print(f"no records under {argv[0]}", file=sys.stderr)
        return 1
    areas: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for r in records:
        parts = r["test"].split("::")[0].split("/")
        area = parts[1] if len(parts) > 2 else parts[-1]
        areas[area][0] += r["cpu_s"]
        areas[area][1] += r["wall_s"]
        areas[area][2] += 1
    total_cpu = sum(r["cpu_s"] for r in records)
    total_wall = sum(r["wall_s"] for r in records)
    print(f"{len(records)} tests: {total_cpu:.0f} CPU-s, {total_wall:.0f} s of test time")
    print("\nper area (CPU-s, test s, tests):")
    for area, (cpu, wall, n) in sorted(areas.items(), key=lambda kv: -kv[1][0]):
        print(f"  {area:<14} {cpu:7.1f} {wall:7.1f} {n:5d}")
    print(f"\nthe {top} costliest tests (CPU-s, test s):")
    for r in sorted(records, key=lambda r: -r["cpu_s"])[:top]:
        print(f"  {r['cpu_s']:7.1f} {r['wall_s']:7.1f}  {r['test']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
