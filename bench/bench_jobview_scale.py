"""What the job view costs as the job grows: one real sidecar coordinates a job of N simulated
nodes x 8 ranks (default N = 10, 100, 1000), each node reporting as a sidecar does (a report every
job_view.report_interval_seconds while healthy; at a hang, a report and a long-polled verdict).

    python -m bench.bench_jobview_scale                 # N = 10, 100, 1000
    python -m bench.bench_jobview_scale --nodes 1000 --steady 20
    python -m bench.bench_jobview_scale --nodes 2000 --remote-peers   # as root: peers from another address

Printed per N: per node, bytes and requests per second while the job is healthy; the shared
channel's load (the coordinator: requests per second, CPU share of a core, resident memory); and
at a hang (every rank turns suspect and waits in a collective except one, which does not), the
time from the hang to each node holding the verdict that names the culprit (p50, p99, max), and
the requests it took per node. Targets: per-node cost independent of N; time-to-culprit p99 under
2 s at 1,000 nodes (on this 2-core machine the simulated nodes share the CPU with the coordinator).

By default the simulated nodes connect over loopback, so the coordinator takes them for peers on its
own node and checks each request's owner in /proc/net/tcp (sidecar/daemon/peer_api.py), a read that
grows with every open loopback connection. `--remote-peers` puts the coordinator in a network
namespace of its own (harness/netns.py), so they are peers from another address, as the nodes of a
real job are.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import secrets
import signal
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import psutil

from bench import scratch
from harness.job import PYTHON, wait_for
from harness.netns import Network
from harness.processes import Processes, free_port
from sidecar.jobview import auth

RANKS_PER_NODE = 8
JOB = "scale"
COORDINATOR = "coordinator"  # the coordinator's node_name: every peer request is signed for it
REPORT_INTERVAL = 5.0
LONG_POLL = 1.0


@dataclass
class Node:
    name: str
    index: int
    requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    culprit_at: float | None = None
    world: int = 1  # the job's world size
    key: str = ""  # the job's key (its registration's job view offer), which signs every request

    def report(self, hung_at: float | None, culprit_rank: int) -> dict:
        base = {"job_id": JOB, "node": self.name, "world_size": self.world, "time": time.time()}
        if hung_at is None:  # a healthy node sends a heartbeat, as the reporter does
            return {**base, "ranks": [], "healthy": RANKS_PER_NODE}
        ranks = []
        for local in range(RANKS_PER_NODE):
            rank = self.index * RANKS_PER_NODE + local
            troubled = hung_at is not None
            waiting = None if not troubled else rank != culprit_rank
            ranks.append(
                {"rank": rank, "local_rank": local, "state": "suspect" if troubled else "healthy",
                 "step": 1000, "phase": None, "progress_age_seconds": 2.5 if troubled else 0.1,
                 "waiting": waiting,
                 "stack_top": None if waiting is None else
                 ("all_reduce (distributed/distributed_c10d.py:2505)" if waiting else "train_step (train.py:14)")}
            )  # fmt: skip
        return {**base, "ranks": ranks}


@dataclass
class State:
    """What the simulated nodes share: when the hang began, and how to stop."""

    hung_at: float | None = None
    stop: bool = False
    hang: asyncio.Event = field(default_factory=asyncio.Event)
    errors: list[str] = field(default_factory=list)


@dataclass
class Result:
    nodes: int
    steady_requests_per_node_s: float = 0.0
    steady_bytes_per_node_s: float = 0.0
    coordinator_requests_s: float = 0.0
    coordinator_cpu: float = 0.0
    coordinator_rss_mb: float = 0.0
    culprit_p50: float = 0.0
    culprit_p99: float = 0.0
    culprit_max: float = 0.0
    hang_requests_per_node: float = 0.0
    missing: int = 0
    extra: dict = field(default_factory=dict)


def _path_qs(url: str) -> str:
    """What a request's signature covers: its path and query (sidecar/daemon/peer_api.py)."""
    parts = urlsplit(url)
    return parts.path + (f"?{parts.query}" if parts.query else "")


async def post(session: aiohttp.ClientSession, url: str, node: Node, body: dict) -> dict:
    data = json.dumps(body, separators=(",", ":")).encode()
    node.requests += 1
    node.bytes_sent += len(data)
    header, _ = auth.sign_request(node.key, "POST", _path_qs(url), data, COORDINATOR)
    headers = {"Content-Type": "application/json", auth.REQUEST_HEADER: header}
    async with session.post(url, data=data, headers=headers) as resp:
        raw = await resp.read()
        node.bytes_received += len(raw)
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {raw[:200]!r}")
        return json.loads(raw)


