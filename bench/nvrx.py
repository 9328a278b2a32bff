"""NVIDIA's resiliency extension (nvidia-resiliency-ext, `ft_launcher`) for the benchmarks that race
it: installed on first use into build/nvrx (ignored by git), never into the project's venv.

It is not a dependency of this project: its wheel requires pynvml and nvidia-ml-py versions of its
own, so it goes in with `pip install --no-deps --target`, next to the one module it needs that the
venv lacks (defusedxml); torch, psutil, PyYAML and nvidia-ml-py come from the venv. A directory of
your own: FT_LAUNCHER_PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION = "0.4.1"  # the release the figures in docs/benchmarks.md were measured with
TARGET = ROOT / "build" / "nvrx"
MODULE = "nvidia_resiliency_ext.fault_tolerance.launcher"  # ft_launcher's entry point, run with -m


def _installed(path: Path) -> bool:
    return (path / "nvidia_resiliency_ext" / "fault_tolerance" / "launcher.py").is_file() and (
        path / "defusedxml"
    ).is_dir()


def ensure() -> str | None:
    """The directory to put on PYTHONPATH for ft_launcher and its workers, installing it there if
    needed (progress on stdout); None, with the reason printed, when it cannot be had."""
    own = os.environ.get("FT_LAUNCHER_PYTHONPATH")
    if own:
        found = importlib.util.find_spec("nvidia_resiliency_ext") is not None
        if not found and not Path(own, "nvidia_resiliency_ext").is_dir():
            print(f"ft_launcher: FT_LAUNCHER_PYTHONPATH={own} holds no nvidia_resiliency_ext")
            return None
        return own
    if _installed(TARGET):
        return str(TARGET)
    print(f"ft_launcher: installing nvidia-resiliency-ext=={VERSION} into {TARGET} (once)...", flush=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--target", str(TARGET), f"nvidia-resiliency-ext=={VERSION}", "defusedxml"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not _installed(TARGET):
        print(f"ft_launcher: could not install it (pip exit {done.returncode}): {done.stderr.strip()[-500:]}")
        return None
    return str(TARGET)
