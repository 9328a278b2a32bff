"""Refuse a kustomization that still names the placeholder image: `python scripts/check_image.py
deploy/kubernetes/overlays/kube-prometheus-stack` renders it with `kubectl kustomize` and exits 1,
naming each workload and `make image`, when a container's image is MAKE-IMAGE-REGISTRY/... (the
images no one can pull until `make image REGISTRY=...` has built and pushed them); 0 otherwise."""

from __future__ import annotations

import subprocess
import sys

import yaml

PLACEHOLDER = "MAKE-IMAGE-REGISTRY/"
WORKLOADS = ("DaemonSet", "Deployment", "StatefulSet", "Job", "Pod")


def placeholder_images(docs: list[dict]) -> list[str]:
    """'Kind/name: image' for every container that names the placeholder."""
    found = []
    for d in docs:
        if d.get("kind") not in WORKLOADS:
            continue
        pod = d["spec"] if d["kind"] == "Pod" else d["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            if c.get("image", "").startswith(PLACEHOLDER):
                found.append(f"{d['kind']}/{d['metadata']['name']}: {c['image']}")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: check_image.py KUSTOMIZATION_DIR", file=sys.stderr)
        return 2
    out = subprocess.run(["kubectl", "kustomize", argv[0]], capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr, end="")
        return out.returncode
    found = placeholder_images([d for d in yaml.safe_load_all(out.stdout) if d])
    for line in found:
        print(
            f"{argv[0]}: {line} is the placeholder: build and push yours with `make image REGISTRY=...`"
            " and set the line it prints in the kustomization's images:",
            file=sys.stderr,
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