async def get(session: aiohttp.ClientSession, url: str, node: Node) -> dict:
    node.requests += 1
    header, _ = auth.sign_request(node.key, "GET", _path_qs(url), b"", COORDINATOR)
    async with session.get(url, headers={auth.REQUEST_HEADER: header}) as resp:
        raw = await resp.read()
        node.bytes_received += len(raw)
        return json.loads(raw)


async def node_loop(session, base, node: Node, state: State, culprit_rank: int) -> None:
    """A node's reporter, as sidecar/jobview/reporter.py behaves: a report every interval while
    healthy; once troubled, a report and then long-polls until the verdict names the culprit."""
    report_url = f"{base}/v1/jobs/{JOB}/report"
    await asyncio.sleep(node.index % 50 * REPORT_INTERVAL / 50)  # nodes start spread over an interval
    while not state.stop:
        hung_at = state.hung_at
        try:
            answer = await post(session, report_url, node, node.report(hung_at, culprit_rank))
        except Exception as e:
            state.errors.append(str(e)[:200])
            await asyncio.sleep(1.0)
            continue
        verdict = answer.get("verdict")
        if hung_at is None:
            try:
                await asyncio.wait_for(state.hang.wait(), REPORT_INTERVAL)
            except asyncio.TimeoutError:
                pass
            continue
        while node.culprit_at is None and not state.stop:
            if verdict and verdict.get("culprit"):
                node.culprit_at = time.monotonic()
                break
            known = verdict.get("version", -1) if verdict else -1
            answer = await get(session, f"{base}/v1/jobs/{JOB}/verdict?known={known}&wait={LONG_POLL:g}", node)
            verdict = answer.get("verdict")
        await asyncio.sleep(REPORT_INTERVAL)


async def drive(base: str, n: int, steady: float, sidecar_pid: int, key: str) -> Result:
    nodes = [Node(f"sim-{i:04d}", i, world=n * RANKS_PER_NODE, key=key) for i in range(n)]
    culprit_rank = (n // 2) * RANKS_PER_NODE + 3
    state = State()
    timeout = aiohttp.ClientTimeout(total=30)
    proc = psutil.Process(sidecar_pid)
    # Each simulated node keeps its own connection, as a node's sidecar does between reports.
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2), timeout=timeout) for _ in nodes]
    tasks = [
        asyncio.create_task(node_loop(s, base, node, state, culprit_rank))
        for s, node in zip(sessions, nodes, strict=True)
    ]
    await asyncio.sleep(REPORT_INTERVAL)  # every node has reported once
    r0, b0, cpu0, t0 = (
        sum(x.requests for x in nodes),
        sum(x.bytes_sent for x in nodes),
        proc.cpu_times(),
        time.monotonic(),
    )
    await asyncio.sleep(steady)
    r1, b1, cpu1, t1 = (
        sum(x.requests for x in nodes),
        sum(x.bytes_sent for x in nodes),
        proc.cpu_times(),
        time.monotonic(),
    )
    result = Result(n)
    span = t1 - t0
    result.steady_requests_per_node_s = (r1 - r0) / span / n
    result.steady_bytes_per_node_s = (b1 - b0) / span / n
    result.coordinator_requests_s = (r1 - r0) / span
    result.coordinator_cpu = ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / span
    result.coordinator_rss_mb = proc.memory_info().rss / 2**20
    before = {x.name: x.requests for x in nodes}
    cpu_hang, own_hang = proc.cpu_times(), time.process_time()
    state.hung_at = hung = time.monotonic()
    state.hang.set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(x.culprit_at is None for x in nodes):
        await asyncio.sleep(0.05)
    cpu_done = proc.cpu_times()
    result.extra["coordinator_cpu_s"] = (cpu_done.user + cpu_done.system) - (cpu_hang.user + cpu_hang.system)
    result.extra["simulator_cpu_s"] = time.process_time() - own_hang
    state.stop = True
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(s.close() for s in sessions))
    times = sorted(x.culprit_at - hung for x in nodes if x.culprit_at is not None)
    result.missing = n - len(times)
    if times:
        result.culprit_p50 = statistics.median(times)
        result.culprit_p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
        result.culprit_max = times[-1]
    result.hang_requests_per_node = statistics.mean(x.requests - before[x.name] for x in nodes)
    result.extra["errors"] = state.errors[:3]
    return result


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=3) as answer:
            return answer.status == 200
    except OSError:
        return False


