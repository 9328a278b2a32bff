"""Issue 9's load (row 9), shared by tests/security/test_bounded_cost.py and
bench/bench_metrics.py: thousands of registered ranks with custom metrics each, scraped back to
back while `/healthz` is timed.

Each loader process registers `ranks` ranks of one job under its own pid over the Unix socket
(one keep-alive connection), pushes one step with `customs` custom metrics for each, and
declares a long `eval` phase so the idle ranks are never stalls; then it stays alive (the ranks
stay live) until killed.
"""

from __future__ import annotations

import contextlib
import http.client
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import PYTHON, Sidecar, spawned, tail, wait_until

LOADER = r"""
import http.client, json, os, socket, sys, time
sock_path, job, ranks, customs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
class Conn(http.client.HTTPConnection):
    def __init__(self):
        super().__init__("localhost", timeout=120)
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(120)
        self.sock.connect(sock_path)
conn = Conn()
def post(path, body):
    global conn
    for attempt in range(3):
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = Conn()
    return 0, b""
ok = 0
pid = os.getpid()
for rank in range(ranks):
    status, body = post("/v1/register", {"job_id": job, "rank": rank, "world_size": ranks, "pid": pid})
    if status != 200:
        print("refused", rank, status, body[:200], flush=True)
        continue
    metrics = {f"custom_{i}": float(i) for i in range(customs)}
    metrics["loss"] = 1.0
    status, body = post("/v1/push", {"job_id": job, "rank": rank, "pid": pid, "items": [
        {"type": "step", "step": 1, "time": time.time(), "metrics": metrics},
        {"type": "phase", "name": "eval", "action": "start", "time": time.time(), "timeout_seconds": 3600}]})
    ok += status == 200
print("done", ok, flush=True)
conn.close()
time.sleep(3600)
"""

# A healthy rank: the real hooks, a step every 0.2 s.
HEALTHY = r"""
import time
from trainer_hooks import Monitor
mon = Monitor(job_id="healthy", rank=0, world_size=1)
step = 0
while True:
    step += 1
    mon.step(step, loss=1.0)
    time.sleep(0.2)
"""


def start_loaders(
    stack: contextlib.ExitStack, sidecar: Sidecar, workdir: Path, jobs: int, ranks: int, customs: int
) -> list:
    procs = [
        stack.enter_context(
            spawned(
                [PYTHON, "-c", LOADER, sidecar.socket, f"load-{j}", str(ranks), str(customs)],
                workdir / f"loader{j}.log",
            )
        )
        for j in range(jobs)
    ]
    return procs


def loaded(workdir: Path, jobs: int) -> int | None:
    """Ranks the loaders got accepted, once all are done (None before)."""
    total = 0
    for j in range(jobs):
        done = [line for line in tail(workdir / f"loader{j}.log", 5).splitlines() if line.startswith("done ")]
        if not done:
            return None
        total += int(done[-1].split()[1])
    return total


@dataclass
class Latencies:
    healthz_ms: list[float] = field(default_factory=list)
    scrape_ms: list[float] = field(default_factory=list)
    scrape_series: list[int] = field(default_factory=list)
    scrape_bytes: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @staticmethod
    def quantile(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    def summary(self) -> str:
        h, s = self.healthz_ms, self.scrape_ms
        return (
            f"/healthz during scrapes: n={len(h)} median {statistics.median(h) if h else float('nan'):.1f} ms, "
            f"p99 {self.quantile(h, 0.99):.1f} ms, max {max(h, default=float('nan')):.1f} ms; "
            f"/metrics: n={len(s)} median {statistics.median(s) if s else float('nan'):.1f} ms, "
            f"max {max(s, default=float('nan')):.1f} ms, series max {max(self.scrape_series, default=0)}, "
            f"body max {max(self.scrape_bytes, default=0) / 1024:.0f} KiB"
        )


def _get(port: int, path: str, timeout: float = 60) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Accept": "text/plain"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def scrape_and_probe(port: int, seconds: float, probe_every: float = 0.05) -> Latencies:
    """Scrape /metrics back to back in one thread while another times /healthz."""
    out = Latencies()
    stop = time.monotonic() + seconds

    def scraper() -> None:
        while time.monotonic() < stop:
            start = time.perf_counter()
            try:
                status, body = _get(port, "/metrics")
            except OSError as e:
                out.failures.append(f"/metrics: {e}")
                continue
            out.scrape_ms.append((time.perf_counter() - start) * 1000)
            out.scrape_bytes.append(len(body))
            out.scrape_series.append(sum(1 for line in body.splitlines() if line and not line.startswith(b"#")))
            if status != 200:
                out.failures.append(f"/metrics: {status}")

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    while time.monotonic() < stop:
        start = time.perf_counter()
        try:
            status, _ = _get(port, "/healthz")
            if status != 200:
                out.failures.append(f"/healthz: {status}")
        except OSError as e:
            out.failures.append(f"/healthz: {e}")
        out.healthz_ms.append((time.perf_counter() - start) * 1000)
        time.sleep(probe_every)
    thread.join(timeout=120)
    return out


def wait_loaded(workdir: Path, jobs: int, timeout: float) -> int:
    return wait_until(lambda: loaded(workdir, jobs), timeout, interval=0.5, what="the loaders to register their ranks")
