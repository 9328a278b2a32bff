"""What the cluster-scale stack costs (docs/scale.md, "A cluster"): N simulated 8-GPU nodes (the
exposition of a real sidecar, relabelled per node: bench/scale_nodes.py) scraped by two vmagent
shards (hashmod of `__address__`, the generated deploy/scale/ configuration) into victoria-metrics,
with vmalert evaluating every rule of the product against it (deploy/scale/*.rules.yml).

    python -m bench.bench_scale                       # N = 100, 500, 2000; 30 s scrape
    python -m bench.bench_scale --nodes 2000 --interval 60s
    python -m bench.bench_scale --quick               # 20 nodes, 2 s scrape, a few seconds

Printed per N, per node and in total: active series, samples per second ingested, bytes per sample
on disk, the store's resident memory and CPU, vmalert's evaluation time per rule group; then what
the series budget's knobs buy (series per node of the recorded exposition), and the figures
extrapolated to 2,000 nodes x 8 GPUs scraped every 15 s, with the assumptions. Everything here
shares this machine's 2 cores: the simulated nodes, the shards, the store and the ruler.
"""

from __future__ import annotations

import argparse
import re
import resource
import signal
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench import scratch
from bench.scale_nodes import RANKS_PER_NODE, Node, Nodes, load_fixture
from bench.scale_stack import Stack
from sidecar.mixin.scale import seconds

NODES_PER_JOB = 16
TARGET_NODES, TARGET_INTERVAL = 2000, 15.0  # the cluster extrapolated to: 16,000 GPUs
# The sidecar's own cost per node, unchanged by the cluster's size (docs/scale.md, bench_metrics).
SIDECAR_COST = "the sidecar's own cost per node is unchanged (docs/scale.md: at most 3,000 series, ~205 KiB per scrape)"


@dataclass
class Figures:
    nodes: int
    interval: float
    series: float = 0.0
    samples_per_s: float = 0.0
    bytes_per_sample: float = 0.0
    index_bytes_per_series: float = 0.0
    store_rss_mb: float = 0.0
    store_cpu: float = 0.0  # share of a core
    shard_rss_mb: float = 0.0  # all shards together
    ruler_rss_mb: float = 0.0
    scrapes_per_s: float = 0.0
    groups: dict[str, float] = field(default_factory=dict)  # rule group -> mean evaluation seconds
    errors: dict[str, str] = field(default_factory=dict)  # rule -> vmalert's last error


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def _sum(samples, name: str, **match: str) -> float:
    return sum(v for n, labels, v in samples if n == name and all(labels.get(k) == x for k, x in match.items()))


def _force_flush(stack: Stack) -> None:
    with urllib.request.urlopen(stack.store_url + "/internal/force_flush", timeout=60):
        pass


