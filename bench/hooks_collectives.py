"""bench_hooks' Flight Recorder part (`python -m bench.bench_hooks --collectives`): what reading
torch's collective record costs the hooks' sender thread, and a 2-rank job's step time with the
record on and off. Workers run as `python -m bench.bench_hooks --fr-worker KIND`."""

from __future__ import annotations

import gc
import json
import os
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

from tests.support import PYTHON, Sidecar  # noqa: E402
from trainer_hooks import Monitor  # noqa: E402

MEDIAN_TARGET_US = 2.0
P99_TARGET_US = 20.0


FR_RESULT = "FR-RESULT "  # a worker's result line on its stdout
FR_READ_SIZES = (64, 2000)
FR_CONFIGS: dict[str, dict[str, str]] = {  # label -> environment of the training worker
    "FR off": {"SIDECAR_COLLECTIVES": "0", "TORCH_FR_BUFFER_SIZE": "0"},
    "FR 64": {"TORCH_FR_BUFFER_SIZE": "64"},
    "FR 64, read every push": {"TORCH_FR_BUFFER_SIZE": "64", "BENCH_FR_READ_EVERY": "0"},
    "FR 2000": {"TORCH_FR_BUFFER_SIZE": "2000"},
}


def _gloo_world(tmp: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)


def _timed_us(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return sorted(out)


def fr_read_worker(reps: int) -> int:
    """This process (TORCH_FR_BUFFER_SIZE set by the parent): a full ring, then each part of a read timed."""
    import torch
    import torch.distributed as dist

    from trainer_hooks import collectives

    size = int(os.environ["TORCH_FR_BUFFER_SIZE"])
    with tempfile.TemporaryDirectory(prefix="bench-fr-") as tmp:
        _gloo_world(tmp)
        groups = [None, dist.new_group([0], group_desc="dp"), dist.new_group([0], group_desc="tp")]
        t = torch.ones(1024)
        for i in range(size + size // 10 + 10):
            dist.all_reduce(t, group=groups[i % 3])
        dump_fr = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json")  # noqa: B009  (no stub for it)

        def dump() -> bytes:
            return dump_fr(includeCollectives=True, onlyActive=False)

        raw = dump()
        trace, members = json.loads(raw), collectives._members()
        parts = {
            "dump": _timed_us(dump, reps),
            "loads": _timed_us(lambda: json.loads(raw), reps),
            "summarize": _timed_us(lambda: collectives.summarize(trace, members, time.time()), reps),
            "read": _timed_us(collectives.read, reps),
            "dump_json": _timed_us(collectives.dump_json, max(5, reps // 4)),
        }
        cpu0 = time.thread_time()
        for _ in range(reps):
            collectives.read()
        read_cpu_us = (time.thread_time() - cpu0) / reps * 1e6
        dist.destroy_process_group()
    result = {
        "size": size, "entries": len(trace.get("entries") or []), "bytes": len(raw), "read_cpu_us": read_cpu_us,
        **{k: {"median": statistics.median(v), "p90": _quantile(v, 0.9)} for k, v in parts.items()},
    }  # fmt: skip
    print(FR_RESULT + json.dumps(result), flush=True)
    return 0


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def fr_training_worker(label: str, socket_path: str, steps: int) -> int:
    """A 1-rank gloo training loop with the Monitor on (this process is the rank); FR set by the
    parent's environment. Step times, one all-reduce alone, and the hooks' thread's CPU."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from trainer_hooks import collectives

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mon = Monitor(job_id="bench-fr-" + re.sub(r"\W+", "-", label).strip("-").lower(), rank=0, world_size=1,
                  socket=socket_path)  # fmt: skip
    deadline = time.monotonic() + 15
    while not mon.registered and time.monotonic() < deadline:
        time.sleep(0.05)
    if not mon.registered:
        print(f"{label}: the monitor did not register with the sidecar", flush=True)
        return 1
    if "BENCH_FR_READ_EVERY" in os.environ:
        collectives.READ_EVERY_SECONDS = float(os.environ["BENCH_FR_READ_EVERY"])
    reads = [0]
    read = collectives.read

    def counted(now: float | None = None, whole: bool = False, clock_offset: float = 0.0) -> dict | None:
        reads[0] += 1
        return read(now, whole, clock_offset)

    collectives.read = counted  # the sender thread calls it through the module
    with tempfile.TemporaryDirectory(prefix="bench-fr-") as tmp:
        _gloo_world(tmp)
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        )  # fmt: skip
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=0.01)
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

        def step(i: int) -> None:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            for q in params:  # 6 gradient all-reduces
                assert q.grad is not None
                dist.all_reduce(q.grad)
            opt.step()
            mon.step(i, loss=loss.detach())

        for i in range(200):  # warm-up
            step(i)
        gc.collect()
        times = []
        sender0, coll0, reads0 = mon.sender_cpu_seconds, _collectives_cpu(mon), reads[0]
        start, cpu0 = time.monotonic(), time.thread_time()
        for i in range(200, 200 + steps):
            t0 = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - t0)
        seconds, step_cpu = time.monotonic() - start, (time.thread_time() - cpu0) / steps
        sender, coll, n_reads = mon.sender_cpu_seconds - sender0, _collectives_cpu(mon) - coll0, reads[0] - reads0
        small = torch.ones(1024)
        reduce_us = _timed_us(lambda: dist.all_reduce(small), 3000)
        cpu0 = time.thread_time()
        for _ in range(3000):
            dist.all_reduce(small)
        reduce_cpu_us = (time.thread_time() - cpu0) / 3000 * 1e6
        dist.destroy_process_group()
    mon.close()
    times.sort()
    result = {
        "label": label, "steps": steps, "seconds": seconds, "mean_ms": statistics.fmean(times) * 1e3,
        "p50_ms": times[len(times) // 2] * 1e3, "p99_ms": _quantile(times, 0.99) * 1e3, "max_ms": times[-1] * 1e3,
        "all_reduce_us": statistics.median(reduce_us), "all_reduce_cpu_us": reduce_cpu_us,
        "step_cpu_ms": step_cpu * 1e3, "reads": n_reads, "collectives_cpu": coll,
        "sender_cpu": sender, "buffer": os.environ.get("TORCH_FR_BUFFER_SIZE"),
    }  # fmt: skip
    print(FR_RESULT + json.dumps(result), flush=True)
    return 0


def _collectives_cpu(mon: Monitor) -> float:
    sender = getattr(mon, "_sender", None)
    return float(getattr(sender, "collectives_cpu_seconds", 0.0))


def _fr_run(args: list[str], env: dict[str, str]) -> dict | None:
    full = {k: v for k, v in os.environ.items() if k not in ("TORCH_FR_BUFFER_SIZE", "SIDECAR_COLLECTIVES")}
    full.update(env)
    proc = subprocess.run(
        [PYTHON, "-m", "bench.bench_hooks", *args], cwd=ROOT, env=full, capture_output=True, text=True, check=False
    )
    for line in proc.stdout.splitlines():
        if line.startswith(FR_RESULT):
            return json.loads(line[len(FR_RESULT) :])
    print(f"flight recorder worker {args} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return None


def bench_collectives(workdir: Path, steps: int, rounds: int) -> bool:
    ok = True
    for size in FR_READ_SIZES:
        r = _fr_run(
            ["--fr-worker", "read", "--calls", str(200 if size <= 64 else 40)], {"TORCH_FR_BUFFER_SIZE": str(size)}
        )
        if r is None:
            ok = False
            continue
        print(
            f"FR read, ring of {size} ({r['entries']} entries, {r['bytes'] / 1024:.0f} KiB of JSON): "
            f"collectives.read() median {r['read']['median']:.0f} us (p90 {r['read']['p90']:.0f} us, "
            f"{r['read_cpu_us']:.0f} us of CPU) = torch's dump {r['dump']['median']:.0f} us + json.loads "
            f"{r['loads']['median']:.0f} us + summarize {r['summarize']['median']:.0f} us; "
            f"dump_json() {r['dump_json']['median']:.0f} us",
            flush=True,
        )
    runs: dict[str, list[dict]] = {label: [] for label in FR_CONFIGS}
    with Sidecar(workdir / "fr-sidecar", "watchdog.observe_only=true") as sidecar:
        labels = list(FR_CONFIGS)
        for n in range(rounds):
            for label in labels[n % len(labels) :] + labels[: n % len(labels)]:  # each kind in each position
                env = FR_CONFIGS[label]
                r = _fr_run(["--fr-worker", label, "--socket", sidecar.socket, "--steps", str(steps)], env)
                if r is None:
                    return False
                runs[label].append(r)

    def mean(rs: list[dict], key: str) -> float:
        return statistics.fmean(r[key] for r in rs)

    off = {key: mean(runs["FR off"], key) for key in ("mean_ms", "step_cpu_ms", "all_reduce_us", "all_reduce_cpu_us")}
    print(
        f"training step, 1-rank gloo MLP with 6 all-reduces a step, Monitor on a live sidecar, {rounds} rounds "
        f"(the kinds in rotating order) x {steps} steps; wall clock, then the training thread's CPU:"
    )
    for label, rs in runs.items():
        wall, cpu = mean(rs, "mean_ms"), mean(rs, "step_cpu_ms")
        reduce, reduce_cpu = mean(rs, "all_reduce_us"), mean(rs, "all_reduce_cpu_us")
        more = reduce_cpu - off["all_reduce_cpu_us"]
        seconds = sum(r["seconds"] for r in rs)
        reads = sum(r["reads"] for r in rs)
        coll, sender = sum(r["collectives_cpu"] for r in rs), sum(r["sender_cpu"] for r in rs)
        per_read = f"{coll / reads * 1e6:.0f} us of CPU per read" if reads else "no reads"
        each = ", ".join(f"{r['mean_ms']:.2f}" for r in rs)
        print(
            f"  {label:<23} step {wall:.3f} ms (x{wall / off['mean_ms']:.3f}; p99 {mean(rs, 'p99_ms'):.2f}, max "
            f"{max(r['max_ms'] for r in rs):.0f} ms; runs {each}), CPU {cpu:.3f} ms (x{cpu / off['step_cpu_ms']:.3f})"
            f"  |  one all_reduce {reduce:.1f} us, CPU {reduce_cpu:.1f} us ({more:+.1f})"
            f"  |  hooks thread: {reads} reads in {seconds:.0f} s, {per_read}, reading {100 * coll / seconds:.2f}% "
            f"of a core, all its work {100 * sender / seconds:.2f}%",
            flush=True,
        )
    return ok
