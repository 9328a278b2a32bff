"""The Kubernetes components of the node verdict: node-problem-detector running `sidecar status
--check node` as a custom plugin (the NodeCondition SidecarNodeUnfit), and `expected-gpus`, which
sets collectors.expected_gpus from a node label. Each renders into an overlay with the base and
validates; the plugin's own command, run as its rule says, answers by node-problem-detector's
protocol (0 fit, 1 unfit, 2 unknown); the detector's probes ask the server its arguments start;
the init container's script, run against a stand-in of the Kubernetes API over TLS, writes
settings the sidecar accepts."""

from __future__ import annotations

import json
import re
import shutil
import ssl
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from sidecar.config import load_settings
from tests.support import ROOT, Sidecar, wait_until

K8S = ROOT / "deploy" / "kubernetes"
KUBECTL = shutil.which("kubectl")
NAMESPACE = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["namespace"]
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed")


def render_with(tmp_path: Path, *components: str) -> list[dict]:
    """The base with `components`, as an overlay of the operator's would include them."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    overlay = tree / "overlays" / "with-components"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": ["../../base"],
                "components": [f"../../components/{c}" for c in components],
            }
        )
    )
    out = subprocess.run([KUBECTL, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def named(docs: list[dict], kind: str, name: str) -> dict:
    """The one object of `kind` named `name` (a generated ConfigMap: with its hash suffix)."""
    (doc,) = [
        d
        for d in docs
        if d["kind"] == kind
        and (d["metadata"]["name"] == name or kind == "ConfigMap" and d["metadata"]["name"].startswith(name + "-"))
    ]
    return doc


@pytest.mark.parametrize(
    "components",
    [["node-problem-detector"], ["expected-gpus"], ["expected-gpus", "node-problem-detector"]],
    ids=lambda c: "+".join(c),
)
def test_each_component_renders_valid_objects_in_the_base_namespace(tmp_path, components):
    docs = render_with(tmp_path, *components)
    for doc in docs:
        if doc["kind"] in ("ServiceMonitor", "PrometheusRule"):
            continue
        for version in ("1.29.0", kubernetes_validate.latest_version()):
            kubernetes_validate.validate(doc, version, strict=True)
        if doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"].get("namespace") == NAMESPACE, (doc["kind"], doc["metadata"]["name"])
        if doc["kind"] == "ClusterRoleBinding":
            assert [s["namespace"] for s in doc["subjects"]] == [NAMESPACE]


def test_node_problem_detector_watches_the_sidecar_s_socket_with_its_custom_plugin_config(tmp_path):
    docs = render_with(tmp_path, "node-problem-detector")
    npd = named(docs, "DaemonSet", "sidecar-node-problem-detector")["spec"]["template"]["spec"]
    sidecar = named(docs, "DaemonSet", "sidecar")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in npd["volumes"]}
    assert (
        volumes["run-sidecar"]["hostPath"]
        == next(v for v in sidecar["volumes"] if v["name"] == "run-sidecar")["hostPath"]
    )
    (container,) = npd["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    config = named(docs, "ConfigMap", "sidecar-node-problem-detector")
    assert volumes["config"]["configMap"]["name"] == config["metadata"]["name"]
    (flag,) = [a for a in container["command"] if a.startswith("--config.custom-plugin-monitor=")]
    path = Path(flag.partition("=")[2])
    assert str(path.parent) == mounts["config"] and path.name in config["data"]
    plugin = json.loads(config["data"][path.name])
    assert plugin["plugin"] == "custom" and plugin["pluginConfig"]["concurrency"] == 1
    declared = {c["type"] for c in plugin["conditions"]}
    (rule,) = plugin["rules"]
    assert declared == {"SidecarNodeUnfit"}
    assert rule["type"] == "permanent" and rule["condition"] in declared
    assert rule["path"] == "/usr/local/bin/sidecar"  # the console script where the image pip-installs it
    socket = rule["args"][rule["args"].index("--socket") + 1]
    assert Path(socket).parent == Path(mounts["run-sidecar"])
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def npd_flag(command: list[str], name: str, default: str) -> str:
    """The value of node-problem-detector's flag --`name` in `command`, else its default."""
    given = [a.partition("=")[2] for a in command if a.startswith(f"--{name}=")]
    return given[-1] if given else default