def measure(n: int, interval: str, work: Path, rounds: int) -> Figures:
    period = seconds(interval)
    nodes = [
        Node(f"node-{i:04d}", f"job-{i // NODES_PER_JOB:03d}", i % NODES_PER_JOB * RANKS_PER_NODE) for i in range(n)
    ]
    with Nodes(nodes) as served:
        targets = [served.address(i) for i in range(n)]
        with Stack(
            work, targets, "http://127.0.0.1:9", shard_kind="vmagent", interval=interval, for_override=None
        ) as s:
            store = psutil.Process(s.pid("victoria-metrics"))
            want = n * len(load_fixture())
            deadline = time.monotonic() + max(120, 6 * period, 0.15 * n)
            while time.monotonic() < deadline:  # every node's series stored
                time.sleep(period / 2)
                active = _sum(
                    _samples(s.metrics("victoria-metrics")), "vm_cache_entries", type="storage/hour_metric_ids"
                )
                if active >= want:
                    break
            time.sleep(period)  # one more round: the first scrape's new series are behind us
            vm0, cpu0, t0, scrapes0 = (
                _samples(s.metrics("victoria-metrics")),
                store.cpu_times(),
                time.monotonic(),
                served.scrapes,
            )
            time.sleep(rounds * period)
            _force_flush(s)
            vm1, cpu1, t1, scrapes1 = (
                _samples(s.metrics("victoria-metrics")),
                store.cpu_times(),
                time.monotonic(),
                served.scrapes,
            )
            span = t1 - t0
            f = Figures(n, period)
            f.series = _sum(vm1, "vm_cache_entries", type="storage/hour_metric_ids")
            f.samples_per_s = (_sum(vm1, "vm_rows_inserted_total") - _sum(vm0, "vm_rows_inserted_total")) / span
            rows = _sum(vm1, "vm_rows", type="storage/small") + _sum(vm1, "vm_rows", type="storage/big")
            data = _sum(vm1, "vm_data_size_bytes", type="storage/small") + _sum(
                vm1, "vm_data_size_bytes", type="storage/big"
            )
            f.bytes_per_sample = data / rows if rows else 0.0
            index = sum(
                v
                for name, labels, v in vm1
                if name == "vm_data_size_bytes" and labels.get("type", "").startswith("indexdb")
            )
            f.index_bytes_per_series = index / f.series if f.series else 0.0
            f.store_rss_mb = store.memory_info().rss / 2**20
            f.store_cpu = ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / span
            f.shard_rss_mb = sum(psutil.Process(s.pid(name)).memory_info().rss for name in s.shard_names) / 2**20
            f.ruler_rss_mb = psutil.Process(s.pid("vmalert")).memory_info().rss / 2**20
            f.scrapes_per_s = (scrapes1 - scrapes0) / span
            ruler = _samples(s.metrics("vmalert"))
            for name, labels, value in ruler:
                if name == "vmalert_iteration_duration_seconds_sum":
                    count = _sum(ruler, "vmalert_iteration_duration_seconds_count", group=labels["group"])
                    f.groups[labels["group"]] = value / count if count else 0.0
            f.errors = {r["name"]: r["lastError"][:300] for g in s.groups() for r in g["rules"] if r.get("lastError")}
            return f


def knobs() -> list[tuple[str, int]]:
    """Series per node of the recorded exposition, and what each knob of docs/scale.md takes off."""
    samples = load_fixture()
    total = len(samples)
    by = Counter(s.name for s in samples)
    nvlink = sum(c for name, c in by.items() if name.startswith("sidecar_gpu_nvlink_"))
    buckets = by["sidecar_training_step_duration_seconds_bucket"]
    per_bucket = buckets // RANKS_PER_NODE
    return [
        ("recorded 8-GPU node", total),
        ("without the per-NVLink series (metric_relabel_configs drop sidecar_gpu_nvlink_.*)", total - nvlink),
        (f"step-time histogram with 5 buckets instead of {per_bucket}", total - buckets + 5 * RANKS_PER_NODE),
        ("a node at limits.max_series (the worst a node can send)", 3000),
    ]


HEAD = (
    f"{'nodes':>6} {'scrape':>6} {'series':>10} {'/node':>6} {'samples/s':>10} {'/node':>6} {'B/sample':>8} "
    f"{'index B/series':>14} {'store RSS':>10} {'store CPU':>9} {'shards RSS':>10} {'vmalert RSS':>11}"
)


def row(f: Figures) -> str:
    return (
        f"{f.nodes:>6} {f.interval:>5g}s {f.series:>10,.0f} {f.series / f.nodes:>6,.0f} {f.samples_per_s:>10,.0f} "
        f"{f.samples_per_s / f.nodes:>6.1f} {f.bytes_per_sample:>8.2f} {f.index_bytes_per_series:>14.0f} "
        f"{f.store_rss_mb:>8,.0f}MB {100 * f.store_cpu:>8.0f}% {f.shard_rss_mb:>8,.0f}MB {f.ruler_rss_mb:>9,.0f}MB"
    )


