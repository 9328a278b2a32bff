"""The rules past one Prometheus (docs/operator-guide.md, "Past one Prometheus"): two Prometheus
agents scrape six simulated 8-GPU nodes (real sidecar expositions, bench/scale_nodes.py) in two
shards by `hashmod` of `__address__`, remote-write into victoria-metrics, and vmalert evaluates the
generated global and per-node rules (deploy/scale/, only `for:` shortened) against it and sends to
a real Alertmanager. Every job spans both shards: a judgement made on one shard would see half a
job. MetricsQL evaluates the rules here; beside the stack, one ordinary Prometheus scrapes the same
nodes and evaluates the same rules in PromQL, and every recording rule must give both the same
series: a rule MetricsQL reads differently fails here.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from alerts import build as alerts_build
from bench.scale_nodes import RANKS_PER_NODE, Node, Nodes
from bench.scale_stack import Stack, prometheus_shard
from tests.alerts.realstack import Alertmanager, Prometheus, Webhook, alertmanager_config
from tests.support import free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.system, pytest.mark.xdist_group("scale-stack")]

CULPRIT = 11  # the hung job's rank on its second node (local rank 3), in the other shard
STRAGGLER = 45  # the slow job's rank on its second node (local rank 5), in the other shard
JOBS = {"hung": (0, 1), "healthy": (2, 3), "slow": (4, 5)}  # job -> its nodes (first in shard 0)


def _ports_by_shard() -> list[int]:
    """Six ports, 0, 2, 4 of them in shard 0 and 1, 3, 5 in shard 1."""
    found: dict[int, list[int]] = {0: [], 1: []}
    while min(len(v) for v in found.values()) < 3:
        port = free_port()
        found[prometheus_shard(f"127.0.0.1:{port}", 2)].append(port)
    return [p for pair in zip(found[0], found[1], strict=False) for p in pair]


def _hung(name: str, labels: str, base: float) -> float | None:
    """Every rank of the hung job suspect, stopped; the culprit a step behind."""
    if name == "sidecar_rank_state":
        return 1.0 if 'state="suspect"' in labels else 0.0
    if name == "sidecar_training_step":
        return 100.0 if f'rank="{CULPRIT}"' in labels else 101.0
    if name.startswith(("sidecar_training_steps_total", "sidecar_training_step_duration_seconds_")):
        return base  # no step: the step counters and the step-time histogram stand still
    return None


def _waiting(job: str, first: int, culprit: int | None) -> str:
    lines = [
        f'sidecar_rank_waiting_in_collective{{job_id="{job}",rank="{r}"}} {0 if r == culprit else 1}\n'
        for r in range(first, first + RANKS_PER_NODE)
    ]
    return "".join(lines)


def _lateness(job: str, first: int) -> str:
    return "".join(
        f'sidecar_rank_lateness_seconds{{job_id="{job}",rank="{r}"}} {0.5 if r == STRAGGLER else 0.001}\n'
        for r in range(first, first + RANKS_PER_NODE)
    )


def _nodes() -> list[Node]:
    nodes = []
    for job, indexes in JOBS.items():
        for i in indexes:
            first = i % 2 * RANKS_PER_NODE + (32 if job == "slow" else 0)
            node = Node(f"node-{i}", job, first)
            if job == "hung":
                node.override = _hung
                node.extra = lambda job=job, first=first: _waiting(job, first, CULPRIT)
            if job == "slow":
                node.extra = lambda job=job, first=first: _lateness(job, first)
            nodes.append(node)
    return nodes


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("scale")
    started = time.monotonic()
    with contextlib.ExitStack() as es:
        nodes = es.enter_context(Nodes(_nodes(), _ports_by_shard()))
        webhook = es.enter_context(Webhook())
        am = es.enter_context(Alertmanager(work / "am", alertmanager_config(webhook.url)).running())
        targets = [nodes.address(i) for i in range(len(nodes.nodes))]
        s = es.enter_context(Stack(work / "stack", targets, am.url, free_port=free_port))
        rules = work / "rules"
        alerts_build.write(rules, for_override="1s")
        files = [*sorted(rules.glob("*.rules.yml")), rules / "gpu-source" / "sidecar.rules.yml"]
        prom = es.enter_context(Prometheus(work / "prom", targets=targets, rule_files=files).running())
        yield {"stack": s, "am": am, "nodes": nodes, "started": started, "prom": prom}
        print(f"\nscale stack: {time.monotonic() - started:.1f} s from start to the last check")


def _am_alerts(am: Alertmanager, name: str) -> list[dict]:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{am.url}/api/v2/alerts?filter=alertname%3D%22{name}%22", timeout=10) as answer:
        return json.loads(answer.read())


def test_each_shard_scrapes_its_half_and_the_store_holds_every_node(stack):
    s = stack["stack"]
    wait_until(lambda: len(s.query("sidecar_node_info")) == 6, 30, what="six nodes in the store")
    by_shard = {name: s.metrics(name) for name in s.shard_names}
    assert all("prometheus_remote_storage_samples_total" in text for text in by_shard.values()), by_shard.keys()
    instances = {r["metric"]["instance"] for r in s.query('up{job="sidecar"} == 1')}
    assert len(instances) == 6, instances


def test_a_hung_rank_fires_its_jobs_alert_once_with_its_rank_and_node(stack):
    s = stack["stack"]
    (alert,) = wait_until(lambda: s.firing("SidecarJobHungOnRank"), 40, interval=0.5, what="SidecarJobHungOnRank")
    labels = alert["labels"]
    assert (labels["job_id"], labels["rank"], labels["node"]) == ("hung", str(CULPRIT), "node-1"), labels
    at_am = wait_until(lambda: _am_alerts(stack["am"], "SidecarJobHungOnRank"), 20, what="the alert at Alertmanager")
    assert [(a["labels"]["job_id"], a["labels"]["rank"]) for a in at_am] == [("hung", str(CULPRIT))], at_am


def test_the_straggler_is_named_across_shards(stack):
    s = stack["stack"]
    (alert,) = wait_until(lambda: s.firing("SidecarStragglerRank"), 40, interval=0.5, what="SidecarStragglerRank")
    labels = alert["labels"]
    assert (labels["job_id"], labels["rank"]) == ("slow", str(STRAGGLER)), labels
    assert labels["instance"] == stack["nodes"].address(5), labels


def test_the_job_level_records_count_every_node_of_a_job(stack):
    s = stack["stack"]
    ranks = wait_until(
        lambda: s.query('job_id_state:sidecar_rank_state:count{job_id="healthy",state="healthy"}'),
        30,
        what="the healthy job's rank count",
    )
    assert float(ranks[0]["value"][1]) == 2 * RANKS_PER_NODE, ranks  # both shards' ranks


def test_every_rule_evaluates_without_error_in_metricsql(stack):
    s = stack["stack"]
    wait_until(lambda: s.firing("SidecarJobHungOnRank"), 40, interval=0.5, what="the stack evaluating")
    groups = s.groups()
    errors = {r["name"]: r["lastError"] for g in groups for r in g["rules"] if r.get("lastError")}
    assert errors == {}, errors
    assert sum(len(g["rules"]) for g in groups) > 100, [g["name"] for g in groups]


def _series(answer: list[dict]) -> set[tuple]:
    return {tuple(sorted((k, v) for k, v in r["metric"].items() if k != "__name__")) for r in answer}


def test_every_recording_rule_gives_the_same_series_in_metricsql_as_in_promql(stack):
    s, prom = stack["stack"], stack["prom"]
    wait_until(lambda: s.firing("SidecarStragglerRank"), 40, interval=0.5, what="the stack evaluating")
    records = sorted({r["name"] for g in s.groups() for r in g["rules"] if r["type"] == "recording"})

    def differences() -> dict[str, tuple]:
        out = {}
        for name in records:
            vm, pq = _series(s.query(name)), _series(prom.query(name)["data"]["result"])
            if vm != pq:
                out[name] = (sorted(vm - pq)[:3], sorted(pq - vm)[:3])
        return out

    found: dict = {}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # both evaluate every second, not at the same instants
        found = differences()
        if not found:
            break
        time.sleep(1)
    assert found == {}, "(only in MetricsQL, only in PromQL): " + repr(found)
    assert len(records) > 50, records


def test_a_healthy_job_fires_nothing(stack):
    s = stack["stack"]
    wait_until(lambda: s.firing("SidecarJobHungOnRank"), 40, interval=0.5, what="the stack evaluating")
    about_healthy = [a for a in s.alerts() if a["labels"].get("job_id") == "healthy"]
    assert about_healthy == [], [(a["name"], a["state"]) for a in about_healthy]
