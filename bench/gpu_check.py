"""Check the GPU collector on this machine's real NVML (a GPU node): `make gpu-check`.

    python -m bench.gpu_check [--nvml-module pynvml] [--rounds 5]

1. Starts a real `sidecar run` with the GPU collector on NVML, waits for its first GPU round
   and scrapes /metrics.
2. `promtool check metrics` on the exposition.
3. For every GPU and every per-GPU family docs/metrics.md promises: the series is there, or
   `sidecar_gpu_field_unavailable` names the field with NVML's reason. A family missing with no
   reason fails the check. Conditional families (NVLink, XIDs, per-rank memory) are listed.
4. Times collector rounds per GPU in this process (real pynvml, calls counted at its symbol
   lookup): NVML calls and milliseconds per GPU, fast rounds and rounds with the health read.

Without an NVIDIA driver it prints "no NVIDIA driver: skipped" and exits 0. Exit 1 when a
check fails. `--nvml-module sidecar.testing.fake_nvml_lib` (with SIDECAR_FAKE_NVML naming a
spec file) runs it on the fake library, which is how its own test runs it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import nvml_calls  # noqa: E402
from sidecar.collectors.gpu import CONDITIONAL, FIELDS_OF  # noqa: E402
from tests.support import Sidecar, http_get, wait_until  # noqa: E402

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$", re.MULTILINE)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def nvml_absent(module_name: str) -> str | None:
    """Why there is no usable NVIDIA driver here, or None when NVML initializes."""
    try:
        nv = importlib.import_module(module_name)
    except ImportError as e:
        return f"cannot import {module_name}: {e}"
    try:
        nv.nvmlInit()
    except (nv.NVMLError_LibraryNotFound, nv.NVMLError_DriverNotLoaded) as e:
        return str(e)
    nv.nvmlShutdown()
    return None


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(m.group(1), dict(LABEL.findall(m.group(2))), float(m.group(3))) for m in SAMPLE.finditer(text)]


def check_families(text: str) -> tuple[list[str], list[str]]:
    """(report lines, failures) for every GPU and every promised per-GPU family."""
    found = samples(text)
    gpus = sorted({labels["gpu"] for name, labels, _ in found if name == "sidecar_gpu_info"}, key=int)
    lost = sorted({labels["gpu"] for name, labels, v in found if name == "sidecar_gpu_lost" and v == 1})
    unavailable: dict[tuple[str, str], str] = {
        (labels["gpu"], labels["field"]): labels["reason"]
        for name, labels, _ in found
        if name == "sidecar_gpu_field_unavailable"
    }
    present = {(name, labels.get("gpu", "")) for name, labels, _ in found}
    lines, failures = [f"GPUs: {', '.join(gpus) or 'none'}" + (f"; lost: {', '.join(lost)}" if lost else "")], []
    for family, fields in sorted(FIELDS_OF.items()):
        for gpu in gpus:
            if (family, gpu) in present or (family + "_total", gpu) in present:
                continue
            reasons = [f"{f}: {unavailable[(gpu, f)]}" for f in fields if (gpu, f) in unavailable]
            if reasons:
                lines.append(f"gpu {gpu}: {family} unavailable ({', '.join(reasons)})")
            else:
                failures.append(
                    f"gpu {gpu}: {family} missing and no reason reported "
                    f"(sidecar_gpu_field_unavailable has none of {', '.join(fields)})"
                )
    for family, when in sorted(CONDITIONAL.items()):
        have = sorted({g for n, g in present if n in (family, family + "_total")})
        lines.append(f"{family}: {'gpu ' + ','.join(have) if have else 'absent'} (only for {when})")
    return lines, failures


def promtool_check(text: str) -> tuple[bool, str]:
    if not os.access(PROMTOOL, os.X_OK):
        return False, f"{PROMTOOL} not found"
    proc = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60, check=False
    )
    return proc.returncode == 0, (proc.stdout + proc.stderr).decode().strip()


def scrape(module_name: str, work: Path) -> str:
    sidecar = Sidecar(
        work,
        f"collectors.nvml_module={module_name}",
        f"checkpoint_dir={work}",
        "log_level=info",
        env={k: v for k, v in os.environ.items() if k.startswith("SIDECAR_FAKE")},
    )
    with sidecar:

        def gpu_round() -> bool:
            status, body = http_get(sidecar.url + "/metrics")
            return status == 200 and b'sidecar_scrape_collector_success{collector="gpu"}' in body

        wait_until(gpu_round, 60, interval=0.5, what="the GPU collector's first round")
        time.sleep(1.5)  # one more round, so every health field had its read
        return sidecar.metrics()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvml-module", default="pynvml")
    parser.add_argument("--rounds", type=int, default=5, help="collector rounds timed per kind (fast, health)")
    args = parser.parse_args(argv)

    why = nvml_absent(args.nvml_module)
    if why is not None:
        print(f"no NVIDIA driver: skipped ({why})")
        return 0
    failures: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        text = scrape(args.nvml_module, work)
        ok, out = promtool_check(text)
        print(f"promtool check metrics: {'ok' if ok else 'FAILED'}" + (f"\n{out}" if out else ""))
        if not ok:
            failures.append("promtool check metrics")
        success = re.search(r'sidecar_scrape_collector_success\{collector="gpu"\} (\S+)', text)
        duration = re.search(r'sidecar_scrape_collector_duration_seconds\{collector="gpu"\} (\S+)', text)
        print(
            f"gpu collector in the sidecar: success {success.group(1) if success else '?'}, last round "
            f"{float(duration.group(1)) * 1000 if duration else float('nan'):.1f} ms"
        )
        lines, missing = check_families(text)
        for line in lines:
            print(line)
        failures += missing
        cost = nvml_calls.measure(args.nvml_module, rounds=args.rounds)
        print(f"{cost.gpus} GPUs: " + cost.line(interval=5.0))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for f in failures:
        print(f"FAIL: {f}")
    print("gpu check: " + ("FAILED" if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
