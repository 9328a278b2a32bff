"""Files generated from code and kept in the repository (deploy manifests, rule files,
dashboards, reference documents): write only what changed, tell which are stale, or print.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path


def stale(out_dir: Path, files: Mapping[str, str], leftovers: str | None = None) -> list[str]:
    """Sorted names of `files` missing from `out_dir` or different there, plus the files matching
    the glob `leftovers` that `files` no longer has (a removed source)."""
    out = {
        name for name, text in files.items() if not (out_dir / name).is_file() or (out_dir / name).read_text() != text
    }
    if leftovers and out_dir.is_dir():
        out |= {p.name for p in out_dir.glob(leftovers)} - set(files)
    return sorted(out)


def write(out_dir: Path, files: Mapping[str, str], leftovers: str | None = None) -> list[Path]:
    """Bring `out_dir` up to date with `files` (name -> text), deleting stale `leftovers`;
    untouched files keep their modification time. Returns the paths changed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    changed = stale(out_dir, files, leftovers)
    for name in changed:
        if name in files:
            (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (out_dir / name).write_text(files[name])
        else:
            (out_dir / name).unlink()
    return [out_dir / name for name in changed]


def add_write_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--write", metavar="PATH", help="write the reference to PATH instead of stdout")


def write_or_print(text: str, path: str | None) -> int:
    """The reference commands' output: to `path` with --write, else to stdout. Exit status 0."""
    if path:
        Path(path).write_text(text)
    else:
        print(text, end="")
    return 0