class _Healthz(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the http.server interface
        self.send_response(200 if self.path == "/healthz" else 404)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args) -> None:
        pass


def test_node_problem_detector_s_probes_ask_the_server_its_arguments_start(tmp_path):
    """Upstream serves /healthz on --address:--port (defaults 127.0.0.1:20256, cmd/options), after
    waiting for the API server up to --apiserver-wait-timeout (5m): the probes ask that URL from
    inside the container (loopback is out of the kubelet's reach), the startup probe long enough."""
    docs = render_with(tmp_path, "node-problem-detector")
    (container,) = named(docs, "DaemonSet", "sidecar-node-problem-detector")["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    address, port = npd_flag(command, "address", "127.0.0.1"), npd_flag(command, "port", "20256")
    assert address == "127.0.0.1" and int(port) > 0  # 0 turns the server off
    assert "readinessProbe" not in container  # ready when the startup probe passes
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > 5 * 60
    assert npd_flag(command, "apiserver-wait-timeout", "5m0s") == "5m0s"
    for probe in (startup, liveness):
        assert set(probe) - {"periodSeconds", "timeoutSeconds", "failureThreshold"} == {"exec"}
        python, flag, script = probe["exec"]["command"]
        assert (python, flag) == ("python", "-c")  # the sidecar image's, which this one is built on
        (url,) = re.findall(r"http://[^\"]+", script)
        assert url == f"http://{address}:{port}/healthz"
        assert probe["timeoutSeconds"] > float(re.search(r"timeout=(\d+)", script)[1])
    # The probe's own command, against a stand-in of the detector's server on a free port.
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    moved = script.replace(f":{port}/", f":{server.server_port}/")
    try:
        up = subprocess.run([sys.executable, "-c", moved], capture_output=True, text=True, timeout=30)
        assert up.returncode == 0, up.stderr
    finally:
        server.shutdown()
        server.server_close()
    down = subprocess.run([sys.executable, "-c", moved], capture_output=True, text=True, timeout=30)
    assert down.returncode == 1 and down.stderr.startswith("node-problem-detector /healthz: ")


def node_check(rule_args: list[str], socket: str) -> subprocess.CompletedProcess:
    """The plugin's rule as node-problem-detector runs it, with the socket of a test sidecar."""
    args = [socket if a.endswith(".sock") else a for a in rule_args]
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True, text=True, timeout=60)


def test_the_plugin_rule_answers_by_node_problem_detector_s_protocol(tmp_path):
    plugin = json.loads((K8S / "components" / "node-problem-detector" / "sidecar-node-fit.json").read_text())
    (rule,) = plugin["rules"]
    limit = plugin["pluginConfig"]["max_output_length"]
    spec = tmp_path / "nvml.json"
    spec.write_text(json.dumps({"gpu_count": 2}))
    fake = ("collectors.nvml_module=sidecar.testing.fake_nvml_lib", "collectors.expected_gpus=4")
    with Sidecar(tmp_path / "node", *fake, env={"SIDECAR_FAKE_NVML": str(spec)}) as sidecar:
        wait_until(lambda: sidecar.status()["fitness"]["fit"] is False, 30, what="the node unfit")
        unfit = node_check(rule["args"], sidecar.socket)
        assert unfit.returncode == 1, unfit.stderr  # NonOK: the condition turns True
        assert unfit.stdout[:limit].startswith("unfit (gpu_missing): gpu_missing: 2 of 4 expected GPUs usable")
        spec.write_text(json.dumps({"gpu_count": 4}))  # NVML keeps its GPU count until it starts again:
    with Sidecar(tmp_path / "fixed", *fake, env={"SIDECAR_FAKE_NVML": str(spec)}) as sidecar:  # a reboot
        wait_until(lambda: sidecar.status()["gpus"], 30, what="the GPUs read")
        fit = node_check(rule["args"], sidecar.socket)
        assert (fit.returncode, fit.stdout) == (0, "fit\n")  # OK: the condition turns False
    gone = node_check(rule["args"], str(tmp_path / "no-sidecar.sock"))
    assert gone.returncode == 2 and gone.stdout.startswith("unknown: ")  # Unknown


# ---------------------------------------------------------------- expected-gpus


