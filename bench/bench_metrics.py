"""What `/metrics` costs, next to Debian's node_exporter on the same machine.

    python -m bench.bench_metrics [--scrapes 500] [--steady-seconds 30]

A real `sidecar run` samples 8 GPUs (18 NVLinks each) through the real pynvml over the fake
libnvidia-ml (`--nvml module` swaps in the pure-Python stand-in instead, which skips pynvml's
ctypes code), a fixture sysfs with 4 NICs and 2 InfiniBand ports, and 8 real rank processes that
register over the Unix socket and push 10 steps a second each, with collectors every 1 s.
It also prints the NVML calls per GPU per round (bench/nvml_calls.py), healthy and with a field
that fails every round.

Two phases, the same for the sidecar and node_exporter:
- steady: a scrape every 5 s (busier than Prometheus' usual 15 s) for --steady-seconds;
  the CPU % of one core and the peak RSS over it are what a node pays for the exporter.
- scrapes: --scrapes GETs of /metrics on a keep-alive connection, spaced 20 ms apart and
  alternating between the two exporters so both see the same machine load; latency is
  request sent to the last byte read.
Targets (the sidecar): median <= 5 ms, p99 <= 20 ms, CPU <= 2 % of a core, RSS <= 80 MB.

Then the item-9 load case (issue 9, --item9-seconds, --only-item9): 2,000 more ranks with 32
custom metrics each, /metrics scraped back to back while /healthz is timed every 50 ms.
Target: /healthz p99 <= 50 ms during scrapes; /metrics stays within limits.max_series. The
main phase renders every scrape (metrics_reuse_seconds=0); the item-9 case runs with the
sidecar's default reuse (0.5 s), --item9-reuse-seconds 0 renders every scrape there too.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/bench_metrics.py` from anywhere
    sys.path.insert(0, str(ROOT))

from bench import nvml_calls  # noqa: E402
from tests.support import PYTHON, Sidecar, free_port, http_get, spawned, tail, wait_until  # noqa: E402
from tests.support.load import scrape_and_probe, start_loaders, wait_loaded  # noqa: E402

NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"
FIXTURE_SYSFS = ROOT / "tests" / "collectors" / "fixtures" / "sys"
RANKS = 8
GPUS = 8
COLLECTOR_DURATION = re.compile(
    r'^sidecar_scrape_collector_duration_seconds\{collector="([^"]+)"\} (\S+)$', re.MULTILINE
)
TARGETS = {"median_ms": 5.0, "p99_ms": 20.0, "cpu_percent": 2.0, "rss_mb": 80.0}

RANK_SCRIPT = textwrap.dedent(f"""
    import math, sys, time
    from trainer_hooks import Monitor
    rank = int(sys.argv[1])
    mon = Monitor(job_id="bench", rank=rank, local_rank=rank, world_size={RANKS}, local_world_size={RANKS})
    step = 0
    while True:
        step += 1
        mon.step(step, loss=2.0 + math.sin(step / 50), grad_norm=0.9, lr=3e-4, samples=64, tokens=32768,
                 step_time_seconds=0.1)
        time.sleep(0.1)
