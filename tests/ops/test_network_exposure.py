"""Who can reach the sidecar's port (`/metrics`, `/v1/status`: job ids, pids, losses), and the
components that narrow it: `network-policy` (Prometheus, the job view's peers and training pods
that push over TCP only) and `kube-rbac-proxy` (TLS and a TokenReview/SubjectAccessReview in
front of /metrics and /v1/status, as kube-prometheus does for node_exporter). Each renders onto
the base and onto the kube-prometheus-stack overlay and validates; the policy's selectors and
ports are those of the DaemonSet's pods; the proxy forwards to the port the sidecar listens on."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.support import ROOT

K8S = ROOT / "deploy" / "kubernetes"
KUBECTL = shutil.which("kubectl")
NAMESPACE = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["namespace"]
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed")


def render_with(tmp_path: Path, *components: str, onto: str = "base") -> list[dict]:
    """`onto` (the base or an overlay) with `components` added, as an operator's overlay would."""
    tree = tmp_path / "kubernetes"
    if not tree.exists():
        shutil.copytree(K8S, tree)
    overlay = tree / "overlays" / ("with-" + "-".join(components))
    overlay.mkdir()
    resources = [f"../../{onto}"]
    if onto == "base":  # an operator's overlay carries the settings, as the shipped ones do
        shutil.copy(tree / "overlays" / "kube-prometheus-stack" / "settings.yaml", overlay / "settings.yaml")
        resources.append("settings.yaml")
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": resources,
                "components": [f"../../components/{c}" for c in components],
            }
        )
    )
    out = subprocess.run([KUBECTL, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return doc


def pod_of(docs: list[dict]) -> dict:
    return one(docs, "DaemonSet")["spec"]["template"]


def container(docs: list[dict], name: str) -> dict:
    (c,) = [c for c in pod_of(docs)["spec"]["containers"] if c["name"] == name]
    return c


def sidecar_listen_port(docs: list[dict]) -> int:
    settings = yaml.safe_load(one(docs, "ConfigMap", "sidecar-config")["data"]["sidecar.yaml"])
    host, _, port = settings["listen"].rpartition(":")
    # The proxy reaches the sidecar on loopback: the sidecar must listen there (or everywhere).
    assert host in ("0.0.0.0", "127.0.0.1", "[::]", "::"), settings["listen"]
    return int(port)


def named_ports(docs: list[dict]) -> dict[str, int]:
    """Port name -> container port, over every container of the DaemonSet's pods."""
    return {p["name"]: p["containerPort"] for c in pod_of(docs)["spec"]["containers"] for p in c.get("ports", [])}


COMBINATIONS = [
    ["network-policy"],
    ["kube-rbac-proxy"],
    ["push-over-tcp"],
    ["network-policy", "kube-rbac-proxy"],
    ["push-over-tcp", "network-policy", "kube-rbac-proxy"],
]


@pytest.mark.parametrize("onto", ["base", "overlays/kube-prometheus-stack"])
@pytest.mark.parametrize("components", COMBINATIONS, ids=lambda c: "+".join(c))
def test_each_component_renders_valid_objects_in_the_base_namespace(tmp_path, components, onto):
    docs = render_with(tmp_path, *components, onto=onto)
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["spec"]
            continue
        for version in ("1.29.0", kubernetes_validate.latest_version()):
            kubernetes_validate.validate(doc, version, strict=True)
        if doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"].get("namespace") == NAMESPACE, (doc["kind"], doc["metadata"]["name"])
    if onto != "base":  # the overlay's release label reaches the patched ServiceMonitor too
        assert one(docs, "ServiceMonitor")["metadata"]["labels"]["release"]


def test_the_sidecar_pods_are_no_host_network_pods_so_a_network_policy_applies(tmp_path):
    spec = pod_of(render_with(tmp_path, "network-policy", "push-over-tcp"))["spec"]
    assert not spec.get("hostNetwork")


def _matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # no matchExpressions to evaluate here
    return selector["matchLabels"].items() <= labels.items()


def test_the_network_policy_selects_the_daemonsets_pods_and_its_port(tmp_path):
    docs = render_with(tmp_path, "network-policy")
    policy = one(docs, "NetworkPolicy", "sidecar")["spec"]
    labels = pod_of(docs)["metadata"]["labels"]
    assert _matches(policy["podSelector"], labels)
    assert policy["policyTypes"] == ["Ingress"]
    prometheus, grafana, peers, training = policy["ingress"]
    ports = named_ports(docs)
    port = sidecar_listen_port(docs)
    # Prometheus: kube-prometheus-stack's Prometheus pods in `monitoring`, on the sidecar's port
    # (and the proxy's, which matches nothing without components/kube-rbac-proxy).
    (source,) = prometheus["from"]
    assert source["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    assert source["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert [p["port"] for p in prometheus["ports"]] == ["metrics", "https-metrics"]
    assert ports["metrics"] == port
    # Grafana (kube-prometheus-stack's, in `monitoring`) reading /v1/status: the same ports.
    (source,) = grafana["from"]
    assert source["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    assert source["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "grafana"}
    assert [p["port"] for p in grafana["ports"]] == ["metrics", "https-metrics"]
    # The job view's peers: the DaemonSet's other pods, in this namespace (no namespaceSelector).
    (source,) = peers["from"]
    assert set(source) == {"podSelector"} and _matches(source["podSelector"], labels)
    assert [ports[p["port"]] for p in peers["ports"]] == [port]
    # The training pods that push over TCP: namespaces labelled for it, nothing else.
    (source,) = training["from"]
    assert source == {"namespaceSelector": {"matchLabels": {"training-sidecar/push-over-tcp": "true"}}}
    assert [ports[p["port"]] for p in training["ports"]] == [port]
    for rule in policy["ingress"]:
        assert all(p["protocol"] == "TCP" for p in rule["ports"])


def test_the_peers_advertise_the_port_the_policy_opens_to_them(tmp_path):
    docs = render_with(tmp_path, "network-policy")
    env = {e["name"]: e.get("value") for e in container(docs, "sidecar")["env"]}
    _, _, peers, _ = one(docs, "NetworkPolicy", "sidecar")["spec"]["ingress"]
    assert env["SIDECAR_JOB_VIEW_ADVERTISE_URL"].endswith(f":{named_ports(docs)[peers['ports'][0]['port']]}")


def test_the_kube_rbac_proxy_forwards_to_the_sidecars_loopback_and_serves_tls(tmp_path):
    docs = render_with(tmp_path, "kube-rbac-proxy")
    proxy = container(docs, "kube-rbac-proxy")
    args = dict(a.removeprefix("--").split("=", 1) for a in proxy["args"])
    assert args["upstream"] == f"http://127.0.0.1:{sidecar_listen_port(docs)}/"
    (port,) = proxy["ports"]
    assert port["name"] == "https-metrics" and args["secure-listen-address"].endswith(f":{port['containerPort']}")
    assert set(args["allow-paths"].split(",")) == {"/metrics", "/v1/status"}
    context = proxy["securityContext"]
    assert context["runAsNonRoot"] and context["capabilities"]["drop"] == ["ALL"] and context["readOnlyRootFilesystem"]
    # Its token is mounted into the proxy alone: the sidecar container still has no API credentials.
    spec = pod_of(docs)["spec"]
    assert spec["automountServiceAccountToken"] is False
    (mount,) = proxy["volumeMounts"]
    assert mount["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
    assert all(m["name"] != mount["name"] for m in container(docs, "sidecar")["volumeMounts"])
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert any("serviceAccountToken" in s for s in volume["projected"]["sources"])


def test_the_service_monitor_scrapes_the_proxy_over_https_with_a_bearer_token(tmp_path):
    docs = render_with(tmp_path, "kube-rbac-proxy")
    (endpoint,) = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["port"] == "https-metrics" and endpoint["scheme"] == "https"
    assert endpoint["bearerTokenFile"] == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert "tlsConfig" in endpoint and endpoint["path"] == "/metrics"
    assert (
        endpoint["relabelings"]
        == one(render_with(tmp_path, onto="base"), "ServiceMonitor")["spec"]["endpoints"][0]["relabelings"]
    )
    # The Service carries the port by that name, pointing at the proxy's container port.
    (service_port,) = [p for p in one(docs, "Service")["spec"]["ports"] if p["name"] == "https-metrics"]
    assert named_ports(docs)[service_port["targetPort"]] == service_port["port"]


def _rules(role: dict) -> list[tuple]:
    return [
        (
            tuple(r.get("apiGroups", [])),
            tuple(r.get("resources", [])),
            tuple(r.get("nonResourceURLs", [])),
            tuple(r["verbs"]),
        )
        for r in role["rules"]
    ]


def test_the_kube_rbac_proxy_may_review_tokens_and_access_and_prometheus_may_get_metrics(tmp_path):
    docs = render_with(tmp_path, "kube-rbac-proxy")
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    bindings = [d for d in docs if d["kind"] == "ClusterRoleBinding"]

    def bound(role_name: str) -> list[dict]:
        return [s for b in bindings if b["roleRef"]["name"] == role_name for s in b["subjects"]]

    (proxy_role,) = [n for n, r in roles.items() if ("authentication.k8s.io",) in [rule[0] for rule in _rules(r)]]
    assert sorted(_rules(roles[proxy_role])) == [
        (("authentication.k8s.io",), ("tokenreviews",), (), ("create",)),
        (("authorization.k8s.io",), ("subjectaccessreviews",), (), ("create",)),
    ]
    account = pod_of(docs)["spec"]["serviceAccountName"]
    assert bound(proxy_role) == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    readers = [n for n, r in roles.items() if ((), (), ("/metrics",), ("get",)) in _rules(r)]
    assert readers and bound(readers[0]), "no ClusterRole lets Prometheus get /metrics"
    assert bound(readers[0])[0]["kind"] == "ServiceAccount"


def test_with_the_proxy_prometheus_may_reach_only_the_proxys_port(tmp_path):
    docs = render_with(tmp_path, "network-policy", "kube-rbac-proxy")
    prometheus, grafana, peers, training = one(docs, "NetworkPolicy", "sidecar")["spec"]["ingress"]
    assert [p["port"] for p in prometheus["ports"]] == [p["port"] for p in grafana["ports"]] == ["https-metrics"]
    assert named_ports(docs)["https-metrics"] == container(docs, "kube-rbac-proxy")["ports"][0]["containerPort"]
    # The job view's peers and TCP push keep the sidecar's own port (plain HTTP, their own checks).
    assert [p["port"] for p in peers["ports"]] == [p["port"] for p in training["ports"]] == ["metrics"]


@pytest.mark.parametrize("overlay", ["kube-prometheus-stack", "gpu-operator"])
def test_the_namespaces_of_prometheus_and_grafana_are_one_setting_each_of_the_overlay(tmp_path, overlay):
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    settings = tree / "overlays" / overlay / "settings.yaml"
    doc = yaml.safe_load(settings.read_text())
    assert doc["data"]["prometheus_namespace"] == doc["data"]["grafana_namespace"] == "monitoring"
    settings.write_text(
        settings.read_text()
        .replace("prometheus_namespace: monitoring", "prometheus_namespace: observability")
        .replace("grafana_namespace: monitoring", "grafana_namespace: dashboards")
    )
    docs = render_with(tmp_path, "network-policy", "kube-rbac-proxy", onto=f"overlays/{overlay}")
    prometheus, grafana, _, _ = one(docs, "NetworkPolicy", "sidecar")["spec"]["ingress"]
    assert prometheus["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "observability"}
    assert grafana["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "dashboards"}
    assert [p["port"] for p in prometheus["ports"]] == [p["port"] for p in grafana["ports"]] == ["https-metrics"]
