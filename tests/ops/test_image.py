"""The sidecar image installs what `make lock` pinned: deploy/container/requirements.lock holds
every runtime dependency of pyproject.toml (its `dependencies`, the `stacks` extra the image adds
and the build backend) at one version with its hashes, and the Dockerfile installs from it with --require-hashes.
No network: a lock whose direct dependencies differ from pyproject's, or whose pin no longer
meets pyproject's specifier, is stale (`make lock` regenerates it)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import ROOT

LOCK = ROOT / "deploy" / "container" / "requirements.lock"
DOCKERFILE = ROOT / "deploy" / "container" / "Dockerfile"
# The extras the sidecar image installs besides the dependencies (py-spy: native stacks).
IMAGE_EXTRAS = ("stacks",)


def image_requirements(pyproject: Path) -> list[Requirement]:
    """The runtime dependencies, the image's extras and the build backend (installed from the lock
    too: the package itself installs with --no-build-isolation)."""
    doc = tomllib.loads(pyproject.read_text())
    project = doc["project"]
    reqs = list(project["dependencies"]) + list(doc["build-system"]["requires"])
    for extra in IMAGE_EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def parse_lock(text: str) -> dict[str, tuple[str, list[str], list[str]]]:
    """name -> (version, hashes, what it is there for)."""
    out: dict[str, tuple[str, list[str], list[str]]] = {}
    for block in re.split(r"\n(?=\S)", text):
        m = re.match(r"([A-Za-z0-9._-]+)==(\S+)", block)
        if not m:
            continue
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", block)
        via = re.findall(r"#\s+(?:via\s+)?(\S.*)", block)
        out[canonicalize_name(m[1])] = (m[2], hashes, [v.strip() for v in via])
    return out


def stale(pyproject: Path, lock: Path) -> list[str]:
    """What makes the lock stale against pyproject.toml's runtime dependencies (empty: current)."""
    pinned = parse_lock(lock.read_text())
    wanted = {canonicalize_name(r.name): r for r in image_requirements(pyproject)}
    problems = []
    for name, req in wanted.items():
        if name not in pinned:
            problems.append(f"{req.name} is not in the lock")
            continue
        version, hashes, _ = pinned[name]
        if not hashes:
            problems.append(f"{req.name}=={version} has no hash")
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name}=={version} does not meet {req}")
    direct = {n for n, (_, _, via) in pinned.items() if any(v.startswith("training-sidecar") for v in via)}
    problems += [f"{n} is no dependency of pyproject.toml any more" for n in sorted(direct - wanted.keys())]
    return problems


def test_every_runtime_dependency_is_pinned_with_hashes_in_the_lock():
    pinned = parse_lock(LOCK.read_text())
    assert pinned and all(hashes for _, hashes, _ in pinned.values())
    assert stale(ROOT / "pyproject.toml", LOCK) == []


@pytest.mark.parametrize("target", ["sidecar", "trainer"])
def test_each_image_installs_from_the_lock_with_hashes_and_the_package_without_deps(target):
    text = DOCKERFILE.read_text()
    stage = text.split(f"AS {target}\n", 1)[1].split("\nFROM ", 1)[0]
    stage = "\n".join(line for line in stage.splitlines() if not line.lstrip().startswith("#"))
    installs = [re.sub(r"\s+", " ", line) for line in re.findall(r"pip install[^\n]*(?:\\\n[^\n]*)*", stage)]
    lock = "-r /src/deploy/container/requirements.lock"
    assert any("--require-hashes" in i and lock in i for i in installs), installs
    # Everything else pip installs in the image comes without dependencies: nothing unpinned.
    assert all("--require-hashes" in i or "--no-deps" in i for i in installs), installs


def test_a_changed_dependency_makes_the_lock_stale(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    text = (ROOT / "pyproject.toml").read_text()
    pyproject.write_text(text.replace('"rich>=13.0",', '"rich>=99",\n  "requests>=2",', 1))
    assert stale(pyproject, LOCK) == ["rich==15.0.0 does not meet rich>=99", "requests is not in the lock"]
    pyproject.write_text(text.replace('"rich>=13.0",', "", 1))
    assert stale(pyproject, LOCK) == ["rich is no dependency of pyproject.toml any more"]


# ---------------------------------------------------------------- the image the kustomizations name

K8S = ROOT / "deploy" / "kubernetes"
KUBECTL = shutil.which("kubectl")
CHECK = ROOT / "scripts" / "check_image.py"


def check(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), str(path)], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed")
@pytest.mark.parametrize("kustomization", ["", "base", "overlays/kube-prometheus-stack", "overlays/gpu-operator"])
def test_a_render_with_the_placeholder_image_is_refused_naming_make_image(kustomization):
    out = check(K8S / kustomization)
    assert out.returncode == 1, out.stderr
    assert "DaemonSet/sidecar: MAKE-IMAGE-REGISTRY/training-sidecar:0.1.0" in out.stderr
    assert "make image REGISTRY=" in out.stderr


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed")
def test_an_overlay_that_sets_the_image_renders_and_passes(tmp_path):
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    overlay = tree / "overlays" / "kube-prometheus-stack"
    path = overlay / "kustomization.yaml"
    doc = yaml.safe_load(path.read_text())
    for image in doc["images"]:  # what `make image REGISTRY=registry.example/ml` tells you to set
        image["newName"] = image["name"].replace("MAKE-IMAGE-REGISTRY", "registry.example/ml")
    path.write_text(yaml.safe_dump(doc))
    out = check(overlay)
    assert out.returncode == 0, out.stderr


def test_the_placeholder_is_no_reference_a_kubelet_would_pull():
    # Docker's reference grammar: path components are lowercase, so the kubelet stops the pod with
    # InvalidImageName instead of pulling from somewhere.
    name = "MAKE-IMAGE-REGISTRY/training-sidecar"
    assert not re.fullmatch(r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*", name)
    assert "." not in name.split("/")[0] and ":" not in name.split("/")[0]  # not read as a registry host


def test_make_image_builds_and_pushes_every_image_the_kustomizations_name():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nimage:", 1)[1].split("\n\n", 1)[0]
    for target, name in (("sidecar", "training-sidecar"), ("node-problem-detector", "training-sidecar-npd")):
        assert f"--target {target} -t $(REGISTRY)/{name}:$(TAG)" in recipe
        assert f"docker push $(REGISTRY)/{name}:$(TAG)" in recipe
    assert "kustomize edit set image MAKE-IMAGE-REGISTRY/training-sidecar=$(REGISTRY)/training-sidecar:$(TAG)" in recipe