class KubernetesApi(ThreadingHTTPServer):
    """GET /api/v1/nodes/<name> over TLS, answering the node's labels to the right bearer token."""

    def __init__(self, cert: Path, key: Path, token: str, labels: dict[str, dict[str, str]]):
        self.token, self.labels = token, labels
        self.seen: list[str] = []
        super().__init__(("127.0.0.1", 0), _Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.socket = context.wrap_socket(self.socket, server_side=True)


class _Handler(BaseHTTPRequestHandler):
    server: KubernetesApi

    def do_GET(self) -> None:  # noqa: N802 - the http.server interface
        self.server.seen.append(self.path)
        name = self.path.removeprefix("/api/v1/nodes/")
        if self.headers.get("Authorization") != f"Bearer {self.server.token}":
            self._answer(401, {"kind": "Status", "code": 401})
        elif name not in self.server.labels:
            self._answer(404, {"kind": "Status", "code": 404})
        else:
            self._answer(200, {"kind": "Node", "metadata": {"name": name, "labels": self.server.labels[name]}})

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def kubernetes_api(tmp_path):
    """A stand-in API server with a certificate for 127.0.0.1, and an account directory (token,
    ca.crt) as the projected volume gives the init container."""
    account = tmp_path / "account"
    account.mkdir()
    key = tmp_path / "api.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(account / "ca.crt")],
        check=True,
        capture_output=True,
    )
    (account / "token").write_text("the-token\n")
    labels = {"gpu-node-1": {"nvidia.com/gpu.count": "8", "nvidia.com/gpu.present": "true"}, "cpu-node": {}}
    api = KubernetesApi(account / "ca.crt", key, "the-token", labels)
    thread = threading.Thread(target=api.serve_forever, daemon=True)
    thread.start()
    yield api, account
    api.shutdown()
    api.server_close()


def init_container(tmp_path: Path) -> dict:
    docs = render_with(tmp_path / "render", "expected-gpus")
    pod = named(docs, "DaemonSet", "sidecar")["spec"]["template"]["spec"]
    (init,) = [c for c in pod["initContainers"] if c["name"] == "expected-gpus"]
    (sidecar,) = pod["containers"]
    assert "api-token" not in {m["name"] for m in sidecar["volumeMounts"]}, "the sidecar itself gets no token"
    assert pod.get("automountServiceAccountToken") is not True
    return init


def run_init(init: dict, api: KubernetesApi, account: Path, node: str, tmp_path: Path) -> tuple[dict, str]:
    python, flag, script, given, _, _ = init["command"]
    written = tmp_path / f"{node}.yaml"
    env = {e["name"]: e["value"] for e in init["env"] if "value" in e}
    env.update(NODE_NAME=node, KUBERNETES_SERVICE_HOST="127.0.0.1", KUBERNETES_SERVICE_PORT=str(api.server_port))
    configmap = yaml.safe_load((K8S / "base" / "configmap.yaml").read_text())["data"]["sidecar.yaml"]
    (tmp_path / "given.yaml").write_text(configmap)
    out = subprocess.run(
        [sys.executable, flag, script, str(tmp_path / "given.yaml"), str(written), str(account)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(written.read_text()), out.stdout + out.stderr


def test_the_init_container_sets_expected_gpus_from_the_node_s_label(tmp_path, kubernetes_api):
    api, account = kubernetes_api
    settings, said = run_init(init_container(tmp_path), api, account, "gpu-node-1", tmp_path)
    assert api.seen == ["/api/v1/nodes/gpu-node-1"]
    assert settings["collectors"]["expected_gpus"] == 8 and "collectors.expected_gpus 8" in said
    given = yaml.safe_load(yaml.safe_load((K8S / "base" / "configmap.yaml").read_text())["data"]["sidecar.yaml"])
    assert {k: v for k, v in settings.items() if k != "collectors"} == {
        k: v for k, v in given.items() if k != "collectors"
    }
    path = tmp_path / "checked.yaml"
    path.write_text(yaml.safe_dump(settings))
    assert load_settings(str(path), environ={}).collectors.expected_gpus == 8  # a file the sidecar accepts


def test_a_node_without_the_label_runs_the_sidecar_without_the_check(tmp_path, kubernetes_api):
    api, account = kubernetes_api
    settings, said = run_init(init_container(tmp_path), api, account, "cpu-node", tmp_path)
    assert "expected_gpus" not in settings["collectors"]
    assert "no GPU count from label nvidia.com/gpu.count" in said
