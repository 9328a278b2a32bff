"""The deployment files: Kubernetes manifests validate against the Kubernetes schemas (CRDs
by their required fields, their pod templates by the core schemas, their rules by
promtool), the settings they carry load, the systemd unit verifies, the launcher refuses
bad input, and the generated files are current."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from sidecar.commands import deploygen
from sidecar.config import DEFAULT_SOCKET, load_settings
from tests.support import PYTHON, ROOT, Sidecar
from trainer_hooks.wire import CRASH_LOOP_EXIT

K8S = ROOT / "deploy" / "kubernetes"
BAREMETAL = ROOT / "deploy" / "baremetal"
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "PyTorchJob", "JobSet", "TrainJob", "Kustomization"}
PROMTOOL = shutil.which("promtool")


def _documents() -> list[tuple[str, dict]]:
    """The manifests as shipped (overlays and components are rendered in test_overlays.py)."""
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.relative_to(K8S).parts[0] in ("overlays", "components"):
            continue
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc:
                out.append((f"{path.relative_to(K8S)}#{i}", doc))
    return out


DOCS = _documents()
BY_KIND: dict[str, list[dict]] = {}
for _, _doc in DOCS:
    BY_KIND.setdefault(_doc["kind"], []).append(_doc)


def _validate(doc: dict) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize(
    "name, doc", [d for d in DOCS if d[1]["kind"] not in CRD_KINDS], ids=lambda v: v if isinstance(v, str) else ""
)
def test_manifest_validates_against_the_kubernetes_schema(name, doc):
    _validate(doc)


def test_every_manifest_kind_is_validated_somewhere():
    assert {d["kind"] for _, d in DOCS} <= CRD_KINDS | {
        "Namespace",
        "ServiceAccount",
        "ConfigMap",
        "ResourceQuota",
        "DaemonSet",
        "Service",
    }


def _container(pod_spec: dict, name: str | None = None) -> dict:
    return next(c for c in pod_spec["containers"] if name is None or c["name"] == name)


def daemonset() -> dict:
    (ds,) = BY_KIND["DaemonSet"]
    return ds


def test_daemonset_sees_host_processes_with_only_kill_and_ptrace():
    pod = daemonset()["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    sc = _container(pod, "sidecar")["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["KILL", "SYS_PTRACE"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["tolerations"] == [{"operator": "Exists"}]  # every node that trains runs the sidecar


def test_daemonset_mounts_host_sys_and_proc_read_only_where_the_settings_point():
    pod = daemonset()["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in _container(pod, "sidecar")["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for host, inside in (("/sys", "/host/sys"), ("/proc", "/host/proc")):
        assert mounts[inside].get("readOnly") is True
        assert volumes[mounts[inside]["name"]]["hostPath"]["path"] == host
    settings = _configmap_settings()
    assert settings.collectors.sysfs_root == "/host/sys" and settings.collectors.procfs_root == "/host/proc"
    socket_dir = str(Path(settings.socket).parent)
    assert volumes[mounts[socket_dir]["name"]]["hostPath"]["path"] == "/run/sidecar"


def test_daemonset_probes_use_the_health_endpoints_on_the_configured_port():
    container = _container(daemonset()["spec"]["template"]["spec"], "sidecar")
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    port = next(p for p in container["ports"] if p["name"] == "metrics")["containerPort"]
    assert _configmap_settings().listen_port == port
    assert {e["name"]: e.get("value") for e in container["env"]}["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert container["resources"]["requests"] and container["resources"]["limits"]


def _configmap_settings():
    cm = next(c for c in BY_KIND["ConfigMap"] if c["metadata"]["name"] == "sidecar-config")
    tree = yaml.safe_load(cm["data"]["sidecar.yaml"])
    flat = {}

    def walk(prefix, node):
        for key, value in node.items():
            if isinstance(value, dict) and key != "phase_timeouts":
                walk(f"{prefix}{key}.", value)
            else:
                flat[prefix + key] = value

    walk("", tree)
    return load_settings(overrides=flat, environ={})  # a bad key or value raises ConfigError


def test_the_daemonset_mounts_the_config_file_and_token_the_settings_name():
    pod = daemonset()["spec"]["template"]["spec"]
    container = _container(pod, "sidecar")
    config_path = container["args"][container["args"].index("--config") + 1]
    mounted = [m["mountPath"] for m in container["volumeMounts"]]
    assert str(Path(config_path).parent) in mounted
    assert str(Path(_configmap_settings().token_file).parent) in mounted


def test_service_monitor_selects_the_service_and_its_port():
    (service,) = BY_KIND["Service"]
    (monitor,) = BY_KIND["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert service["spec"]["clusterIP"] == "None"
    ports = {p["name"] for p in service["spec"]["ports"]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] and all(
        e["port"] in ports and e.get("path", "/metrics") == "/metrics" for e in monitor["spec"]["endpoints"]
    )
    assert service["spec"]["selector"].items() <= daemonset()["spec"]["template"]["metadata"]["labels"].items()
    # The ranks' own namespace/pod/container labels win over the target's (the sidecar pod's), which are dropped.
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["honorLabels"] is True
        assert {"action": "labeldrop", "regex": "(namespace|pod|container)"} in endpoint["relabelings"]


def test_prometheus_rules_have_the_operator_structure():
    rules = BY_KIND.get("PrometheusRule", [])
    assert rules, "no PrometheusRule generated from alerts/"
    for rule in rules:
        assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["name"]
        for group in rule["spec"]["groups"]:
            assert group["name"] and group["rules"]
            for r in group["rules"]:
                assert ("alert" in r) != ("record" in r) and r["expr"]


@pytest.mark.system
@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
def test_prometheus_rules_embedded_in_the_objects_pass_promtool(tmp_path):
    files = []
    for i, rule in enumerate(BY_KIND.get("PrometheusRule", [])):
        path = tmp_path / f"rules-{i}.yml"
        path.write_text(yaml.safe_dump(rule["spec"]))
        files.append(str(path))
    assert files
    out = subprocess.run([PROMTOOL, "check", "rules", *files], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_each_prometheus_rule_is_named_after_the_rule_group_it_carries():
    rules = BY_KIND["PrometheusRule"]
    assert rules
    for rule in rules:
        assert [g["name"] for g in rule["spec"]["groups"]] == [rule["metadata"]["name"]]
    assert len({r["metadata"]["name"] for r in rules}) == len(rules)


def test_each_dashboard_configmap_is_named_after_its_dashboard_file():
    dashboards = [c for c in BY_KIND["ConfigMap"] if c["metadata"].get("labels", {}).get("grafana_dashboard")]
    assert dashboards
    for cm in dashboards:
        (name,) = cm["data"]
        assert cm["metadata"]["name"] == "sidecar-dashboard-" + name.removesuffix(".json")
        assert yaml.safe_load(cm["data"][name])["uid"] == "sidecar-" + name.removesuffix(".json")


def test_dashboard_configmaps_carry_the_grafana_sidecar_label():
    dashboards = [c for c in BY_KIND["ConfigMap"] if c["metadata"].get("labels", {}).get("grafana_dashboard")]
    assert len(dashboards) == len(list((ROOT / "dashboards").glob("*.json")))
    assert all(c["metadata"]["labels"]["grafana_dashboard"] == "1" for c in dashboards)


def _torchrun_command(container: dict) -> list[str]:
    return container.get("command", []) + container.get("args", [])


def _flags(cmd: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in cmd if a.startswith("--") and "=" in a)


def _assert_training_pod(pod_spec: dict, container: dict | None = None, from_operator: dict | None = None) -> None:
    """A pod of an example job: the bundled trainer under torchrun with a c10d rendezvous and
    restarts, whose rendezvous flags come from the command or, where the operator passes them
    as PET_* variables (torchrun reads PET_<FLAG> for every flag not given), `from_operator`."""
    container = container or pod_spec["containers"][0]
    cmd = _torchrun_command(container)
    flags = {**(from_operator or {}), **_flags(cmd)}
    launcher = cmd[:3] == ["python", "-m", "trainer_hooks.launch"]  # torchrun that exits 93 for a crash loop
    assert (cmd[0] == "torchrun" or launcher) and flags["--rdzv-backend"] == "c10d"
    assert int(flags["--max-restarts"]) > 0
    script = cmd[3:] if launcher else cmd
    assert script[script.index("-m") + 1] == "sidecar_trainer" and any(a.startswith("--config=") for a in cmd)
    env = {e["name"]: e.get("value") for e in container["env"]}
    # torch's own switch that brings restarts of unmodified scripts back (pytorch#135712).
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    socket_dir = str(Path(env["SIDECAR_SOCKET"]).parent)
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == socket_dir)
    volume = next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])
    # A node without the sidecar still starts the pod (the hooks carry on without it).
    assert volume["hostPath"] == {"path": "/run/sidecar", "type": "DirectoryOrCreate"}
    assert "--set=monitor.enabled=true" in cmd


def test_pytorchjob_runs_the_trainer_elastically_with_the_operators_pet_variables():
    (job,) = BY_KIND["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d" and policy["maxRestarts"] > 0 and policy["rdzvId"]
    assert int(job["spec"]["nprocPerNode"]) >= 1  # PET_NPROC_PER_NODE
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    _validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "worker"}, "spec": template["spec"]})
    container = _container(template["spec"], "pytorch")  # the container the operator fills in
    # The operator's PET_RDZV_ENDPOINT is worker 0's Service at the port named pytorchjob-port.
    assert any(p["name"] == "pytorchjob-port" for p in container["ports"])
    cmd = _torchrun_command(container)
    hard_coded = {"--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--max-restarts"}
    assert not hard_coded & set(_flags(cmd)), cmd
    from_operator = {"--rdzv-backend": policy["rdzvBackend"], "--max-restarts": str(policy["maxRestarts"])}
    _assert_training_pod(template["spec"], container, from_operator)


def test_trainjob_runs_the_trainer_with_c10d_on_the_trainers_pet_variables():
    (job,) = BY_KIND["TrainJob"]
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] >= 1 and trainer["numProcPerNode"] >= 1  # PET_NNODES, PET_NPROC_PER_NODE
    assert _flags(trainer["command"])["--rdzv-endpoint"] == "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"
    (patch,) = job["spec"]["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"
    pod = node["template"]["spec"]["template"]["spec"]
    (mounts,) = pod.pop("containers")
    assert mounts["name"] == "node"  # the runtime's trainer container
    # The pod as the Trainer builds it: the runtime's container with the TrainJob's trainer.
    container = {
        "name": "node",
        "image": trainer["image"],
        "command": trainer["command"],
        "env": trainer["env"],
        "resources": trainer["resourcesPerNode"],
        "volumeMounts": mounts["volumeMounts"],
    }
    pod["containers"] = [container]
    _validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "node"}, "spec": pod})
    _assert_training_pod(pod)


def test_jobset_ends_for_good_on_a_crash_loop_and_restarts_on_anything_else():
    """The launcher's 93 (trainer_hooks/crashloop.py) fails the Job at once (podFailurePolicy, on the
    trainer container), and a Job failed so fails the JobSet instead of being recreated."""
    (jobset,) = BY_KIND["JobSet"]
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] > 0  # other failures: recreated
    fail = {"name": "crash-loop", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}
    assert fail in policy["rules"]
    for replicated in jobset["spec"]["replicatedJobs"]:
        job = replicated["template"]["spec"]
        assert job["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
        container = job["template"]["spec"]["containers"][0]
        assert _torchrun_command(container)[:3] == ["python", "-m", "trainer_hooks.launch"]
        rule = {"action": "FailJob", "onExitCodes": {"containerName": container["name"], "operator": "In",
                                                      "values": [CRASH_LOOP_EXIT]}}  # fmt: skip
        assert rule in job["podFailurePolicy"]["rules"]


def test_jobset_runs_the_trainer_with_c10d_and_the_socket():
    (jobset,) = BY_KIND["JobSet"]
    assert jobset["apiVersion"].startswith("jobset.x-k8s.io/")
    for replicated in jobset["spec"]["replicatedJobs"]:
        assert replicated["name"] and replicated["replicas"] >= 1
        _validate(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": "workers"},
                "spec": replicated["template"]["spec"],
            }
        )
        _assert_training_pod(replicated["template"]["spec"]["template"]["spec"])


@pytest.mark.parametrize("name", ["pytorchjob.yaml", "jobset.yaml", "trainjob.yaml"])
def test_example_jobs_use_no_namespace_of_their_own(name):
    """They are created in the team's namespace (`kubectl -n TEAM apply -f`), with their ConfigMap."""
    for doc in yaml.safe_load_all((K8S / "examples" / name).read_text()):
        assert "namespace" not in doc["metadata"]


