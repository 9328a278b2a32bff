"""The Kubernetes components of the node verdict: node-problem-detector running `sidecar status
--check node` as a custom plugin (the NodeCondition SidecarNodeUnfit), and `expected-gpus`, which
sets collectors.expected_gpus from a node label. Each renders into an overlay with the base and
validates; the plugin's own command, run as its rule says, answers by node-problem-detector's
protocol (0 fit, 1 unfit, 2 unknown); the detector's probes ask the server its arguments start;
the init container's script, run against a stand-in of the Kubernetes API over TLS, writes
settings the sidecar accepts. For a node-problem-detector the cluster already runs
(deploy/node-problem-detector: Helm values for the deliveryhero chart), the same condition from a
bash script over TCP, which answers as the sidecar CLI does."""

from __future__ import annotations

import json
import re
import shutil
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socket import create_server

import kubernetes_validate
import pytest
import yaml

from sidecar.config import load_settings
from tests.support import ROOT, Sidecar, free_port, wait_until

K8S = ROOT / "deploy" / "kubernetes"
EXISTING = ROOT / "deploy" / "node-problem-detector"  # for a node-problem-detector already running
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


def chart_mount(tmp_path: Path) -> Path:
    """helm-values.yaml's custom_monitor_definitions as the chart mounts them: its ConfigMap's
    files, mode 0755 (defaultMode 493), at the directory standing for /custom-config."""
    mount = tmp_path / "custom-config"
    mount.mkdir()
    values = yaml.safe_load((EXISTING / "helm-values.yaml").read_text())
    for name, text in values["settings"]["custom_monitor_definitions"].items():
        (mount / name).write_text(text)
        (mount / name).chmod(0o755)
    return mount


def existing_check(mount: Path, port: int, **env: str) -> subprocess.CompletedProcess:
    """The existing detector's rule as it runs it (its args, the port changed to a test sidecar's),
    with HOST_IP as the downward API sets it, and no PATH to find a program on: bash builtins only."""
    (rule,) = json.loads((mount / "sidecar-node-fit.json").read_text())["rules"]
    path = mount / Path(rule["path"]).relative_to("/custom-config")
    args = [str(port) if a == "9402" else a for a in rule["args"]]
    env = {"HOST_IP": "127.0.0.1", "PATH": "/nonexistent", **env}
    return subprocess.run([str(path), *args], capture_output=True, text=True, env=env, timeout=60)


def test_the_plugin_rules_answer_by_node_problem_detector_s_protocol(tmp_path):
    """The component's rule (`sidecar status --check node` over the socket) and an existing
    detector's (the bash script over TCP) give the same answers."""
    plugin = json.loads((K8S / "components" / "node-problem-detector" / "sidecar-node-fit.json").read_text())
    (rule,) = plugin["rules"]
    limit = plugin["pluginConfig"]["max_output_length"]
    mount = chart_mount(tmp_path)
    spec = tmp_path / "nvml.json"
    spec.write_text(json.dumps({"gpu_count": 2}))
    fake = ("collectors.nvml_module=sidecar.testing.fake_nvml_lib", "collectors.expected_gpus=4")
    with Sidecar(tmp_path / "node", *fake, env={"SIDECAR_FAKE_NVML": str(spec)}) as sidecar:
        wait_until(lambda: sidecar.status()["fitness"]["fit"] is False, 30, what="the node unfit")
        unfit = node_check(rule["args"], sidecar.socket)
        assert unfit.returncode == 1, unfit.stderr  # NonOK: the condition turns True
        assert unfit.stdout[:limit].startswith("unfit (gpu_missing): gpu_missing: 2 of 4 expected GPUs usable")
        script = existing_check(mount, sidecar.port)
        assert (script.returncode, script.stdout, script.stderr) == (1, unfit.stdout, "")
        spec.write_text(json.dumps({"gpu_count": 4}))  # NVML keeps its GPU count until it starts again:
    with Sidecar(tmp_path / "fixed", *fake, env={"SIDECAR_FAKE_NVML": str(spec)}) as sidecar:  # a reboot
        wait_until(lambda: sidecar.status()["gpus"], 30, what="the GPUs read")
        fit = node_check(rule["args"], sidecar.socket)
        assert (fit.returncode, fit.stdout) == (0, "fit\n")  # OK: the condition turns False
        script = existing_check(mount, sidecar.port)
        assert (script.returncode, script.stdout, script.stderr) == (0, "fit\n", "")
    gone = node_check(rule["args"], str(tmp_path / "no-sidecar.sock"))
    assert gone.returncode == 2 and gone.stdout.startswith("unknown: ")  # Unknown
    port = free_port()
    script = existing_check(mount, port)
    assert (script.returncode, script.stdout) == (2, f"unknown: no sidecar at 127.0.0.1:{port}\n")


