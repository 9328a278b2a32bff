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
5. The hooks' collective record on NCCL (trainer_hooks/collectives.py), where torch sees a CUDA
   device and has NCCL: a 1-rank NCCL job in a child process (tcp store on 127.0.0.1,
   TORCH_FR_BUFFER_SIZE=64) all-reduces 5 times on the default group, once on a gloo group and 3
   times on an NCCL subgroup, synchronizes, and checks that `collectives.read()` has the default
   group with enqueued == completed, that the subgroup keeps its own name and count, and that
   `dump_json()` returns NCCL's entries; it shows what each of torch's dump bindings holds and
   what a read costs there.

Without an NVIDIA driver, sections 1-4 print "no NVIDIA driver: skipped"; without a CUDA device
or NCCL in torch, section 5 prints one line saying why it is skipped; both exit 0. Exit 1 when a
check fails. `--nvml-module sidecar.testing.fake_nvml_lib` (with SIDECAR_FAKE_NVML naming a
spec file) runs 1-4 on the fake library.
"""

from __future__ import annotations

import argparse
import importlib
import json
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
from tests.support import Sidecar, free_port, http_get, wait_until  # noqa: E402

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
    lines, failures = [f"GPU indexes: {', '.join(gpus) or 'none'}" + (f"; lost: {', '.join(lost)}" if lost else "")], []
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


def check_gpu_collector(module_name: str, rounds: int) -> list[str]:
    """Sections 1-4: the GPU collector on this machine's NVML; the failures."""
    failures: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        text = scrape(module_name, work)
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
        cost = nvml_calls.measure(module_name, rounds=rounds)
        print(f"{cost.gpus} GPUs: " + cost.line(interval=5.0))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return failures


# ---------------------------------------------------------------- 5. the collective record on NCCL

COLLECTIVES = "collective record (NCCL Flight Recorder)"
DEFAULT_REDUCES, SUB_REDUCES = 5, 3


def nccl_absent() -> str | None:
    """Why a 1-rank NCCL job cannot run here, or None."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        return f"cannot import torch: {e}"
    if not dist.is_available() or not dist.is_nccl_available():
        return f"torch {torch.__version__} has no NCCL"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda or 'none'})"
    return None


def collectives_worker(out: str) -> int:
    """The child: a 1-rank NCCL job with the hooks' recorder settings; writes what it saw to `out`."""
    from trainer_hooks import collectives

    collectives.enable()  # TORCH_FR_BUFFER_SIZE=64 before the group forms (the parent set it too)
    import torch
    import torch.distributed as dist

    found: dict = {"buffer": os.environ.get(collectives.BUFFER_ENV)}
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, device_id=device
    )
    try:
        t = torch.ones(1 << 20, device=device)
        for _ in range(DEFAULT_REDUCES):
            dist.all_reduce(t)
        gloo = dist.new_group([0], backend="gloo", group_desc="cpu")  # named "1": a gloo group between
        dist.all_reduce(torch.ones(4), group=gloo)
        sub = dist.new_group([0], group_desc="sub")  # named "2"; NCCL's second group (its pg_id is 1)
        found["sub_name"] = str(dist.distributed_c10d._get_process_group_name(sub))
        for _ in range(SUB_REDUCES):
            dist.all_reduce(t, group=sub)
        torch.cuda.synchronize()
        c10d = torch._C._distributed_c10d
        bindings = [n for n in ("_dump_fr_trace_json", "_dump_nccl_trace_json") if hasattr(c10d, n)]
        deadline = time.monotonic() + 5.0  # the watchdog thread marks completions (about every 100 ms)
        while time.monotonic() < deadline:
            raw = getattr(c10d, bindings[-1])(includeCollectives=True, onlyActive=False)
            status = json.loads(raw).get("pg_status") or {}
            if all(s["last_enqueued_collective"] == s["last_completed_collective"] for s in status.values()):
                break
            time.sleep(0.05)
        found["record"] = collectives.read()
        whole = collectives.dump_json()
        found["dump_json"] = None
        if whole is not None:
            found["dump_json"] = {
                "entries": [e.get("profiling_name") for e in whole.get("entries") or []],
                "pg_config": sorted(whole.get("pg_config") or {}),
            }
        found["bindings"] = {}
        for name in bindings:
            dump = json.loads(getattr(c10d, name)(includeCollectives=True, onlyActive=False))
            found["bindings"][name] = {
                "entries": [(e.get("pg_id"), (e.get("process_group") or ["?"])[0], e.get("profiling_name"),
                             e.get("state")) for e in dump.get("entries") or []],
                "pg_status": dump.get("pg_status"),
                "pg_config": dump.get("pg_config"),
            }  # fmt: skip
        reads, start = 0, time.perf_counter()
        while reads < 200:
            collectives.read()
            reads += 1
        found["read_us"] = (time.perf_counter() - start) / reads * 1e6
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(found))
    return 0


