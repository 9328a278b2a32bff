"""The kustomize overlays: each renders with `kubectl kustomize`, every object it renders
validates (core kinds against the Kubernetes schemas, the Prometheus Operator's by structure,
rules by promtool), each cluster-specific value is one line of the overlay's settings.yaml, and
a missing or misspelled setting stops the build with a message naming it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.support import ROOT

K8S = ROOT / "deploy" / "kubernetes"
KUBECTL = shutil.which("kubectl")
OVERLAYS = ("kube-prometheus-stack", "gpu-operator")
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed")


def render(path) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


# Settings read only by an opt-in component: the overlay is rendered with it to check them.
COMPONENT_SETTINGS = {"prometheus_namespace": "network-policy", "grafana_namespace": "network-policy"}


def _failure(tmp_path, overlay: str, edit, components: tuple[str, ...] = ()) -> str:
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    settings = tree / "overlays" / overlay / "settings.yaml"
    settings.write_text(edit(settings.read_text()))
    path = tree / "overlays" / overlay / "kustomization.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["components"] += [f"../../components/{c}" for c in components]
    path.write_text(yaml.safe_dump(doc))
    out = subprocess.run(
        [KUBECTL, "kustomize", str(tree / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0 and out.stdout == ""
    return out.stderr


@pytest.mark.parametrize("overlay", ["", "base", *(f"overlays/{o}" for o in OVERLAYS)])
def test_every_kustomization_renders_and_validates(overlay):
    docs = render(K8S / overlay)
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "ServiceMonitor", "PrometheusRule", "ConfigMap"} <= kinds
    assert not any(d["metadata"]["name"] == "sidecar-overlay-settings" for d in docs)  # local-config
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["spec"], doc["metadata"]["name"]
            continue
        for version in ("1.29.0", kubernetes_validate.latest_version()):
            kubernetes_validate.validate(doc, version, strict=True)


def _settings(overlay: str) -> dict:
    return yaml.safe_load((K8S / "overlays" / overlay / "settings.yaml").read_text())["data"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kube_prometheus_stack_labels_come_from_one_setting_each(overlay, tmp_path):
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    settings = tree / "overlays" / overlay / "settings.yaml"
    settings.write_text(
        settings.read_text()
        .replace("release: kube-prometheus-stack", "release: monitoring")
        .replace('grafana_dashboard: "1"', 'grafana_dashboard: "yes"')
    )
    docs = render(tree / "overlays" / overlay)
    selected = [d for d in docs if d["kind"] in ("ServiceMonitor", "PrometheusRule")]
    assert len(selected) >= 6 and all(d["metadata"]["labels"]["release"] == "monitoring" for d in selected)
    dashboards = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["labels"].get("app.kubernetes.io/component") == "dashboards"
    ]
    assert len(dashboards) == len(list((ROOT / "dashboards").glob("*.json")))
    assert all(d["metadata"]["labels"]["grafana_dashboard"] == "yes" for d in dashboards)
    # Nothing else got the label: the sidecar's settings ConfigMap is no dashboard.
    others = [d for d in docs if d["kind"] == "ConfigMap" and d not in dashboards]
    assert others and all("grafana_dashboard" not in d["metadata"].get("labels", {}) for d in others)


def test_the_gpu_operator_overlay_reads_dcgm_exporter_instead_of_polling_nvml(tmp_path):
    base = {(d["kind"], d["metadata"]["name"]) for d in render(K8S / "base")}
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    settings = tree / "overlays" / "gpu-operator" / "settings.yaml"
    settings.write_text(settings.read_text().replace("runtimeClassName: nvidia", "runtimeClassName: nvidia-cdi"))
    docs = render(tree / "overlays" / "gpu-operator")
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("PrometheusRule", "sidecar-gpu-source-sidecar") in base
    swapped = {("PrometheusRule", "sidecar-gpu-source-dcgm")}
    left_out = {("PrometheusRule", "sidecar-gpu-source-sidecar"), ("PrometheusRule", "sidecar-overlap")}
    assert names == base - left_out | swapped
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia-cdi"
    sidecar = next(c for c in pod["containers"] if c["name"] == "sidecar")
    env = pod_env(sidecar)
    assert env["SIDECAR_COLLECTORS_GPU_SOURCE"] == "dcgm" and env["NVIDIA_VISIBLE_DEVICES"] == "all"
    from sidecar.config import load_settings

    settings = load_settings(environ={k: v for k, v in env.items() if k.startswith("SIDECAR_")})
    assert settings.collectors.gpu_source == "dcgm"
    assert (settings.node_name, settings.peer_url) == ("gpu-node-7", "http://10.1.2.3:9402")


# What the kubelet fills in for the downward API, for a pod on node gpu-node-7 with IP 10.1.2.3.
DOWNWARD = {"spec.nodeName": "gpu-node-7", "status.podIP": "10.1.2.3"}


def pod_env(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet gives it: downward-API fields filled in and
    `$(VAR)` references to earlier variables expanded."""
    env: dict[str, str] = {}
    for e in container["env"]:
        if "value" in e:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(e["value"]))
        else:
            value = DOWNWARD[e["valueFrom"]["fieldRef"]["fieldPath"]]
        env[e["name"]] = value
    return env