def test_kustomization_lists_files_that_exist():
    for path in K8S.rglob("kustomization.yaml"):
        doc = yaml.safe_load(path.read_text())
        for resource in doc.get("resources", []) + doc.get("components", []):
            assert (path.parent / resource).exists(), f"{path}: {resource}"


# ---------------------------------------------------------------- generated files


def test_generated_files_are_current():
    assert deploygen.stale_files() == [], "run `sidecar deploy-gen --write`"


def test_deploy_gen_check_names_a_stale_file_and_write_fixes_it(tmp_path, capsys):
    for part in ("alerts", "dashboards"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / deploygen.BASE_KUSTOMIZATION).parent.mkdir(parents=True)
    shutil.copy(ROOT / deploygen.BASE_KUSTOMIZATION, tmp_path / deploygen.BASE_KUSTOMIZATION)

    def args(*flags):
        return argparse.Namespace(write="" if "--write" in flags else None, check="--check" in flags, root=tmp_path)

    assert deploygen.main(args("--write")) == 0
    assert deploygen.main(args("--check")) == 0
    rules = sorted((tmp_path / "alerts").glob("*.rules.yml"))[0]
    rules.write_text(rules.read_text().replace("severity: critical", "severity: page", 1))
    capsys.readouterr()
    assert deploygen.main(args("--check")) == 1
    stale = capsys.readouterr().err
    assert f"stale: deploy/kubernetes/base/generated/prometheusrule-{rules.name.split('.')[0]}.yaml" in stale
    assert deploygen.main(args("--write")) == 0 and deploygen.main(args("--check")) == 0


