"""The kustomize overlays: each renders with `kubectl kustomize`, every object it renders
validates (core kinds against the Kubernetes schemas, the Prometheus Operator's by structure,
rules by promtool), each cluster-specific value is one line of the overlay's settings.yaml, and
a missing or misspelled setting stops the build with a message naming it."""

from __future__ import annotations

import re
import shutil
import subprocess

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


def _failure(tmp_path, overlay: str, edit) -> str:
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    settings = tree / "overlays" / overlay / "settings.yaml"
    settings.write_text(edit(settings.read_text()))
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
    assert names == base - {("PrometheusRule", "sidecar-gpu-source-sidecar")} | swapped
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
    err = _failure(tmp_path, overlay, lambda text: text.replace(f"  {key}:", f"  {key.upper()}x:", 1))
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