@pytest.mark.parametrize("overlay, key", [(o, k) for o in OVERLAYS for k in _settings(o)])
def test_a_missing_or_misspelled_setting_stops_the_build_naming_it(tmp_path, overlay, key):
    components = (COMPONENT_SETTINGS[key],) if key in COMPONENT_SETTINGS else ()
    err = _failure(tmp_path, overlay, lambda text: text.replace(f"  {key}:", f"  {key.upper()}x:", 1), components)
    assert f"fieldPath `data.{key}` is missing" in err and "sidecar-overlay-settings" in err, err


def test_an_overlay_without_its_settings_file_stops_the_build(tmp_path):
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    (tree / "overlays" / "kube-prometheus-stack" / "settings.yaml").unlink()
    out = subprocess.run(
        [KUBECTL, "kustomize", str(tree / "overlays" / "kube-prometheus-stack")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "settings.yaml" in out.stderr


# Kinds that live in no namespace; every other kind rendered must name its namespace, or it
# lands in whatever namespace kubectl's context has.
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "PriorityClass",
    "RuntimeClass",
    "CustomResourceDefinition",
    "StorageClass",
    "PersistentVolume",
}
KUSTOMIZATIONS = sorted(
    str(p.parent.relative_to(K8S))
    for p in K8S.rglob("kustomization.yaml")
    if yaml.safe_load(p.read_text()).get("kind") == "Kustomization"  # components render only inside one
    # The example jobs go to the team's namespace (`kubectl -n TEAM`), none of their own:
    # tests/security/test_deploy_examples.py renders them.
    and p.parent != K8S / "examples"
)
NAMESPACE = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["namespace"]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_namespaced_object_of_every_kustomization_is_in_the_namespace(kustomization):
    docs = render(K8S / kustomization)
    assert docs
    for doc in docs:
        if doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"].get("namespace") == NAMESPACE, (doc["kind"], doc["metadata"]["name"])


def _daemonset_pod(docs: list[dict]) -> dict:
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return ds["spec"]["template"]["spec"]


@pytest.mark.parametrize("kustomization", ["", "base", "overlays/kube-prometheus-stack"])
def test_only_the_gpu_operator_overlay_sets_a_runtime_class(kustomization):
    assert "runtimeClassName" not in _daemonset_pod(render(K8S / kustomization))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_daemonset_tolerates_every_taint_by_default(overlay):
    assert _daemonset_pod(render(K8S / "overlays" / overlay))["tolerations"] == [{"operator": "Exists"}]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_daemonsets_tolerations_are_one_setting_of_the_overlay(overlay, tmp_path):
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    path = tree / "overlays" / overlay / "tolerations.yaml"
    patch = yaml.safe_load(path.read_text())
    only = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    patch["spec"]["template"]["spec"]["tolerations"] = only
    path.write_text(yaml.safe_dump(patch))
    assert _daemonset_pod(render(tree / "overlays" / overlay))["tolerations"] == only


SIDECAR_IMAGE = "MAKE-IMAGE-REGISTRY/training-sidecar"
NPD_IMAGE = "MAKE-IMAGE-REGISTRY/training-sidecar-npd"
# Another project's image an opt-in component brings, pinned to a release by that component's own
# `images:` (an overlay's entry of the same name overrides it; see the test below).
THIRD_PARTY = {"quay.io/brancz/kube-rbac-proxy"}
# The components that bring containers of their own (or patch the sidecar's).
COMPONENTS = sorted(
    p.name for p in (K8S / "components").iterdir() if any("image:" in f.read_text() for f in p.glob("*.yaml"))
)


def _with_images(tree, kustomization: str, components: list[str] = ()) -> list[dict]:
    """The kustomization rendered with `components` added and every `images:` entry pointed at
    registry.example/ml/<name>:1.2.3."""
    path = tree / kustomization / "kustomization.yaml"
    doc = yaml.safe_load(path.read_text())
    for image in doc["images"]:
        image.update(newName="registry.example/ml/" + image["name"].rsplit("/", 1)[1], newTag="1.2.3")
    up = "../" * len(Path(kustomization).parts)
    listed = doc.setdefault("components", [])
    listed += [f"{up}components/{c}" for c in components if f"{up}components/{c}" not in listed]
    path.write_text(yaml.safe_dump(doc))
    return render(tree / kustomization)


def _images(docs: list[dict]) -> dict[str, set[str]]:
    """Workload name -> the images of its containers and init containers."""
    out = {}
    for d in docs:
        if d["kind"] in ("DaemonSet", "Deployment", "StatefulSet", "Job"):
            pod = d["spec"]["template"]["spec"]
            out[d["metadata"]["name"]] = {c["image"] for c in pod["containers"] + pod.get("initContainers", [])}
    return out


@pytest.mark.parametrize("kustomization", ["", *(f"overlays/{o}" for o in OVERLAYS)])
def test_the_image_is_set_by_kustomize_images(kustomization, tmp_path):
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    pod = _daemonset_pod(_with_images(tree, kustomization))
    images = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    assert images == {"registry.example/ml/training-sidecar:1.2.3"}


@pytest.mark.parametrize("kustomization", ["", *(f"overlays/{o}" for o in OVERLAYS)])
def test_one_images_list_pins_every_image_of_the_base_and_every_component(kustomization, tmp_path):
    names = [i["name"] for i in yaml.safe_load((K8S / kustomization / "kustomization.yaml").read_text())["images"]]
    assert sorted(names) == sorted({SIDECAR_IMAGE, NPD_IMAGE})
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    assert {"node-problem-detector", "expected-gpus"} <= set(COMPONENTS)
    images = _images(_with_images(tree, kustomization, COMPONENTS))
    assert images["sidecar-node-problem-detector"] == {"registry.example/ml/training-sidecar-npd:1.2.3"}
    every = set().union(*images.values())
    third_party = {i for i in every if i.rsplit(":", 1)[0] in THIRD_PARTY}
    assert third_party and all(re.fullmatch(r"v\d+\.\d+\.\d+", i.rsplit(":", 1)[1]) for i in third_party)
    assert every - third_party == {
        "registry.example/ml/training-sidecar:1.2.3",
        "registry.example/ml/training-sidecar-npd:1.2.3",
    }


@pytest.mark.parametrize("kustomization", ["", *(f"overlays/{o}" for o in OVERLAYS)])
def test_an_overlays_images_entry_overrides_a_components_pinned_image(kustomization, tmp_path):
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    path = tree / kustomization / "kustomization.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["images"] += [{"name": name} for name in THIRD_PARTY]  # _with_images points each at registry.example
    path.write_text(yaml.safe_dump(doc))
    images = set().union(*_images(_with_images(tree, kustomization, COMPONENTS)).values())
    assert {"registry.example/ml/" + name.rsplit("/", 1)[1] + ":1.2.3" for name in THIRD_PARTY} <= images
    assert not any(i.rsplit(":", 1)[0] in THIRD_PARTY for i in images)


# ---------------------------------------------------------------- alerts kube-prometheus-stack has


def _alert_names(docs: list[dict]) -> set[str]:
    return {
        r["alert"]
        for d in docs
        if d["kind"] == "PrometheusRule"
        for g in d["spec"]["groups"]
        for r in g["rules"]
        if "alert" in r
    }


# What kube-prometheus-stack's own rules already raise: TargetDown, NodeNetworkReceiveErrs and
# NodeNetworkTransmitErrs, NodeFilesystemSpaceFillingUp and NodeFilesystemAlmostOutOfSpace.
DUPLICATES = {"SidecarDown", "SidecarNicErrors", "SidecarCheckpointDiskFillingUp", "SidecarCheckpointDiskAlmostFull"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_kube_prometheus_stack_overlays_leave_out_the_alerts_it_already_raises(overlay):
    base = _alert_names(render(K8S / "base"))
    assert DUPLICATES <= base and DUPLICATES <= _alert_names(render(K8S))
    assert _alert_names(render(K8S / "overlays" / overlay)) == base - DUPLICATES


def _scrape_job(docs: list[dict]) -> str:
    """The `job` label the Prometheus Operator gives the ServiceMonitor's targets: the value of the
    Service's label that jobLabel names, or the Service's name where there is no such label."""
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    (service,) = [d for d in docs if d["kind"] == "Service" and selector.items() <= d["metadata"]["labels"].items()]
    return service["metadata"]["labels"].get(monitor["spec"].get("jobLabel", ""), service["metadata"]["name"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_name_prefix_keeps_the_scrape_job_sidecar_down_selects(overlay, tmp_path):
    from alerts import build

    plain = render(K8S / "overlays" / overlay)
    (monitor,) = [d for d in plain if d["kind"] == "ServiceMonitor"]
    (service,) = [d for d in plain if d["kind"] == "Service"]
    assert monitor["spec"]["jobLabel"] in service["metadata"]["labels"]
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    prefixed_dir = tree / "overlays" / "prefixed"
    prefixed_dir.mkdir()
    (prefixed_dir / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namePrefix": "team-a-",
                "resources": [f"../{overlay}"],
            }
        )
    )
    prefixed = render(prefixed_dir)
    assert [d["metadata"]["name"] for d in prefixed if d["kind"] == "Service"] == ["team-a-sidecar"]
    assert _scrape_job(prefixed) == _scrape_job(plain) == "sidecar"
    assert build.SELECTORS["sidecar_targets"] == f'job="{_scrape_job(prefixed)}"'


# ---------------------------------------------------------------- which nodes run the sidecar

# The labels every node has: no GPU feature discovery (nor NFD, nor the GPU Operator) ran on it.
PLAIN_NODE = {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64", "kubernetes.io/hostname": "gpu-node-7"}
# What GPU feature discovery (deployed by the GPU Operator) adds to a GPU node.
GFD_NODE = {**PLAIN_NODE, "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "8"}


def _daemonset_pods(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] == "DaemonSet"}


def _schedules_on(pod: dict, node_labels: dict[str, str]) -> bool:
    """The scheduler's node filter for the fields these files may set: nodeSelector, and no
    required node affinity (a test of its own would be needed for one)."""
    affinity = pod.get("affinity", {}).get("nodeAffinity", {})
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in affinity
    return (pod.get("nodeSelector") or {}).items() <= node_labels.items()


def _with_components(tree: Path, kustomization: str, components: list[str]) -> list[dict]:
    path = tree / kustomization / "kustomization.yaml"
    doc = yaml.safe_load(path.read_text())
    up = "../" * len(Path(kustomization).parts)
    doc["components"] = doc.get("components", []) + [f"{up}components/{c}" for c in components]
    path.write_text(yaml.safe_dump(doc))
    return render(tree / kustomization)


@pytest.mark.parametrize("kustomization", ["", "base", "overlays/kube-prometheus-stack"])
def test_without_gpu_feature_discovery_every_node_runs_the_sidecar(kustomization, tmp_path):
    """The guide does not require GPU feature discovery: a selector on its labels would leave such
    a cluster with no sidecar pod at all, and nothing would say so."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    pods = _daemonset_pods(_with_components(tree, kustomization, ["node-problem-detector"]))
    assert set(pods) == {"sidecar", "sidecar-node-problem-detector"}
    for name, pod in pods.items():
        assert _schedules_on(pod, PLAIN_NODE), (name, pod.get("nodeSelector"))


def test_the_gpu_operator_overlay_runs_on_the_gpu_nodes_its_feature_discovery_labels(tmp_path):
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    pods = _daemonset_pods(_with_components(tree, "overlays/gpu-operator", ["node-problem-detector"]))
    assert set(pods) == {"sidecar", "sidecar-node-problem-detector"}
    for name, pod in pods.items():
        assert _schedules_on(pod, GFD_NODE) and not _schedules_on(pod, PLAIN_NODE), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_nodes_that_run_the_sidecar_are_one_setting_of_the_overlay(overlay, tmp_path):
    """node-selector.yaml places both DaemonSets (the sidecar and node-problem-detector, which asks it)."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    path = tree / "overlays" / overlay / "node-selector.yaml"
    patch = yaml.safe_load(path.read_text())
    patch["spec"]["template"]["spec"]["nodeSelector"] = {"node.example.com/pool": "training"}
    path.write_text(yaml.safe_dump(patch))
    pods = _daemonset_pods(_with_components(tree, f"overlays/{overlay}", ["node-problem-detector"]))
    assert {name: pod["nodeSelector"] for name, pod in pods.items()} == {
        "sidecar": {"node.example.com/pool": "training"},
        "sidecar-node-problem-detector": {"node.example.com/pool": "training"},
    }