""")


@dataclass
class Figures:
    name: str
    latencies_ms: list[float] = field(default_factory=list)
    cpu_percent: float = 0.0
    rss_mb: float = 0.0
    body_bytes: int = 0
    series: int = 0
    collector_ms: dict[str, list[float]] = field(default_factory=dict)  # the sidecar's own report

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Scraper:
    """GET /metrics on one keep-alive connection (as Prometheus does), reconnecting if needed."""

    def __init__(self, port: int):
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def get(self) -> tuple[float, bytes]:
        for attempt in (1, 2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            try:
                start = time.perf_counter()
                self.conn.request("GET", "/metrics", headers={"Accept": "text/plain"})
                resp = self.conn.getresponse()
                body = resp.read()
                elapsed = (time.perf_counter() - start) * 1000
                if resp.status != 200:
                    raise RuntimeError(f"GET /metrics on port {self.port}: {resp.status}")
                return elapsed, body
            except (http.client.HTTPException, OSError):
                self.conn.close()
                self.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def steady_phase(targets: list[tuple[Figures, psutil.Process, Scraper]], seconds: float) -> None:
    """CPU and peak RSS over `seconds` with a scrape every 5 s."""
    start_cpu = [cpu_seconds(p) for _, p, _ in targets]
    start = time.monotonic()
    next_scrape = start
    while (now := time.monotonic()) < start + seconds:
        for fig, proc, scraper in targets:
            fig.rss_mb = max(fig.rss_mb, proc.memory_info().rss / 2**20)
            if now >= next_scrape:
                _, body = scraper.get()
                fig.body_bytes = len(body)
                fig.series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
                for m in COLLECTOR_DURATION.finditer(body.decode()):
                    fig.collector_ms.setdefault(m.group(1), []).append(float(m.group(2)) * 1000)
        if now >= next_scrape:
            next_scrape += 5.0
        time.sleep(0.5)
    wall = time.monotonic() - start
    for (fig, proc, _), cpu0 in zip(targets, start_cpu, strict=True):
        fig.cpu_percent = 100.0 * (cpu_seconds(proc) - cpu0) / wall


def scrape_phase(targets: list[tuple[Figures, psutil.Process, Scraper]], scrapes: int) -> None:
    for _, _, scraper in targets:  # warm the connections
        scraper.get()
    for _ in range(scrapes):
        for fig, _, scraper in targets:
            elapsed, _ = scraper.get()
            fig.latencies_ms.append(elapsed)
        time.sleep(0.02)
    for fig, proc, _ in targets:
        fig.rss_mb = max(fig.rss_mb, proc.memory_info().rss / 2**20)


def nvml_spec(rank_pids: list[int]) -> dict:
    gpus = {
        str(i): {"processes": [{"pid": pid, "used_memory_bytes": 61_000_000_000}]}
        for i, pid in enumerate(rank_pids[:GPUS])
    }
    return {"gpu_count": GPUS, "gpu": {"nvlink_links": 18}, "gpus": gpus}


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # the stand-in re-reads it when it changes; never a half-written file


def report(figures: list[Figures]) -> bool:
    print(
        f"\n{'exporter':<16}{'median ms':>10}{'p99 ms':>9}{'max ms':>9}{'CPU % core':>12}{'RSS MB':>9}"
        f"{'series':>8}{'body KB':>9}"
    )
    for f in figures:
        print(
            f"{f.name:<16}{f.quantile(0.5):>10.2f}{f.quantile(0.99):>9.2f}{max(f.latencies_ms):>9.2f}"
            f"{f.cpu_percent:>12.2f}{f.rss_mb:>9.1f}{f.series:>8}{f.body_bytes / 1024:>9.1f}"
        )
    sidecar = figures[0]
    checks = [
        ("median", sidecar.quantile(0.5), TARGETS["median_ms"], "ms"),
        ("p99", sidecar.quantile(0.99), TARGETS["p99_ms"], "ms"),
        ("CPU", sidecar.cpu_percent, TARGETS["cpu_percent"], "% of a core"),
        ("RSS", sidecar.rss_mb, TARGETS["rss_mb"], "MB"),
    ]
    print()
    ok = True
    for what, value, target, unit in checks:
        passed = value <= target
        ok &= passed
        print(f"sidecar {what:<7} {value:8.2f} {unit:<12} target <= {target:<6} {'PASS' if passed else 'FAIL'}")
    if len(figures) > 1:
        ne = figures[1]
        print(
            f"\nversus node_exporter: median x{sidecar.quantile(0.5) / ne.quantile(0.5):.2f}, "
            f"p99 x{sidecar.quantile(0.99) / ne.quantile(0.99):.2f}, "
            f"CPU x{sidecar.cpu_percent / max(ne.cpu_percent, 1e-9):.2f}, RSS x{sidecar.rss_mb / ne.rss_mb:.2f}"
        )
    return ok


NVML_MODULES = {"library": "sidecar.testing.fake_nvml_lib", "module": "sidecar.testing.fake_nvml"}


def start_node(stack: contextlib.ExitStack, work: Path, *settings: str, nvml: str = "library") -> Sidecar:
    """A sidecar over a fake NVML and the fixture sysfs, with RANKS ranks pushing steps."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / "nvml.json"
    write_json(spec_path, nvml_spec([]))
    sidecar = Sidecar(
        work,
        f"collectors.nvml_module={NVML_MODULES[nvml]}",
        f"collectors.sysfs_root={FIXTURE_SYSFS}",
        f"checkpoint_dir={work}",
        "log_level=warning",
        *settings,
        env={"SIDECAR_FAKE_NVML": str(spec_path)},
    )
    sidecar.start()
    stack.callback(sidecar.stop)
    ranks = [
        stack.enter_context(
            spawned([PYTHON, "-c", RANK_SCRIPT, str(rank)], work / f"rank{rank}.log", env=sidecar.hook_env())
        )
        for rank in range(RANKS)
    ]
    write_json(spec_path, nvml_spec([p.pid for p in ranks]))  # NVML now "sees" the ranks on the GPUs

    def all_registered() -> bool:
        status, body = http_get(sidecar.url + "/v1/status")
        return status == 200 and len(json.loads(body).get("ranks", [])) == RANKS

    wait_until(all_registered, 60, interval=0.5, what=f"{RANKS} ranks registered")
    return sidecar