def test_the_kube_prometheus_stack_alertmanager_files_follow_alertmanager_yml(tmp_path, capsys):
    """deploy/kube-prometheus-stack/ is generated from deploy/alertmanager/alertmanager.yml: an
    edit of its inhibit rules makes both files stale, and --write carries it into them."""
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy", ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("alerts", "dashboards"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    source = tmp_path / "deploy" / "alertmanager" / "alertmanager.yml"
    source.write_text(source.read_text().replace("equal: [cluster, instance, gpu]", "equal: [cluster, instance]"))
    args = argparse.Namespace(write=None, check=True, root=tmp_path)
    assert deploygen.main(args) == 1
    stale = capsys.readouterr().err
    assert "stale: deploy/kube-prometheus-stack/values-sidecar.yaml" in stale
    assert "stale: deploy/kube-prometheus-stack/alertmanagerconfig.yaml" in stale
    assert deploygen.main(argparse.Namespace(write="", check=False, root=tmp_path)) == 0
    values = yaml.safe_load((tmp_path / "deploy" / "kube-prometheus-stack" / "values-sidecar.yaml").read_text())
    assert values["alertmanager"]["config"]["inhibit_rules"][-1]["equal"] == ["cluster", "instance"]
    obj = yaml.safe_load((tmp_path / "deploy" / "kube-prometheus-stack" / "alertmanagerconfig.yaml").read_text())
    assert obj["spec"]["inhibitRules"][-1]["equal"] == ["cluster", "instance"]


