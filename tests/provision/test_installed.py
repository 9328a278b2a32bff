"""The installed package works without the repository: wheels built from this tree, installed
into fresh virtual environments in a temporary directory, run from there.

- `training-sidecar`: `sidecar provision` (against the Grafana stand-in), `sidecar provision
  --write-files DIR` and `sidecar deploy-gen --write DIR` find the dashboards, rules and deploy
  files in the package. To stay fast and offline, its venv sees the dependencies of the
  shared environment through a path file, but the project's own code comes from the wheel
  (checked by `sidecar.__file__`).
- `training-sidecar-hooks`: the hooks alone in a venv without any third-party package; a rank
  there registers and pushes to a real sidecar.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

from sidecar.testing.fake_grafana import FakeGrafana
from tests.support import ROOT, Sidecar, wait_until

# Slow: two wheels and two virtual environments built, about 25 s of work before the first test.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("installed-wheels")]
TIMEOUT = 300
PARTS = (
    "pyproject.toml",
    "README.md",
    "sidecar",
    "trainer_hooks",
    "sidecar_trainer",
    "alerts",
    "dashboards",
    "deploy",
    "packaging",
)
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)


def _run(cmd: list[str], cwd: Path, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("SIDECAR_")
    }
    out = subprocess.run(cmd, cwd=cwd, env={**clean, **(env or {})}, capture_output=True, text=True, timeout=TIMEOUT)
    if check:
        assert out.returncode == 0, f"{cmd}: {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """Both wheels, built from a copy of the tree (the build leaves nothing in the checkout)."""
    work = tmp_path_factory.mktemp("build")
    src = work / "src"
    src.mkdir()
    for part in PARTS:
        path = ROOT / part
        if path.is_dir():
            shutil.copytree(path, src / part, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / part)
    dist = work / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(dist),
            ".",
            "packaging/hooks",
        ],
        cwd=src,
    )
    found = {p.name.split("-")[0]: p for p in dist.glob("*.whl")}
    assert set(found) == {"training_sidecar", "training_sidecar_hooks"}, found
    return found


def _venv(where: Path, see_shared_deps: bool) -> Path:
    _run([BASE_PYTHON, "-m", "venv", str(where)], cwd=where.parent)
    python = where / "bin" / "python"
    if see_shared_deps:
        # A plain path (no `import` line): the shared site-packages' own .pth files, among them
        # the editable install of the checkout, are not run, so `sidecar` can only come from the wheel.
        site = Path(
            _run(
                [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=where
            ).stdout.strip()
        )
        (site / "shared-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_the_wheel_installs_only_top_level_packages_named_after_the_project(wheels):
    # A generic name (`trainer`) would shadow, or be shadowed by, a package of the user's own.
    with zipfile.ZipFile(wheels["training_sidecar"]) as wheel:
        top = {name.split("/")[0] for name in wheel.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"sidecar", "sidecar_trainer", "trainer_hooks"}, top


@pytest.fixture(scope="module")
def installed(wheels, tmp_path_factory) -> Path:
    """A venv with the training-sidecar wheel; returns its bin/ directory."""
    venv = tmp_path_factory.mktemp("installed") / "venv"
    python = _venv(venv, see_shared_deps=True)
    _run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheels["training_sidecar"])],
        cwd=venv.parent,
    )
    where = _run(
        [str(python), "-c", "import sidecar, trainer_hooks; print(sidecar.__file__); print(trainer_hooks.__file__)"],
        cwd=venv.parent,
    ).stdout.split()
    assert all(Path(w).is_relative_to(venv) for w in where), where
    return venv / "bin"


def test_deploy_gen_writes_the_whole_tree_from_the_installed_package(installed, tmp_path):
    out = tmp_path / "deploy"
    _run([str(installed / "sidecar"), "deploy-gen", "--write", str(out)], cwd=tmp_path)
    assert (out / "kubernetes" / "base" / "generated" / "prometheusrule-gpu.yaml").is_file()
    assert (out / "kubernetes" / "base" / "generated" / "gpu-source-dcgm" / "kustomization.yaml").is_file()
    assert (out / "alertmanager" / "alertmanager.yml").is_file()
    assert (out / "baremetal" / "sidecar.service").is_file()
    for name in ("kubernetes", "kubernetes/overlays/gpu-operator"):
        if shutil.which("kubectl"):
            rendered = _run(["kubectl", "kustomize", str(out / name)], cwd=tmp_path).stdout
            assert "kind: DaemonSet" in rendered and "kind: PrometheusRule" in rendered
    # The files are the checkout's.
    for rel in ("kubernetes/base/daemonset.yaml", "kubernetes/base/generated/dashboard-training-job.yaml"):
        assert (out / rel).read_text() == (ROOT / "deploy" / rel).read_text(), rel
    # Twice is fine (an operator regenerates into the same directory).
    _run([str(installed / "sidecar"), "deploy-gen", "--write", str(out)], cwd=tmp_path)


def test_provision_write_files_from_the_installed_package(installed, tmp_path):
    out = tmp_path / "files"
    _run([str(installed / "sidecar"), "provision", "--write-files", str(out), "--gpu-source", "dcgm"], cwd=tmp_path)
    dashboards = sorted(p.name for p in (out / "grafana" / "dashboards").glob("*.json"))
    assert len(dashboards) == len(list((ROOT / "dashboards").glob("*.json")))
    rules = yaml.safe_load((out / "prometheus" / "training-sidecar.rules.yml").read_text())
    names = [g["name"] for g in rules["groups"]]
    assert names[0] == "sidecar-gpu-source-dcgm" and "sidecar-gpu" in names
    assert "sidecar-gpu-source-sidecar" not in names


def test_provision_pushes_to_grafana_from_the_installed_package(installed, tmp_path):
    with FakeGrafana(token="glsa_installed") as grafana:
        out = _run(
            [str(installed / "sidecar"), "provision", "--datasource-url", "http://prometheus:9090"],
            cwd=tmp_path,
            env={"GRAFANA_URL": grafana.url, "GRAFANA_TOKEN": "glsa_installed"},
        )
        state = grafana.state
        assert {json.loads(p.read_text())["uid"] for p in (ROOT / "dashboards").glob("*.json")} == set(state.dashboards)
        assert not state.alert_rules and "sidecar-prometheus" in state.datasources
    assert "done:" in out.stdout


HOOKS_RANK = """
import sys, time
import trainer_hooks
from trainer_hooks import Monitor
for name in ("aiohttp", "pynvml", "grafana_client", "rich", "prometheus_client", "psutil", "yaml", "sidecar"):
    try:
        __import__(name)
    except ImportError:
        continue
    sys.exit(f"{name} is importable in the hooks-only venv")
