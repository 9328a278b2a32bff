"""Push ingest throughput: step records per second one sidecar core absorbs.

A real `sidecar run` process; client processes (one per rank) register over its Unix socket
and POST batches of step records, as the hooks do. The figure that counts is records per
second of the sidecar's own CPU time (psutil), i.e. what one core sustains; wall-clock
throughput is printed too but depends on what else the machine runs.

The push decoder alone (sidecar/ranks/push.py: the body's bytes to checked records, in this
process) is measured too, in records decoded per CPU-second for batches of DECODER_BATCH_SIZES
records of the same shape: `--decoder-only` prints just that.

    python -m bench.bench_ingest [--ranks 2] [--batches 200] [--batch-size 500] [--decoder-only]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
TARGET_RECORDS_PER_CPU_SECOND = 20_000
DECODER_BATCH_SIZES = (20, 200)


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("sidecar", timeout=30)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def post(conn: http.client.HTTPConnection, path: str, body: bytes) -> dict:
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"{path} -> {resp.status}: {data[:300]!r}")
    return json.loads(data)


def batch_body(rank: int, pid: int, t0: float, b: int, batch_size: int) -> bytes:
    """The b-th push of a rank: step records with the metrics a training loop reports."""
    items = [
        {
            "type": "step",
            "step": b * batch_size + i + 1,
            "time": t0 + (b * batch_size + i) * 0.001,
            "metrics": {"loss": 2.0 - i * 1e-4, "grad_norm": 0.9, "lr": 3e-4, "samples": 64, "tokens": 32768},
        }
        for i in range(batch_size)
    ]
    return json.dumps({"job_id": "bench", "rank": rank, "pid": pid, "dropped": 0, "items": items}).encode()


def decoder_rate(batch_size: int, min_cpu_seconds: float = 1.0) -> float:
    """Records the push decoder turns into checked records per CPU-second of this process."""
    from sidecar.ranks.push import decode_push

    bodies = [batch_body(0, os.getpid(), time.time(), b, batch_size) for b in range(50)]
    records, cpu0 = 0, time.process_time()
    while (cpu := time.process_time() - cpu0) < min_cpu_seconds:
        for body in bodies:
            decode_push(body, 1000)
        records += len(bodies) * batch_size
    return records / cpu


def print_decoder_rates() -> None:
    for size in DECODER_BATCH_SIZES:
        rate = decoder_rate(size)
        per_record = f"{1e6 / rate:.2f} us per record"
        print(f"decoder alone, batches of {size:<4} {rate:,.0f} records per CPU-second ({per_record})")


def client(socket_path: str, rank: int, ranks: int, batches: int, batch_size: int) -> None:
    """One rank: register, then push pre-encoded batches back to back (keep-alive)."""
    pid = os.getpid()
    conn = UnixHTTPConnection(socket_path)
    post(
        conn,
        "/v1/register",
        json.dumps(
            {
                "job_id": "bench",
                "rank": rank,
                "world_size": ranks,
                "local_rank": rank,
                "local_world_size": ranks,
                "pid": pid,
            }
        ).encode(),
    )
    t0 = time.time()
    bodies = [batch_body(rank, pid, t0, b, batch_size) for b in range(batches)]
    print("ready", flush=True)
    sys.stdin.readline()  # the go signal: every client starts together
    for body in bodies:
        post(conn, "/v1/push", body)
    conn.close()


def wait_for_socket(path: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sidecar exited with {proc.returncode}")
        try:
            conn = UnixHTTPConnection(path)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError("sidecar not ready")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batches", type=int, default=200, help="batches per rank")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--decoder-only", action="store_true", help="measure the push decoder alone")
    parser.add_argument("--client", nargs=2, metavar=("SOCKET", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        client(args.client[0], int(args.client[1]), args.ranks, args.batches, args.batch_size)
        return 0
    if args.decoder_only:
        print_decoder_rates()
        return 0

    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        sock = os.path.join(tmp, "sidecar.sock")
        log = open(os.path.join(tmp, "sidecar.log"), "wb")
        sidecar = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sidecar",
                "run",
                "--listen",
                "127.0.0.1:0",
                "--socket",
                sock,
                "--set",
                f"diag_dir={tmp}/diag",
                "--set",
                "collectors.enabled=[nic,process,node]",
                "--set",
                "limits.max_items_per_push=1000",
                "--set",
                "log_level=warning",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        clients: list[subprocess.Popen] = []
        try:
            wait_for_socket(sock, sidecar)
            for rank in range(args.ranks):
                clients.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "bench.bench_ingest",
                            "--client",
                            sock,
                            str(rank),
                            "--ranks",
                            str(args.ranks),
                            "--batches",
                            str(args.batches),
                            "--batch-size",
                            str(args.batch_size),
                        ],
                        cwd=ROOT,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            for c in clients:
                assert c.stdout is not None and c.stdout.readline().strip() == "ready"
            me = psutil.Process(sidecar.pid)
            cpu0, wall0 = sum(me.cpu_times()[:2]), time.perf_counter()
            for c in clients:
                assert c.stdin is not None  # stdin=PIPE
                c.stdin.write("go\n")
                c.stdin.flush()
            for c in clients:
                if c.wait(timeout=600) != 0:
                    raise RuntimeError("a client failed")
            wall = time.perf_counter() - wall0
            cpu = sum(me.cpu_times()[:2]) - cpu0
            rss = me.memory_info().rss
        finally:
            for c in clients:
                if c.poll() is None:
                    c.kill()
            sidecar.terminate()
            try:
                sidecar.wait(timeout=30)
            except subprocess.TimeoutExpired:
                sidecar.kill()
            log.close()

    records = args.ranks * args.batches * args.batch_size
    per_cpu = records / cpu if cpu > 0 else float("inf")
    print(f"records pushed:            {records} ({args.ranks} ranks x {args.batches} batches x {args.batch_size})")
    print(f"wall time:                 {wall:.2f} s  ->  {records / wall:,.0f} records/s (machine shared with clients)")
    print(f"sidecar CPU time:          {cpu:.2f} s  ->  {per_cpu:,.0f} records per CPU-second")
    print(f"sidecar CPU per record:    {cpu / records * 1e6:.1f} us")
    print(f"sidecar resident memory:   {rss / 2**20:.0f} MiB")
    print_decoder_rates()
    ok = per_cpu >= TARGET_RECORDS_PER_CPU_SECOND
    print(
        f"target >= {TARGET_RECORDS_PER_CPU_SECOND:,} records per CPU-second: "
        f"{'PASS' if ok else 'FAIL'} ({per_cpu / TARGET_RECORDS_PER_CPU_SECOND:.1f}x)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