def test_deploy_gen_names_a_broken_source(tmp_path, capsys):
    (tmp_path / "alerts").mkdir()
    (tmp_path / "dashboards").mkdir()
    (tmp_path / "dashboards" / "broken.json").write_text("{not json")
    ns = argparse.Namespace(write=None, check=True, root=tmp_path)
    assert deploygen.main(ns) == 2
    assert "dashboards/broken.json: not valid JSON" in capsys.readouterr().err


# ---------------------------------------------------------------- bare metal


def _unit_directives(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd's syntax: sections, repeatable keys; comments start with # or ;."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"not a directive: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_systemd_unit_is_a_notify_service_with_only_the_capabilities_it_needs():
    unit = _unit_directives(BAREMETAL / "sidecar.service")
    assert set(unit) == {"Unit", "Service", "Install"}
    service = unit["Service"]
    assert service["Type"] == ["notify"] and service["Restart"] == ["on-failure"]
    assert service["RuntimeDirectory"] == ["sidecar"]
    assert service["CapabilityBoundingSet"] == ["CAP_KILL CAP_SYS_PTRACE CAP_SYSLOG"]
    assert service["AmbientCapabilities"] == ["CAP_KILL CAP_SYS_PTRACE CAP_SYSLOG"]
    # Hardening that would break it: hiding other users' processes or the GPU device nodes.
    assert service.get("ProtectProc", ["default"]) == ["default"] and "ProcSubset" not in service
    assert service.get("PrivateDevices", ["no"]) == ["no"] and "PrivateUsers" not in service
    assert "/sidecar run" in service["ExecStart"][0]
    assert f"/run/{service['RuntimeDirectory'][0]}" == str(Path(DEFAULT_SOCKET).parent)


# The sidecar's own read of the kernel log (sidecar/exits/kernel.py): OOM kills are named there.
READ_KMSG = "import os; fd = os.open('/dev/kmsg', os.O_RDONLY | os.O_NONBLOCK); os.read(fd, 8192); print('read')"


def test_systemd_unit_does_not_hide_the_kernel_log():
    service = _unit_directives(BAREMETAL / "sidecar.service")["Service"]
    assert service.get("ProtectKernelLogs", ["no"]) == ["no"]  # yes makes /dev/kmsg inaccessible


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not Path("/dev/kmsg").exists(),
    reason="needs root, setpriv and /dev/kmsg",
)
def test_the_units_user_and_capabilities_can_read_the_kernel_log():
    """The unit's non-root user with exactly the unit's capabilities (setpriv applies them as
    systemd does) opens and reads /dev/kmsg, also where kernel.dmesg_restrict is 1."""
    service = _unit_directives(BAREMETAL / "sidecar.service")["Service"]
    caps = ",".join("+" + c.removeprefix("CAP_").lower() for c in service["AmbientCapabilities"][0].split())
    bounding = ",".join("+" + c.removeprefix("CAP_").lower() for c in service["CapabilityBoundingSet"][0].split())
    nobody = "65534"  # an unprivileged uid, like the unit's `sidecar` user
    out = subprocess.run(
        ["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups"]
        + [f"--inh-caps=-all,{caps}", f"--ambient-caps=-all,{caps}", f"--bounding-set=-all,{bounding}"]
        + ["/usr/bin/python3", "-c", READ_KMSG],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and out.stdout.strip() == "read", out.stderr


def test_the_daemon_tells_systemd_it_is_ready(tmp_path):
    """Type=notify relies on the daemon sending READY=1 on $NOTIFY_SOCKET once it serves."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(60)
    try:
        with Sidecar(tmp_path, env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")}) as sidecar:
            message = notify.recv(4096).decode()
            assert "READY=1" in message.split("\n")
            assert sidecar.status()["health"] in ("healthy", "degraded")
    finally:
        notify.close()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_unit_verifies(tmp_path):
    # verify checks that ExecStart exists: point it at this checkout's console script.
    text = (
        (BAREMETAL / "sidecar.service")
        .read_text()
        .replace("/opt/sidecar/bin/sidecar", str(Path(PYTHON).parent / "sidecar"))
    )
    unit = tmp_path / "sidecar.service"
    unit.write_text(text)
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (out.stdout + out.stderr).splitlines() if "sidecar.service" in line]
    assert out.returncode == 0 and problems == [], out.stdout + out.stderr


def test_environment_file_example_names_only_real_settings():
    env = {}
    for line in (BAREMETAL / "sidecar.env.example").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    assert "SIDECAR_SOCKET" in env and "SIDECAR_LISTEN" in env
    env.pop("SIDECAR_TOKEN_FILE")  # only read when the daemon starts; the file is the operator's
    settings = load_settings(environ=env)
    assert settings.socket == "/run/sidecar/sidecar.sock"


def _launch(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "PREFLIGHT": "0", **env}
    return subprocess.run(
        ["bash", str(BAREMETAL / "torchrun-launch.sh"), "--set", "train.steps=5"],
        capture_output=True,
        text=True,
        env=full,
        cwd=tmp_path,
        timeout=30,
    )


def test_launcher_runs_torchrun_with_c10d_restarts_and_the_socket(tmp_path):
    out = _launch(tmp_path, NNODES="2", RDZV_ENDPOINT="node-0:29400", CONFIG="train.yaml", RDZV_ID="job-17")
    assert out.returncode == 0, out.stderr
    cmd = out.stdout.split()
    # torch's own switch that brings restarts of unmodified scripts back (pytorch#135712).
    assert cmd[:5] == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "python3", "-m", "torch.distributed.run"]
    pairs = dict(zip(cmd, cmd[1:], strict=False))
    assert pairs["--rdzv-backend"] == "c10d" and pairs["--rdzv-endpoint"] == "node-0:29400"
    assert pairs["--rdzv-id"] == "job-17" and int(pairs["--max-restarts"]) > 0
    assert pairs["--nnodes"] == "2" and pairs["-m"] == "sidecar_trainer" and pairs["--config"] == "train.yaml"
    assert cmd[-2:] == ["--set", "train.steps=5"]
    assert "--rdzv-conf" not in pairs  # node-0 is not this machine: torch guesses, as before


@pytest.mark.parametrize(
    "endpoint, said, is_host",
    [("127.0.0.1:29400", None, "true"), ("LocalHost:29400", None, "true"),
     ("node-0:29400", "1", "true"), ("127.0.0.1:29400", "0", "false")],
)  # fmt: skip
def test_launcher_tells_torchrun_whether_this_node_hosts_the_rendezvous_store(tmp_path, endpoint, said, is_host):
    """Issue 43 row 1 on bare metal: told, the host node fails the job when another local user
    already listens on the port, instead of joining her store (tests/security/test_slurm_launch.py)."""
    env = {"NNODES": "1", "RDZV_ENDPOINT": endpoint, "CONFIG": "c.yaml", **({"RDZV_IS_HOST": said} if said else {})}
    out = _launch(tmp_path, **env)
    assert out.returncode == 0, out.stderr
    cmd = out.stdout.split()
    assert dict(zip(cmd, cmd[1:], strict=False))["--rdzv-conf"] == f"is_host={is_host}", cmd


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RDZV_ENDPOINT": "node-0:29400", "CONFIG": "c.yaml"}, "set NNODES"),
        ({"NNODES": "2", "RDZV_ENDPOINT": "node-0", "CONFIG": "c.yaml"}, "RDZV_ENDPOINT must be HOST:PORT"),
        (
            {"NNODES": "2", "RDZV_ENDPOINT": "node-0:1", "CONFIG": "c.yaml", "MAX_RESTARTS": "0"},
            "MAX_RESTARTS must be >= 1",
        ),
    ],
)
def test_launcher_refuses_missing_or_bad_settings(tmp_path, env, message):
    out = _launch(tmp_path, **env)
    assert out.returncode == 2 and message in out.stderr and out.stdout == ""


@pytest.mark.system
@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
def test_prometheus_config_example_is_valid(tmp_path):
    out = subprocess.run(
        [PROMTOOL, "check", "config", "--syntax-only", str(BAREMETAL / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    scrape = yaml.safe_load((BAREMETAL / "prometheus.yml").read_text())["scrape_configs"]
    assert [s["job_name"] for s in scrape] == ["sidecar"]


def test_the_kubernetes_settings_start_a_daemon(tmp_path):
    """Every key of the shipped ConfigMap is accepted by `sidecar run`, which becomes ready."""
    cm = next(c for c in BY_KIND["ConfigMap"] if c["metadata"]["name"] == "sidecar-config")
    config = tmp_path / "sidecar.yaml"
    config.write_text(cm["data"]["sidecar.yaml"])
    token = tmp_path / "token"
    token.write_text("0123456789abcdef\n")
    # This machine's paths for what the DaemonSet mounts; everything else as shipped.
    with Sidecar(
        tmp_path,
        f"token_file={token}",
        "collectors.sysfs_root=/sys",
        "collectors.procfs_root=/proc",
        env={"SIDECAR_CONFIG": str(config)},
    ) as sidecar:
        status = sidecar.status()
    assert status["health"] == "healthy", status["problems"]


@pytest.mark.parametrize("secret", [None, "operator-chosen-token"])
def test_the_push_token_init_container_uses_the_secret_or_makes_one_up(tmp_path, secret):
    init = daemonset()["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"][:2] == ["python", "-c"]
    script = init["command"][2]
    given, token = tmp_path / "secret-token", tmp_path / "token"
    if secret:
        given.write_text(secret)
    script = script.replace("/etc/sidecar/secret/token", str(given)).replace("/etc/sidecar/token/token", str(token))
    subprocess.run([PYTHON, "-c", script], check=True, timeout=60)
    assert token.stat().st_mode & 0o777 == 0o400
    assert token.read_text() == secret if secret else len(token.read_text()) == 64
    mounted = {m["mountPath"] for m in init["volumeMounts"]}
    assert {"/etc/sidecar/secret", "/etc/sidecar/token"} <= mounted
