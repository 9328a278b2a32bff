"""The sidecar's memory limit holds what counts against it. Files on a tmpfs are memory, charged
to the cgroup of the process that writes them: the incident records the sidecar writes into
`diag_dir` (a hostPath under the node's /run, a tmpfs; on bare metal the unit's RuntimeDirectory),
up to `incident_retention_megabytes`, count against the container's memory limit (the unit's
MemoryMax) like the daemon's own memory and its memory-backed emptyDirs. A limit below their sum
gets the sidecar OOM-killed once its incidents fill up, and a pod whose tmpfs pages stay charged
is killed again after each restart.

Each kustomization is rendered with `kubectl kustomize`; the settings are the ones the DaemonSet
gives the daemon (its ConfigMap's file, then its SIDECAR_* variables), loaded by the daemon's own
settings loader."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from sidecar.config import Settings, load_settings
from tests.support import ROOT

K8S = ROOT / "deploy" / "kubernetes"
BAREMETAL = ROOT / "deploy" / "baremetal"
KUBECTL = shutil.which("kubectl")
MIB = 1024 * 1024
# Host paths that are tmpfs on the distributions the guide covers (systemd mounts /run and /dev/shm).
TMPFS_HOST_PATHS = ("/run", "/var/run", "/dev/shm")

# The daemon's own memory, apart from its files: 72 MB resident with 2,000 ranks registered
# (docs/benchmarks.md, bench_metrics item 9; 49 MB on a busy 8-GPU node), plus the job view's reports when
# this node coordinates jobs up to job_view.max_ranks (about 2 KiB each, docs/configuration.md);
# twice that, for what the benchmarks did not see.
MEASURED_RSS = 80 * MIB
JOB_VIEW_REPORT = 2 * 1024


def daemon_allowance(settings: Settings) -> int:
    return 2 * (MEASURED_RSS + settings.job_view.max_ranks * JOB_VIEW_REPORT)


QUANTITY = re.compile(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?")
UNITS = {None: 1, "Ki": 1024, "Mi": MIB, "Gi": 1024 * MIB, "Ti": 1024**4, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity(text: str) -> int:
    """A Kubernetes memory quantity (or a systemd size: 1G is GiB there) in bytes."""
    m = QUANTITY.fullmatch(str(text))
    assert m, text
    return int(m[1]) * UNITS[m[2]]


def render(path: Path) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _covering(mounts: list[dict], path: str) -> dict | None:
    """The mount of the container that holds `path` (the deepest)."""
    holding = [m for m in mounts if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    return max(holding, key=lambda m: len(m["mountPath"]), default=None)


def _memory_backed(volume: dict) -> bool:
    if "emptyDir" in volume:
        return (volume["emptyDir"] or {}).get("medium") == "Memory"
    if "hostPath" in volume:
        path = volume["hostPath"]["path"]
        return any(path == p or path.startswith(p + "/") for p in TMPFS_HOST_PATHS)
    return False


def kubernetes_budget(docs: list[dict], workdir: Path) -> tuple[int, dict[str, int]]:
    """The sidecar container's memory limit, and what counts against it by name (bytes)."""
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "sidecar"]
    pod = ds["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "sidecar"]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "sidecar-config"]
    config = workdir / "sidecar.yaml"
    config.write_text(configmap["data"]["sidecar.yaml"])
    env = {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}
    env = {k: v for k, v in env.items() if k.startswith("SIDECAR_") and "$(" not in v}  # $(POD_IP): no budget
    settings = load_settings(str(config), environ=env)
    volumes = {v["name"]: v for v in pod["volumes"]}
    counted: dict[str, int] = {"the daemon itself": daemon_allowance(settings)}
    mount = _covering(container["volumeMounts"], str(settings.diagnostics_dir))
    assert mount is not None, f"diag_dir {settings.diagnostics_dir} is on no volume"
    if _memory_backed(volumes[mount["name"]]):
        counted[f"incident_retention_megabytes ({settings.diagnostics_dir} on tmpfs)"] = int(
            settings.incident_retention_megabytes * MIB
        )
    for m in container["volumeMounts"]:
        volume = volumes[m["name"]]
        if "emptyDir" in volume and _memory_backed(volume):
            size = (volume["emptyDir"] or {}).get("sizeLimit")
            assert size, f"memory-backed emptyDir {m['name']} without a sizeLimit"
            counted[f"emptyDir {m['name']} (medium Memory)"] = quantity(size)
    return quantity(container["resources"]["limits"]["memory"]), counted


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed")
@pytest.mark.parametrize("kustomization", ["", "overlays/kube-prometheus-stack", "overlays/gpu-operator"])
def test_the_daemonsets_memory_limit_exceeds_the_caps_that_count_against_it(kustomization, tmp_path):
    limit, counted = kubernetes_budget(render(K8S / kustomization), tmp_path)
    assert any(k.startswith("incident_retention_megabytes") for k in counted), counted  # diag_dir is on tmpfs
    assert limit > sum(counted.values()), (
        f"memory limit {limit // MIB} MiB <= {sum(counted.values()) // MIB} MiB: "
        + ", ".join(f"{k} {v // MIB} MiB" for k, v in counted.items())
    )


def _unit_memory_max(path: Path) -> int:
    (value,) = [line.split("=", 1)[1] for line in path.read_text().splitlines() if line.startswith("MemoryMax=")]
    return quantity(value.replace("G", "Gi").replace("M", "Mi"))


def test_the_systemd_units_memory_max_exceeds_the_caps_that_count_against_it():
    env = {}
    for line in (BAREMETAL / "sidecar.env.example").read_text().splitlines():
        if line.startswith("SIDECAR_") and "=" in line:
            key, value = line.split("=", 1)
            env[key] = value
    env.pop("SIDECAR_CONFIG", None)
    settings = load_settings(environ=env)
    unit = (BAREMETAL / "sidecar.service").read_text()
    assert "RuntimeDirectory=sidecar" in unit  # /run/sidecar: a tmpfs, where diag_dir defaults to
    assert str(settings.diagnostics_dir).startswith("/run/")
    counted = settings.incident_retention_megabytes * MIB + daemon_allowance(settings)
    assert _unit_memory_max(BAREMETAL / "sidecar.service") > counted