# ---------------------------------------------------- a node-problem-detector already running


def test_the_helm_values_mount_the_plugin_and_its_script_as_the_chart_runs_them():
    """deliveryhero/node-problem-detector (2.x) puts settings.custom_monitor_definitions in a
    ConfigMap mounted at /custom-config (mode 0755) and passes settings.custom_plugin_monitors as
    --config.custom-plugin-monitor; the container's `env` reaches the plugin (it inherits it)."""
    values = yaml.safe_load((EXISTING / "helm-values.yaml").read_text())
    files = values["settings"]["custom_monitor_definitions"]
    for name, text in files.items():  # copies of the files beside it, for other ways of installing
        assert text == (EXISTING / name).read_text(), f"copy deploy/node-problem-detector/{name} into helm-values.yaml"
    assert values["settings"]["custom_plugin_monitors"] == ["/custom-config/sidecar-node-fit.json"]
    (rule,) = json.loads(files["sidecar-node-fit.json"])["rules"]
    assert rule["path"] == "/custom-config/sidecar-node-fit.sh" and rule["args"] == ["9402"]
    assert files["sidecar-node-fit.sh"].startswith("#!/bin/bash\n")  # the image's bash (no curl, no python)
    assert (EXISTING / "sidecar-node-fit.sh").stat().st_mode & 0o111
    assert values["env"] == [{"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}]
    # The port it asks is the one components/push-over-tcp publishes on the node's addresses.
    patch = yaml.safe_load((K8S / "components" / "push-over-tcp" / "kustomization.yaml").read_text())["patches"][0]
    (ports,) = [c["ports"] for c in yaml.safe_load(patch["patch"])["spec"]["template"]["spec"]["containers"]]
    assert [p["hostPort"] for p in ports] == [int(rule["args"][0])]


def test_the_existing_detector_s_plugin_reports_the_component_s_condition():
    """The same condition, reason, message, interval and limits: only the command differs."""
    ours = json.loads((K8S / "components" / "node-problem-detector" / "sidecar-node-fit.json").read_text())
    theirs = json.loads((EXISTING / "sidecar-node-fit.json").read_text())
    command = ("path", "args")
    assert {k: v for k, v in theirs.items() if k != "rules"} == {k: v for k, v in ours.items() if k != "rules"}
    assert [{k: v for k, v in r.items() if k not in command} for r in theirs["rules"]] == [
        {k: v for k, v in r.items() if k not in command} for r in ours["rules"]
    ]


def stand_in(body: bytes, status: int = 200) -> ThreadingHTTPServer:
    """An HTTP server answering every GET with `body` (a /v1/status the sidecar might send)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server interface
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def fitness(fit: bool, *findings: tuple[str, str]) -> bytes:
    doc = {
        "version": "x",
        "problems": ['a [quoted] "problem" {here}'],
        "fitness": {
            "fit": fit,
            "reasons": sorted({r for r, _ in findings}),
            "findings": [{"reason": r, "text": text, "pids": [1, 2]} for r, text in findings],
        },
        "ranks": [{"reason": "not a finding", "text": "after the verdict"}],
    }
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("status", "body", "code", "line"),
    [
        (200, fitness(True), 0, "fit"),
        (
            200,
            fitness(False, ("unkillable", 'pid 7 "tr\\ainer"  [D]\tstate;'), ("gpu_held", "GPU 0: 1 GiB {held}\x1b/ ")),
            1,
            'unfit (gpu_held, unkillable): unkillable: pid 7 "tr\\ainer" [D]\\x09state;; '
            "gpu_held: GPU 0: 1 GiB {held}\\x1b/",
        ),
        (200, fitness(False), 1, "unfit (?): unfit, no reason given"),
        (
            200,
            b'{"version": "0.0.1", "health": "healthy"}',
            2,
            "unknown: no node verdict in the answer of the sidecar at ",
        ),
        (503, b'{"error": "busy"}', 2, "unknown: the sidecar at "),
    ],
    ids=["fit", "unfit-escapes", "unfit-no-findings", "no-verdict", "http-503"],
)
def test_the_check_script_reads_the_verdict_as_the_cli_does(tmp_path, status, body, code, line):
    """Against a stand-in answering what a sidecar might: the script's line and exit status, and,
    for a verdict, the same line as `sidecar status --check node --url` (escapes, order, spaces)."""
    mount = chart_mount(tmp_path)
    server = stand_in(body, status)
    try:
        out = existing_check(mount, server.server_port)
        url = f"http://127.0.0.1:{server.server_port}"
        cli = subprocess.run(
            [sys.executable, "-m", "sidecar", "status", "--check", "node", "--url", url],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.shutdown()
        server.server_close()
    assert (out.returncode, out.stderr) == (code, "")
    assert out.stdout.startswith(line) and out.stdout.count("\n") == 1, out.stdout
    if code < 2:
        assert (out.returncode, out.stdout) == (cli.returncode, cli.stdout)
        assert out.stdout == line + "\n"


def test_the_check_script_reads_a_long_status_in_time(tmp_path):
    """Busy node: 100 kB of problems before the verdict, 400 kB in all, well within the rule's
    timeout (20 s; a pattern removal over the text took 8 s here)."""
    doc = json.loads(fitness(False, ("gpu_held", "GPU 0: 1 GiB held")))
    doc["problems"] = [f"rank {i} of job j is stalled" + " for a while" * 8 for i in range(1000)]
    doc["ranks"] = [{"rank": i, "job_id": "j" * 30, "state": "running", "steps": list(range(20))} for i in range(2000)]
    server = stand_in(json.dumps(doc).encode())
    try:
        started = time.monotonic()
        out = existing_check(chart_mount(tmp_path), server.server_port)
        took = time.monotonic() - started
    finally:
        server.shutdown()
        server.server_close()
    assert (out.returncode, out.stdout) == (1, "unfit (gpu_held): gpu_held: GPU 0: 1 GiB held\n")
    assert took < 5, took


def test_the_check_script_is_shellcheck_clean():
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert shellcheck is not None, "shellcheck missing: make venv installs it (pyproject.toml, dev extra)"
    out = subprocess.run([shellcheck, str(EXISTING / "sidecar-node-fit.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_the_check_script_gives_up_on_a_silent_port_and_without_an_address(tmp_path):
    mount = chart_mount(tmp_path)
    with create_server(("127.0.0.1", 0)) as silent:  # connects (the backlog), never answers
        port = silent.getsockname()[1]
        out = existing_check(mount, port, SIDECAR_TIMEOUT="1")
    assert (out.returncode, out.stdout) == (2, f"unknown: no answer from the sidecar at 127.0.0.1:{port} within 1s\n")
    out = existing_check(mount, 9402, HOST_IP="")
    assert out.returncode == 2 and out.stdout.startswith("unknown: no sidecar address: set HOST_IP")


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