def run(n: int, steady: float, workdir: Path, remote_peers: bool = False) -> Result:
    workdir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        procs = stack.enter_context(Processes(workdir))
        port, sock = free_port(), str(workdir / "sidecar.sock")
        address, prefix = "127.0.0.1", []
        if remote_peers:  # the coordinator on a host of its own (harness/netns.py), reached over a bridge
            net = stack.enter_context(Network(1))
            address, prefix = net.mgmt_addr(0), net.enter(0)
        cmd = [*prefix, PYTHON, "-m", "sidecar", "run", "--listen", f"{address}:{port}", "--socket", sock,
               "--set", f"diag_dir={workdir / 'diag'}", "--set", f"node_name={COORDINATOR}",
               "--set", f"job_view.max_ranks={max(16384, 2 * n * RANKS_PER_NODE)}",
               "--set", f"job_view.report_interval_seconds={REPORT_INTERVAL:g}",
               "--set", "collectors.enabled=node", "--set", "log_level=warning"]  # fmt: skip
        base = f"http://{address}:{port}"
        # Listening beyond loopback, the push API wants a token (the peers sign with the job's key instead).
        sidecar = procs.start("sidecar", cmd, env={"SIDECAR_TOKEN": secrets.token_hex(16)} if remote_peers else None)
        if not wait_for(lambda: _ready(base), 60):
            raise RuntimeError(f"sidecar did not start: {procs.log('sidecar').read_text()[-2000:]}")
        # One rank of the job on the coordinator's node: a sidecar coordinates only jobs it hosts.
        holder = procs.start("rank", [PYTHON, "-c", HOLDER, sock, JOB, str(n * RANKS_PER_NODE)])
        offer = wait_for(lambda: procs.log("rank").read_text().partition("\n")[1] and procs.log("rank").read_text(), 30)
        if not offer:
            raise RuntimeError(f"the job's rank did not register: {procs.log('rank').read_text()[-2000:]}")
        key = json.loads(offer.splitlines()[0])["key"]
        try:
            return asyncio.run(drive(base, n, steady, sidecar.pid, key))
        finally:
            procs.stop(holder)


HOLDER = """
import json, os, sys, time
from trainer_hooks.environment import Endpoint
from trainer_hooks.transport import post
endpoint, job, world = Endpoint(socket_path=sys.argv[1]), sys.argv[2], int(sys.argv[3])
reg = {"job_id": job, "rank": 0, "local_rank": 0, "world_size": world, "local_world_size": 1,
       "restart_count": 0, "pid": os.getpid(), "step": None, "phase": None}
reply = post(endpoint, "/v1/register", json.dumps(reg).encode())
assert reply.status == 200, reply.body
print(json.dumps(reply.body["job_view"]), flush=True)
step = 0
while True:
    step += 1
    items = [{"type": "step", "step": step, "time": time.time()}]
    post(endpoint, "/v1/push", json.dumps({"job_id": job, "rank": 0, "pid": os.getpid(), "items": items}).encode())
    time.sleep(0.5)
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_jobview_scale", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="10,100,1000", help="simulated node counts (default 10,100,1000)")
    p.add_argument("--steady", type=float, default=15.0, help="seconds of healthy reporting measured (default 15)")
    p.add_argument(
        "--remote-peers",
        action="store_true",
        help="run the coordinator in its own network namespace (root, iproute2), so the simulated nodes are "
        "peers from another address, as on other hosts; without it they connect over loopback, as local peers",
    )
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    root = scratch.make("bench-jobview-scale-")
    results = []
    try:
        for n in (int(x) for x in args.nodes.split(",")):
            r = run(n, args.steady, root / f"n{n}", args.remote_peers)
            results.append(r)
            print(
                f"{n:>5} nodes x {RANKS_PER_NODE} ranks: per node {r.steady_requests_per_node_s:.3f} req/s, "
                f"{r.steady_bytes_per_node_s:.0f} B/s healthy; coordinator {r.coordinator_requests_s:.0f} req/s, "
                f"{100 * r.coordinator_cpu:.1f}% of a core, {r.coordinator_rss_mb:.0f} MB; hang -> culprit known on "
                f"every node p50 {r.culprit_p50:.3f} s, p99 {r.culprit_p99:.3f} s, max {r.culprit_max:.3f} s "
                f"({r.hang_requests_per_node:.1f} requests per node, {r.missing} nodes without it)",
                flush=True,
            )
            print(
                f"      during the hang: coordinator {r.extra['coordinator_cpu_s']:.2f} s of CPU, the simulated nodes "
                f"{r.extra['simulator_cpu_s']:.2f} s (both on this machine's 2 cores)"
            )
            if r.extra["errors"]:
                print(f"      errors: {r.extra['errors']}")
    finally:
        scratch.leave(root, False)
    big = max(results, key=lambda r: r.nodes)
    ok = big.missing == 0 and big.culprit_p99 < 2.0
    small = min(results, key=lambda r: r.nodes)
    ratio = big.steady_requests_per_node_s / small.steady_requests_per_node_s if small.steady_requests_per_node_s else 0
    print(f"per-node requests/s at {big.nodes} vs {small.nodes} nodes: x{ratio:.2f} (target: about 1)")
    print(
        f"time-to-culprit p99 at {big.nodes} nodes: {big.culprit_p99:.3f} s (target < 2 s): {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
