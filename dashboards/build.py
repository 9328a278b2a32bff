"""Write the Grafana dashboards of a checkout: `python -m dashboards.build` renders
`dashboards/*.json` with the default settings; a test fails when the files are not current.

The generators live in the installed package (`sidecar/mixin/`: one module per dashboard,
`panels.py`, the settings in `config.py`), so that an installed `sidecar deploy-gen --config FILE`
renders them with an operator's own settings (docs/operator-guide.md). Thresholds drawn on panels
are the alerts' own (`python -m alerts.build`), from the same settings.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sidecar.commands import generated
from sidecar.mixin import dashboards

HERE = Path(__file__).resolve().parent
DASHBOARDS = dashboards.DASHBOARDS


def rendered_files() -> dict[str, str]:
    return dashboards.rendered_files()


def write(out_dir: Path = HERE) -> list[Path]:
    """Write the dashboards that differ into out_dir; the paths written."""
    return generated.write(out_dir, rendered_files())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dashboards.build", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE, help="directory for the JSON files (default: dashboards/)")
    args = p.parse_args(argv)
    for path in write(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