def check_collectives() -> tuple[bool, list[str]]:
    """Section 5: (whether it ran, the failures)."""
    why = nccl_absent()
    if why is not None:
        print(f"{COLLECTIVES}: skipped ({why})")
        return False, []
    with tempfile.TemporaryDirectory(prefix="gpu-check-fr-") as tmp:
        out = os.path.join(tmp, "found.json")
        env = dict(os.environ, TORCH_FR_BUFFER_SIZE="64")
        env.pop("SIDECAR_COLLECTIVES", None)
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "bench.gpu_check", "--collectives-worker", out],
                cwd=ROOT, env=env, capture_output=True, timeout=300, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            print(f"{COLLECTIVES}: FAIL (the 1-rank NCCL job did not finish in 300 s)")
            return True, [f"{COLLECTIVES}: the 1-rank NCCL job hung"]
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stdout + proc.stderr).decode(errors="replace").strip().splitlines()[-15:]
            print(f"{COLLECTIVES}: FAIL (the 1-rank NCCL job exited {proc.returncode})\n" + "\n".join(tail))
            return True, [f"{COLLECTIVES}: the 1-rank NCCL job failed"]
        found = json.loads(Path(out).read_text())
    return True, judge_collectives(found)


def _recent_ok(recent: object, count: int) -> bool:
    """The lateness entries (issue 30): the last `count` sequences, ascending, with recent wall times."""
    if not isinstance(recent, list) or len(recent) < count:
        return False
    seqs = [pair[0] for pair in recent]
    times = [pair[1] for pair in recent]
    return seqs == sorted(seqs) and seqs[-1] == count and all(abs(time.time() - t) < 600 for t in times)


def judge_collectives(found: dict) -> list[str]:
    """PASS/FAIL lines for what the child saw; the failures."""
    rec = found.get("record")
    groups = {g["pg"]: g for g in (rec or {}).get("groups", [])}
    default, sub = groups.get("0"), groups.get(found.get("sub_name", "2"))
    whole = found.get("dump_json")
    nccl_entries = [n for n in (whole or {}).get("entries", []) if str(n).startswith("nccl:")]

    def seqs(g: dict | None) -> str:
        return "absent" if g is None else f"enqueued {g['enqueued']}, completed {g['completed']}"

    checks = [
        ("read() returns a record", rec is not None, "None" if rec is None else f"{len(groups)} groups"),
        ("the record has the default group", default is not None, f"groups {sorted(groups)}"),
        (
            f"default group: enqueued == completed == {DEFAULT_REDUCES} after synchronize",
            default is not None and default["enqueued"] == default["completed"] == DEFAULT_REDUCES,
            seqs(default),
        ),
        (
            f"NCCL subgroup {found.get('sub_name')!r} keeps its name: enqueued == completed == {SUB_REDUCES}",
            sub is not None and sub["enqueued"] == sub["completed"] == SUB_REDUCES and sub["desc"] == "sub",
            seqs(sub),
        ),
        (
            f"default group: `recent` has the entry times of its {DEFAULT_REDUCES} all-reduces (ascending, Unix s)",
            default is not None and _recent_ok(default.get("recent"), DEFAULT_REDUCES),
            "absent" if default is None else f"recent {default.get('recent')}",
        ),
        (
            "dump_json() returns NCCL's entries",
            whole is not None and len(nccl_entries) >= DEFAULT_REDUCES + SUB_REDUCES and "0" in whole["pg_config"],
            "None" if whole is None else f"{len(nccl_entries)} nccl entries, pg_config {whole['pg_config']}",
        ),
    ]
    failures = []
    for what, ok, detail in checks:
        print(f"{COLLECTIVES}: {'PASS' if ok else 'FAIL'} {what} ({detail})")
        if not ok:
            failures.append(f"{COLLECTIVES}: {what}")
    for name, seen in sorted(found.get("bindings", {}).items()):
        backends = sorted({str(e[2]).split(":")[0] for e in seen["entries"]})
        status, config = json.dumps(seen["pg_status"], sort_keys=True), sorted(seen["pg_config"] or {})
        print(
            f"{COLLECTIVES}: {name} holds {len(seen['entries'])} entries ({', '.join(backends) or 'none'}); "
            f"pg_status {status}; pg_config keys {config}"
        )
    if "read_us" in found:
        read = f"{found['read_us']:.0f} us per read (TORCH_FR_BUFFER_SIZE={found['buffer']})"
        print(f"{COLLECTIVES}: collectives.read() {read}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvml-module", default="pynvml")
    parser.add_argument("--rounds", type=int, default=5, help="collector rounds timed per kind (fast, health)")
    parser.add_argument("--collectives-worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.collectives_worker:
        return collectives_worker(args.collectives_worker)

    failures: list[str] = []
    ran = False
    why = nvml_absent(args.nvml_module)
    if why is not None:
        print(f"no NVIDIA driver: skipped ({why})")
    else:
        ran = True
        failures += check_gpu_collector(args.nvml_module, args.rounds)
    ran_collectives, missing = check_collectives()
    ran |= ran_collectives
    failures += missing
    for f in failures:
        print(f"FAIL: {f}")
    print("gpu check: " + ("FAILED" if failures else "passed" if ran else "skipped (nothing to check here)"))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
