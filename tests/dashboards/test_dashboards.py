"""The dashboards: generated from dashboards/build.py, shaped as Grafana expects, and every
query valid PromQL on a real Prometheus."""

from __future__ import annotations

import re

import pytest

from dashboards import build
from tests.alerts.realstack import Prometheus
from tests.dashboards.panels import DASHBOARD_FILES, load, queries, substitute, variable_queries

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def test_dashboard_files_are_current_with_their_source():
    expected = build.rendered_files()
    assert sorted(p.name for p in DASHBOARD_FILES) == sorted(expected)
    stale = [p.name for p in DASHBOARD_FILES if p.read_text() != expected[p.name]]
    assert not stale, f"regenerate with `python -m dashboards.build`: {stale}"


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_a_dashboards_uid_and_title_say_its_file_name(path):
    """One name per dashboard: the file `rank-drilldown.json` is uid `sidecar-rank-drilldown`,
    title "Rank drill-down" and (sidecar deploy-gen) ConfigMap `sidecar-dashboard-rank-drilldown`."""
    d = load(path)
    assert d["uid"] == f"sidecar-{path.stem}"
    assert path.stem.replace("-", "") in re.sub(r"[^a-z]", "", d["title"].lower()), d["title"]


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_every_panel_queries_the_datasource_variable(path):
    d = load(path)
    assert d["schemaVersion"] >= 39 and d["uid"] and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in d["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == DATASOURCE and t["expr"].strip()


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_panels_have_unique_ids_and_fit_the_grid(path):
    d = load(path)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_every_variable_used_in_a_query_is_defined(path):
    d = load(path)
    defined = {v["name"] for v in d["templating"]["list"]} | {"__rate_interval", "__interval", "__range"}
    for where, expr in queries(d):
        used = set(re.findall(r"\$\{?(\w+)", expr))
        assert used <= defined, f"{where}: undefined {used - defined}"


def test_dashboards_are_templated_by_job_node_rank_and_gpu():
    names = {v["name"] for path in DASHBOARD_FILES for v in load(path)["templating"]["list"]}
    assert {"datasource", "job_id", "instance", "rank", "gpu"} <= names


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_every_dashboard_has_kube_prometheus_stacks_cluster_and_namespace_variables(path):
    variables = {v["name"]: v for v in load(path)["templating"]["list"]}
    names = list(variables)
    assert names[:4] == ["datasource", "cluster", "namespace", "job_id"], names
    for name in ("cluster", "namespace"):
        # All matches series without the label too: one cluster, or ranks outside Kubernetes.
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*", name
    assert "$namespace" in variables["job_id"]["definition"]  # the namespace narrows the jobs


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_every_selector_of_every_query_names_the_cluster(path):
    for where, expr in queries(load(path)):
        selectors = re.findall(r"[\w:]+\{([^{}]*)\}", expr)
        assert selectors, where
        for labels in selectors:
            assert 'cluster=~"$cluster"' in labels, f"{where}: {{{labels}}}"


def test_job_dashboard_reads_recording_rules():
    from alerts.build import all_records

    records = {r.record for r in all_records()}
    exprs = " ".join(e for _, e in queries(load(build.HERE / "training-job.json")))
    assert sum(r in exprs for r in records) >= 8


@pytest.mark.system
def test_every_query_is_valid_promql_on_a_real_prometheus(tmp_path):
    values = {
        "cluster": ".*",
        "namespace": ".*",
        "job_id": "j1",
        "instance": "127.0.0.1:1",
        "rank": "0",
        "gpu": "0",
        "device": "eth0",
        "datasource": "unused",
    }
    with Prometheus(tmp_path).running() as prom:
        for path in DASHBOARD_FILES:
            d = load(path)
            for where, expr in queries(d):
                answer = prom.query(substitute(expr, values))
                assert answer["status"] == "success", f"{where}: {answer.get('error')}"
            for name, selector, _label in variable_queries(d):
                answer = prom.api("series", **{"match[]": substitute(selector, values)})
                assert answer["status"] == "success", f"variable {name}: {answer.get('error')}"


# ---------------------------------------------------------------- the namespace variable

NAMESPACE_MATCHER = 'namespace=~"$namespace"'


def _uses_namespace(selector: str, definitions: dict[str, str], seen: frozenset[str] = frozenset()) -> bool:
    """A selector is narrowed by the namespace variable when it names it, or when it selects no
    job's series (those carry the namespace: every series labelled job_id, the recording rules'
    too) and picks its series by a variable (the node, a GPU) whose own query is narrowed by it."""
    if NAMESPACE_MATCHER in selector:
        return True
    if "job_id" in selector:
        return False  # the same job id in two namespaces: only the namespace tells them apart
    variables = set(re.findall(r"\$\{?(\w+)", selector)) - {"cluster", "namespace"} - seen
    return any(
        all(_uses_namespace(s, definitions, seen | {v}) for s in _selectors(definitions[v]))
        for v in variables
        if v in definitions
    )


def _selectors(expr: str) -> list[str]:
    return re.findall(r"\{([^{}]*)\}", expr)


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.stem)
def test_every_query_of_a_dashboard_with_a_namespace_variable_uses_it(path):
    """Two teams' jobs of one name never mix: every selector of every panel, annotation and variable
    query (but the cluster's and the namespace's own) is narrowed by the namespace variable."""
    d = load(path)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    if "namespace" not in variables:
        pytest.skip("no namespace variable")
    definitions = {name: v["definition"] for name, v in variables.items() if v["type"] == "query"}
    checked = [*queries(d)] + [
        (f"{d['uid']}: variable {name}", text)
        for name, text in definitions.items()
        if name not in ("cluster", "namespace")
    ]
    unnarrowed = [
        f"{where}: {{{s}}}" for where, expr in checked for s in _selectors(expr) if not _uses_namespace(s, definitions)
    ]
    wheres = {u.split(": {")[0] for u in unnarrowed}
    assert not unnarrowed, f"{len(wheres)} of {len(checked)} queries:\n" + "\n".join(unnarrowed)
