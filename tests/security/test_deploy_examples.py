"""The training-pod examples run without `hostPID` (the sidecar maps pod pids to host pids),
and keep the one thing the socket needs: the /run/sidecar hostPath, read-only, with only the
sidecar's diag_dir inside it writable (tests/security/test_socket_mount.py mounts them for real).

For namespaces at Pod Security `baseline`, which forbids any hostPath, the kustomization of the
examples (`kubectl kustomize deploy/kubernetes/examples`) renders the same jobs pushing over TCP
to the node's address: every pod template it renders passes a checker of the baseline rules,
which the socket examples fail, and the hooks' own endpoint parser reads the rendered
environment as the node's sidecar with the push token."""

from __future__ import annotations

import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.support import ROOT

K8S = ROOT / "deploy" / "kubernetes"
EXAMPLES = K8S / "examples"
SOCKET_EXAMPLES = ["pytorchjob.yaml", "jobset.yaml", "trainjob.yaml"]
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed")


def _pod_specs(node):
    if isinstance(node, dict):
        if "containers" in node:
            yield node
        for value in node.values():
            yield from _pod_specs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _pod_specs(value)


@pytest.mark.parametrize("name", SOCKET_EXAMPLES)
def test_training_pods_need_no_host_pid_namespace(name):
    docs = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
    pods = [p for d in docs for p in _pod_specs(d)]
    assert pods
    for pod in pods:
        assert "hostPID" not in pod and "hostNetwork" not in pod and "hostIPC" not in pod
        host_paths = [v["hostPath"]["path"] for v in pod.get("volumes", []) if "hostPath" in v]
        assert host_paths == ["/run/sidecar", "/run/sidecar/diag"], host_paths
        for c in pod["containers"]:
            assert not (c.get("securityContext") or {}).get("privileged")


# ---------------------------------------------------------------- Pod Security `baseline`

# The capabilities `baseline` lets a container add (Pod Security Standards, "Capabilities").
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
# The sysctls `baseline` allows (Pod Security Standards, "Sysctls").
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}


