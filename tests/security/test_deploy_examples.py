"""The training-pod examples run without `hostPID` (the sidecar maps pod pids to host pids),
and keep the one thing the socket needs: the /run/sidecar hostPath, read-only, with only the
sidecar's diag_dir inside it writable (tests/security/test_socket_mount.py mounts them for real)."""

from __future__ import annotations

import pytest
import yaml

from tests.support import ROOT

EXAMPLES = ROOT / "deploy" / "kubernetes" / "examples"


def _pod_specs(node):
    if isinstance(node, dict):
        if "containers" in node:
            yield node
        for value in node.values():
            yield from _pod_specs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _pod_specs(value)


@pytest.mark.parametrize("name", ["pytorchjob.yaml", "jobset.yaml", "trainjob.yaml"])
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