def started(sidecar: Sidecar) -> subprocess.Popen:
    if sidecar.proc is None:
        raise RuntimeError("the sidecar was not started")
    return sidecar.proc


def start_node_exporter(stack: contextlib.ExitStack, work: Path) -> tuple[psutil.Process, int] | None:
    if not os.access(NODE_EXPORTER, os.X_OK):
        print(f"{NODE_EXPORTER} not installed: measuring the sidecar alone")
        return None
    port = free_port()
    proc = stack.enter_context(
        spawned([NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{port}"], work / "node_exporter.log")
    )
    wait_until(
        lambda: proc.poll() is not None or http_get(f"http://127.0.0.1:{port}/metrics")[0] == 200,
        30,
        what="node_exporter up",
    )
    if proc.poll() is not None:
        raise RuntimeError(f"node_exporter exited:\n{tail(work / 'node_exporter.log')}")
    return psutil.Process(proc.pid), port


# Issue 9's load: thousands of registered ranks with 32 custom metrics each (root's, so only
# the node-wide limits apply), on top of the 8-GPU node; /metrics scraped back to back while
# /healthz is timed every 50 ms.
ITEM9_JOBS, ITEM9_RANKS, ITEM9_CUSTOMS = 4, 500, 32
ITEM9_HEALTHZ_P99_MS = 50.0


def item9_case(work: Path, seconds: float, nvml: str, reuse: float) -> bool:
    with contextlib.ExitStack() as stack:
        sidecar = start_node(stack, work, f"metrics_reuse_seconds={reuse}", nvml=nvml)
        start_loaders(stack, sidecar, work, ITEM9_JOBS, ITEM9_RANKS, ITEM9_CUSTOMS)
        accepted = wait_loaded(work, ITEM9_JOBS, 600)
        time.sleep(3)
        print(
            f"{accepted + RANKS} ranks registered ({accepted} idle with {ITEM9_CUSTOMS} custom metrics each); "
            f"scraping back to back for {seconds:.0f} s, metrics_reuse_seconds={reuse}",
            flush=True,
        )
        seen = scrape_and_probe(sidecar.port, seconds)
        rss = psutil.Process(started(sidecar).pid).memory_info().rss / 2**20
    print(seen.summary() + f"; sidecar RSS {rss:.0f} MB")
    p99 = seen.quantile(seen.healthz_ms, 0.99)
    ok = p99 <= ITEM9_HEALTHZ_P99_MS and not seen.failures
    print(
        f"item 9  /healthz p99 {p99:8.2f} ms (max {max(seen.healthz_ms):.1f} ms)  "
        f"target <= {ITEM9_HEALTHZ_P99_MS:<6} "
        f"{'PASS' if ok else 'FAIL'}" + (f"  failures: {seen.failures[:3]}" if seen.failures else "")
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=500)
    parser.add_argument("--steady-seconds", type=float, default=30.0)
    parser.add_argument(
        "--nvml",
        choices=sorted(NVML_MODULES),
        default="library",
        help="library: the real pynvml over the fake libnvidia-ml (default); module: the pure-Python stand-in",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also measure a sidecar with the hardware collectors off, to split its CPU "
        "between the collectors and the push API",
    )
    parser.add_argument(
        "--item9-seconds",
        type=float,
        default=20.0,
        help="length of the item-9 load case (thousands of ranks; /healthz timed during scrapes); 0 skips it",
    )
    parser.add_argument("--only-item9", action="store_true", help="run only the item-9 load case")
    parser.add_argument(
        "--item9-reuse-seconds",
        type=float,
        default=0.5,
        help="metrics_reuse_seconds of the item-9 case (the sidecar's default 0.5; 0: every scrape renders)",
    )
    args = parser.parse_args(argv)
    if args.only_item9:
        work = Path(tempfile.mkdtemp(prefix="bench-metrics-"))
        try:
            return (
                0 if item9_case(work / "item9", args.item9_seconds or 20.0, args.nvml, args.item9_reuse_seconds) else 1
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)

    work = Path(tempfile.mkdtemp(prefix="bench-metrics-"))
    try:
        with contextlib.ExitStack() as stack:
            # Every scrape renders (no reuse of a recent answer): what one Prometheus scrape costs.
            sidecar = start_node(stack, work / "all", "metrics_reuse_seconds=0", nvml=args.nvml)
            print(f"sidecar on {sidecar.url} with {RANKS} ranks pushing, NVML: {NVML_MODULES[args.nvml]}", flush=True)
            wait_until(
                lambda: b"sidecar_gpu_process_memory_bytes{" in http_get(sidecar.url + "/metrics")[1],
                30,
                interval=0.5,
                what="per-rank GPU memory",
            )
            targets = [(Figures("sidecar"), psutil.Process(started(sidecar).pid), Scraper(sidecar.port))]
            ne = start_node_exporter(stack, work)
            if ne is not None:
                targets.append((Figures("node_exporter"), ne[0], Scraper(ne[1])))
            time.sleep(3)  # a few collector rounds before measuring

            print(f"steady phase: {args.steady_seconds:.0f} s, one scrape every 5 s", flush=True)
            steady_phase(targets, args.steady_seconds)
            print(f"scrape phase: {args.scrapes} scrapes each, 20 ms apart", flush=True)
            scrape_phase(targets, args.scrapes)
            if started(sidecar).poll() is not None:
                raise RuntimeError(f"the sidecar exited:\n{tail(sidecar.log)}")
        figures = [fig for fig, _, _ in targets]
        if args.breakdown:
            with contextlib.ExitStack() as stack:
                bare = start_node(stack, work / "bare", "collectors.enabled=", nvml=args.nvml)
                time.sleep(3)
                without = Figures("sidecar, no hardware collectors")
                steady_phase([(without, psutil.Process(started(bare).pid), Scraper(bare.port))], args.steady_seconds)
            figures.append(without)
        ok = report(figures[:2] if ne is not None else figures[:1])
        print(
            "\ncollector run time (wall, median over the steady phase): "
            + ", ".join(
                f"{name} {statistics.median(ms):.1f} ms" for name, ms in sorted(figures[0].collector_ms.items())
            )
        )
        if args.breakdown:
            print(
                f"CPU split: hardware collectors {figures[0].cpu_percent - without.cpu_percent:.2f} % of a core, "
                f"the rest (push API of {RANKS} ranks, watchdog, scrapes) {without.cpu_percent:.2f} %"
            )
        for line in nvml_calls.report(interval=1.0):
            print(line)
        if args.item9_seconds > 0:
            print("\nitem-9 load case", flush=True)
            ok &= item9_case(work / "item9", args.item9_seconds, args.nvml, args.item9_reuse_seconds)
        return 0 if ok else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
