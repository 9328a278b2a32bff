"""The rules split for a cluster scraped in shards (sidecar/mixin/shards.py, deploy/scale/): every
rule is in exactly one of the global ruler's and the shards' files, every job-level rule is global,
and every per-shard rule is proven to judge one node at a time."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from sidecar.mixin import rules, scale, shards
from sidecar.mixin.promql import Alert, Record
from tests.support import ROOT

SCALE = ROOT / "deploy" / "scale"
PROMTOOL = shutil.which("promtool")


def _rules(name: str) -> dict[str, dict]:
    doc = yaml.safe_load((SCALE / name).read_text())
    return {r.get("alert") or r["record"]: r for g in doc["groups"] for r in g["rules"]}


def test_every_rule_is_in_exactly_one_of_the_global_and_shard_files():
    at_global, at_shard = _rules("global.rules.yml"), _rules("shard.rules.yml")
    everything = [r.name if isinstance(r, Alert) else r.record for r in rules.all_alerts() + rules.all_records()]
    everything += [r.record for r in rules.sources()["sidecar"].rules]
    assert not set(at_global) & set(at_shard)
    assert sorted(at_global | at_shard) == sorted(everything)


def test_every_rule_that_judges_a_job_runs_at_the_global_ruler():
    at_global = _rules("global.rules.yml")
    for name in ("SidecarJobHungOnRank", "SidecarStragglerRank", "SidecarCollectiveStuck", "SidecarJobGoodputLow"):
        assert name in at_global, name
    # A record or alert whose answer is per job (no node in its labels) is global.
    for rule in rules.all_records():
        if rule.record.startswith(("job_id:", "job_id_state:", "job_id_pg:")):
            assert rule.record in at_global, rule.record


# Written out again here, apart from shards.py: a rule judges one node at a time when every
# aggregation's `by` keeps `instance` and every vector match is `on` it.
_BY = re.compile(
    r"\b(?:sum|avg|max|min|count|group|quantile|stddev|stdvar|topk|bottomk|count_values)\s*(by|without)?\s*\(([^()]*)\)?"
)
_ON = re.compile(r"\b(on|ignoring)\s*\(([^()]*)\)")


def test_every_per_shard_rule_keeps_the_node_in_every_aggregation_and_match():
    at_shard = _rules("shard.rules.yml")
    assert at_shard, "no per-node rule left for the shards"
    for name, rule in at_shard.items():
        expr = rule["expr"]
        assert "absent(" not in expr and "scalar(" not in expr, name
        for m in _BY.finditer(expr):
            assert m[1] == "by" and "instance" in m[2].replace(" ", "").split(","), (name, m[0])
        for m in _ON.finditer(expr):
            assert m[1] == "on" and "instance" in m[2], (name, m[0])


@pytest.mark.parametrize(
    "expr, why",
    [
        ("max by (namespace, cluster, job_id) (sidecar_training_step)", "aggregates across nodes"),
        ("sum(rate(x[5m]))", "aggregates every node into one"),
        ("max without (instance) (x)", "drops the node"),
        ("x > on (job_id) group_left () y", "matches series of different nodes"),
        ("absent(up)", "judges every node's series at once"),
    ],
)
def test_an_expression_that_spans_nodes_is_named_so(expr, why):
    assert why in (shards.not_per_node(expr) or "")


def test_an_expression_of_one_node_is_per_node():
    expr = "max by (cluster, instance, gpu) (rate(x[5m])) * on (cluster, instance) group_left (node) y"
    assert shards.not_per_node(expr) is None


def test_a_rule_reading_a_global_record_is_global():
    from sidecar.mixin.promql import Group

    group = Group(
        "g",
        [
            Record("job:x:max", "max by (job_id) (x)"),
            Alert("Derived", "job:x:max > 1", "warning", "s", "d"),
            Alert("Node", "max by (instance) (x) > 1", "warning", "s", "d"),
        ],
    )
    at_global, at_shard = shards.split([group])
    assert [r.name if isinstance(r, Alert) else r.record for r in at_global[0].rules] == ["job:x:max", "Derived"]
    assert [g.name for g in at_shard] == ["g-node"]


def test_each_shard_keeps_its_own_hashmod_of_the_targets():
    for n in range(2):
        config = yaml.safe_load((SCALE / f"scrape-shard-{n}.yml").read_text())
        relabel = config["scrape_configs"][0]["relabel_configs"]
        assert relabel[0] == {
            "source_labels": ["__address__"],
            "modulus": 2,
            "target_label": "__tmp_shard",
            "action": "hashmod",
        }
        assert relabel[1] == {"source_labels": ["__tmp_shard"], "regex": str(n), "action": "keep"}
    with pytest.raises(ValueError, match="shard 2 is not one of 0..1"):
        scale.scrape_config(scale.DEFAULT, 2)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
def test_promtool_accepts_the_scale_files(tmp_path):
    for name in ("global.rules.yml", "shard.rules.yml"):
        out = subprocess.run([PROMTOOL, "check", "rules", str(SCALE / name)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run(
        [PROMTOOL, "check", "config", "--agent", str(SCALE / "scrape-shard-0.yml")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