def report(results: list[Figures]) -> None:
    per_node = len(load_fixture())
    print(f"\nrecorded exposition: {per_node} series per node (bench/fixtures/node-8gpu.prom); {SIDECAR_COST}")
    print(HEAD)
    for f in results:
        print(row(f))
        for rule, error in f.errors.items():
            print(f"    vmalert: {rule}: {error}")
    print("\nvmalert: mean evaluation time per rule group (ms)")
    groups = sorted({g for f in results for g in f.groups})
    print(f"{'group':<36}" + "".join(f"{f.nodes:>9}" for f in results))
    for g in groups:
        print(f"{g:<36}" + "".join(f"{1000 * f.groups.get(g, 0):>9.1f}" for f in results))
    print("\nseries per node by the series budget's knobs (docs/scale.md)")
    for what, count in knobs():
        print(f"  {count:>6,}  {what}")
    big = max(results, key=lambda f: f.nodes)
    # The ruler's records are series too: take the series per node, and the evaluation time, from the
    # largest run whose every group evaluated within the interval (else the ruler fell behind).
    kept = [f for f in results if f.groups and max(f.groups.values()) < f.interval and not f.errors]
    ruled = max(kept, key=lambda f: f.nodes) if kept else big
    series = ruled.series / ruled.nodes * TARGET_NODES
    rate = series / TARGET_INTERVAL
    rss_per_series = big.store_rss_mb * 2**20 / big.series
    cpu_per_sample = big.store_cpu / big.samples_per_s if big.samples_per_s else 0.0
    disk_day = rate * 86400 * big.bytes_per_sample / 2**30
    evaluation = sum(ruled.groups.values()) * TARGET_NODES / ruled.nodes
    print(
        f"\nextrapolated to {TARGET_NODES:,} nodes x 8 GPUs ({TARGET_NODES * 8:,} GPUs), {TARGET_INTERVAL:g} s scrape:"
    )
    print(f"  active series  {series:,.0f} ({ruled.series / ruled.nodes:,.0f} per node at {ruled.nodes} nodes)")
    print(f"  samples/s      {rate:,.0f}")
    print(
        f"  store RAM      {series * rss_per_series / 2**30:.1f} GiB "
        f"({rss_per_series:.0f} B per active series at {big.nodes} nodes)"
    )
    print(
        f"  store CPU      {rate * cpu_per_sample:.1f} cores to ingest "
        f"({1e6 * cpu_per_sample:.1f} core-us per sample at {big.nodes} nodes), the ruler's queries on top"
    )
    print(
        f"  disk           {disk_day:.1f} GiB/day at {big.bytes_per_sample:.2f} B/sample "
        f"(+ index {big.index_bytes_per_series * series / 2**30:.1f} GiB)"
    )
    print(
        f"  rule evaluation {evaluation:.0f} s of wall time per round of every group, against a {TARGET_INTERVAL:g} s "
        f"interval (linear from {ruled.nodes} nodes, where one round took {sum(ruled.groups.values()):.1f} s)"
    )
    print("  assumptions: every node like the recorded one; cost linear in series and samples (as measured between the")
    print("  node counts above); one store and one ruler; fresh data (a long-running store compacts further).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_scale", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="100,500,2000", help="simulated node counts (default 100,500,2000)")
    p.add_argument(
        "--interval", default="30s", help="scrape and evaluation interval (default 30s: what 2 cores keep up with)"
    )
    p.add_argument(
        "--rounds", type=int, default=2, help="scrape intervals measured after the series are stored (default 2)"
    )
    p.add_argument("--quick", action="store_true", help="20 nodes, 2 s scrape, 2 rounds: a check that it runs")
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.interval, args.rounds = "20", "2s", 2
    try:
        counts = [int(x) for x in args.nodes.split(",")]
    except ValueError:
        p.error(f"--nodes: expected node counts separated by commas, got {args.nodes!r}")
    if not counts or min(counts) < 1 or not re.fullmatch(r"\d+(ms|s|m)", args.interval) or args.rounds < 1:
        p.error("--nodes must be positive, --interval a duration like 30s, --rounds at least 1")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    root = scratch.make("bench-scale-")
    results = []
    try:
        for n in counts:
            start = time.monotonic()
            results.append(measure(n, args.interval, root / f"n{n}", args.rounds))
            print(f"{n} nodes measured in {time.monotonic() - start:.0f} s:\n{HEAD}\n{row(results[-1])}", flush=True)
            print("".join(f"  {g} {1000 * t:.1f} ms" for g, t in sorted(results[-1].groups.items())), flush=True)
    finally:
        scratch.leave(root, False)
    report(results)
    ok = all(f.series >= f.nodes * len(load_fixture()) and not f.errors for f in results)
    print(f"every node's series stored, every rule evaluated: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