print(trainer_hooks.__file__, flush=True)
mon = Monitor(job_id="hooks-only", rank=0, world_size=1, flush_interval=0.2)
for step in range(1, 6):
    mon.step(step, loss=1.5)
    time.sleep(0.1)
mon.close()
"""


def test_the_hooks_install_alone_and_push_to_a_real_sidecar(wheels, tmp_path):
    venv = tmp_path / "hooks-venv"
    python = _venv(venv, see_shared_deps=False)
    _run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheels["training_sidecar_hooks"])],
        cwd=tmp_path,
    )
    listed = _run([str(python), "-m", "pip", "list", "--format=json"], cwd=tmp_path).stdout
    assert {p["name"] for p in json.loads(listed)} <= {"pip", "setuptools", "training-sidecar-hooks"}
    with Sidecar(tmp_path / "daemon", "collectors.enabled=[]") as sidecar:
        out = _run([str(python), "-c", HOOKS_RANK], cwd=tmp_path, env=sidecar.hook_env())
        assert Path(out.stdout.strip()).is_relative_to(venv)
        wait_until(
            lambda: "sidecar_training_step{" in sidecar.metrics() and 'job_id="hooks-only"' in sidecar.metrics(),
            30,
            what="the hooks-only rank's steps",
        )
        step = [
            line
            for line in sidecar.metrics().splitlines()
            if line.startswith("sidecar_training_step{") and 'job_id="hooks-only"' in line
        ]
    assert step and step[0].endswith(" 5.0"), step