def baseline_violations(pod: dict) -> list[str]:
    """What in a pod spec the Pod Security `baseline` level refuses (the controls of the Pod
    Security Standards that a training pod could trip: host namespaces, privileged containers,
    added capabilities beyond the baseline list, hostPath volumes, host ports, HostProcess, an
    unconfined seccomp profile, an unmasked /proc, unsafe sysctls). Empty: admitted."""
    out = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"spec.{field}: true")
    out += [f"volume {v['name']}: hostPath {v['hostPath']['path']}" for v in pod.get("volumes", []) if "hostPath" in v]
    pod_context = pod.get("securityContext") or {}
    if (pod_context.get("windowsOptions") or {}).get("hostProcess"):
        out.append("spec.securityContext.windowsOptions.hostProcess: true")
    if (pod_context.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append("spec.securityContext.seccompProfile: Unconfined")
    out += [f"sysctl {s['name']}" for s in pod_context.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS]
    for kind in ("containers", "initContainers", "ephemeralContainers"):
        for c in pod.get(kind) or []:
            where = f"{kind} {c['name']}"
            context = c.get("securityContext") or {}
            if context.get("privileged"):
                out.append(f"{where}: privileged")
            added = set((context.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
            if added:
                out.append(f"{where}: adds capabilities {sorted(added)}")
            if (context.get("windowsOptions") or {}).get("hostProcess"):
                out.append(f"{where}: hostProcess")
            if (context.get("seccompProfile") or {}).get("type") == "Unconfined":
                out.append(f"{where}: seccompProfile Unconfined")
            if context.get("procMount", "Default") != "Default":
                out.append(f"{where}: procMount {context['procMount']}")
            out += [f"{where}: hostPort {p['hostPort']}" for p in c.get("ports") or [] if p.get("hostPort")]
    return out


ADMITTED = {"containers": [{"name": "t", "image": "i", "securityContext": {"capabilities": {"add": ["KILL"]}}}]}


@pytest.mark.parametrize(
    "change, refused",
    [
        ({"hostNetwork": True}, "hostNetwork"),
        ({"hostPID": True}, "hostPID"),
        ({"hostIPC": True}, "hostIPC"),
        ({"volumes": [{"name": "s", "hostPath": {"path": "/run/sidecar"}}]}, "hostPath /run/sidecar"),
        ({"securityContext": {"seccompProfile": {"type": "Unconfined"}}}, "Unconfined"),
        ({"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}}, "kernel.msgmax"),
        ({"securityContext": {"windowsOptions": {"hostProcess": True}}}, "hostProcess"),
        ({"containers": [{"name": "t", "securityContext": {"privileged": True}}]}, "privileged"),
        ({"containers": [{"name": "t", "securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}}}]}, "SYS_PTRACE"),
        ({"initContainers": [{"name": "i", "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}}]}, "NET_ADMIN"),
        ({"containers": [{"name": "t", "ports": [{"containerPort": 9402, "hostPort": 9402}]}]}, "hostPort 9402"),
        ({"containers": [{"name": "t", "securityContext": {"procMount": "Unmasked"}}]}, "procMount"),
    ],
)
def test_the_baseline_checker_refuses_each_rule(change, refused):
    assert baseline_violations(ADMITTED) == []
    (violation,) = baseline_violations({**ADMITTED, **change})
    assert refused in violation


@pytest.mark.parametrize("name", SOCKET_EXAMPLES)
def test_the_socket_examples_are_refused_at_baseline_for_their_host_paths(name):
    pods = [p for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d for p in _pod_specs(d)]
    assert pods
    for pod in pods:
        assert baseline_violations(pod) == [
            "volume run-sidecar: hostPath /run/sidecar",
            "volume sidecar-diag: hostPath /run/sidecar/diag",
        ]


def _render_examples() -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(EXAMPLES)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@needs_kubectl
def test_the_tcp_examples_render_every_job_and_pass_baseline():
    docs = _render_examples()
    shipped = {d["kind"] for name in SOCKET_EXAMPLES for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d}
    assert {d["kind"] for d in docs} == shipped | {"ConfigMap"}
    pods = [p for d in docs for p in _pod_specs(d)]
    assert len(pods) == len(SOCKET_EXAMPLES)
    for pod in pods:
        assert baseline_violations(pod) == []
        # Only the socket's volumes went; the job's own are all there.
        assert [v["name"] for v in pod["volumes"]] == ["config", "checkpoints", "dshm"]
        for c in pod["containers"]:
            assert [m["name"] for m in c["volumeMounts"]] == ["config", "checkpoints", "dshm"]
    for doc in docs:
        assert "namespace" not in doc["metadata"]  # the team's namespace: `kubectl -n TEAM apply`
        if doc["kind"] == "ConfigMap":
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


# What the kubelet fills in from the downward API on a node with address 10.0.0.7.
DOWNWARD = {"status.hostIP": "10.0.0.7", "metadata.namespace": "team-a", "metadata.name": "sidecar-demo-worker-0"}
SECRET = {("sidecar-push-token", "token"): "s3cret-push-token"}


def _environment(env: list[dict]) -> dict[str, str]:
    """The container's environment as the kubelet gives it: the downward API and the Secret's key
    filled in, `$(VAR)` references to earlier variables expanded."""
    out: dict[str, str] = {}
    for e in env:
        if "value" in e:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), str(e["value"]))
        elif "fieldRef" in e["valueFrom"]:
            out[e["name"]] = DOWNWARD[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            out[e["name"]] = SECRET[(ref["name"], ref["key"])]
    return out


def _trainer_env(doc: dict) -> list[dict]:
    if doc["kind"] == "TrainJob":
        return doc["spec"]["trainer"]["env"]
    (pod,) = _pod_specs(doc)
    return pod["containers"][0]["env"]


@needs_kubectl
def test_the_tcp_examples_reach_the_nodes_sidecar_with_the_push_token():
    from trainer_hooks.environment import endpoint

    jobs = [d for d in _render_examples() if d["kind"] != "ConfigMap"]
    assert len(jobs) == len(SOCKET_EXAMPLES)
    for job in jobs:
        env = _trainer_env(job)
        assert "SIDECAR_SOCKET" not in {e["name"] for e in env}
        (token,) = [e for e in env if e["name"] == "SIDECAR_TOKEN"]
        # The job still starts where the namespace has no copy of the Secret (its hooks, refused, carry on).
        assert token["valueFrom"]["secretKeyRef"]["optional"] is True
        where = endpoint(_environment(env))
        assert (where.is_unix, where.host, where.port, where.token) == (False, "10.0.0.7", 9402, "s3cret-push-token")


@needs_kubectl
def test_the_tcp_examples_pod_templates_validate():
    for job in _render_examples():
        if job["kind"] == "ConfigMap":
            continue
        (pod,) = _pod_specs(job)
        if job["kind"] == "TrainJob":  # the Trainer puts the trainer's fields into the runtime's container
            trainer = job["spec"]["trainer"]
            (mounts,) = pod["containers"]
            pod = {**pod, "containers": [{**mounts, "image": trainer["image"], "env": trainer["env"]}]}
        doc = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "worker"}, "spec": pod}
        for version in ("1.29.0", kubernetes_validate.latest_version()):
            kubernetes_validate.validate(doc, version, strict=True)


@needs_kubectl
def test_the_sidecar_publishes_on_the_node_the_port_the_tcp_examples_use(tmp_path):
    """components/push-over-tcp: the sidecar's port on the node's address (a hostPort of its own
    container port), which SIDECAR_URL names; the sidecar's namespace is `privileged`, where a
    hostPort is allowed."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    overlay = tree / "overlays" / "tcp"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": ["../../base"], "components": ["../../components/push-over-tcp"]})
    )
    out = subprocess.run([KUBECTL, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    kubernetes_validate.validate(ds, kubernetes_validate.latest_version(), strict=True)
    (sidecar,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "sidecar"]
    (port,) = sidecar["ports"]
    assert port["hostPort"] == port["containerPort"] == 9402 and port["name"] == "metrics"
    (job,) = [d for d in _render_examples() if d["kind"] == "PyTorchJob"]
    url = {e["name"]: e.get("value") for e in _trainer_env(job)}["SIDECAR_URL"]
    assert url.endswith(f":{port['hostPort']}")
    (namespace,) = [d for d in docs if d["kind"] == "Namespace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
