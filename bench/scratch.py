"""A benchmark's scratch directory: made under the system's temporary directory, removed after its
runs, or kept (and its path printed) when the user asked with --keep."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def make(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


def leave(root: Path, keep: bool) -> None:
    if keep:
        print(f"kept {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
