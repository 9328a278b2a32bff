"""Write the Prometheus rules of a checkout: `python -m alerts.build` renders `alerts/*.rules.yml`
with the default settings; a test fails when the files are not current.

The generators live in the installed package (`sidecar/mixin/`: the settings in `config.py`, one
module per rule group, `rules.py`), so that an installed `sidecar deploy-gen --config FILE`
renders them with an operator's own thresholds and selectors (docs/operator-guide.md). Change a
default there, then regenerate. `sidecar provision` reads the generated files (with `--alerts
grafana` it converts the alerts to Grafana-managed rules), so Prometheus, Grafana and the
dashboards all follow the same numbers. The names below are the defaults' rendering, for the tests.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from sidecar.commands import generated
from sidecar.mixin import config, rules
from sidecar.mixin.promql import HEADER, Alert, Group, Record, counted, increased, render  # noqa: F401 (the tests' names)

HERE = Path(__file__).resolve().parent
RUNBOOK_BASE_URL = config.RUNBOOK_BASE_URL
SELECTORS: Mapping[str, str] = config.DEFAULT.selectors
THRESHOLDS: Mapping[str, float | str] = config.DEFAULT.thresholds
window, number = config.DEFAULT.window, config.DEFAULT.number

FILES: dict[str, list[Group]] = rules.files()
RECORDING, TRAINING, GPU, NETWORK, SELF, OVERLAP = (FILES[s][0] for s in FILES)
SOURCES: dict[str, Group] = rules.sources()
all_alerts, all_records, source_files = rules.all_alerts, rules.all_records, rules.source_files


def settings(
    runbook_base_url: str = RUNBOOK_BASE_URL, selectors: Mapping[str, str] | None = None
) -> config.MixinConfig:
    """The default settings with these two changed."""
    unknown = sorted(set(selectors or {}) - set(SELECTORS))
    if unknown:
        raise ValueError(f"unknown selector {', '.join(unknown)} (known: {', '.join(sorted(SELECTORS))})")
    return replace(config.DEFAULT, runbook_base_url=runbook_base_url, selectors={**SELECTORS, **(selectors or {})})


def rendered_files(
    runbook_base_url: str = RUNBOOK_BASE_URL,
    for_override: str | None = None,
    selectors: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """File name -> content of every rule file."""
    return rules.rendered_files(settings(runbook_base_url, selectors), for_override, HEADER)


def write(
    out_dir: Path,
    runbook_base_url: str = RUNBOOK_BASE_URL,
    for_override: str | None = None,
    selectors: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write the rule files that differ into out_dir (the GPU sources into out_dir/gpu-source/);
    the paths written."""
    return generated.write(out_dir, rendered_files(runbook_base_url, for_override, selectors)) + generated.write(
        out_dir, source_files()
    )


def _selector(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or name not in SELECTORS or not value.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=SELECTOR with NAME one of {', '.join(sorted(SELECTORS))}")
    return name, value.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m alerts.build", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE, help="directory for the rule files (default: alerts/)")
    p.add_argument("--runbook-base-url", default=RUNBOOK_BASE_URL, help="URL of docs/runbook.md as published")
    p.add_argument(
        "--for",
        dest="for_override",
        metavar="DURATION",
        help="replace every alert's `for` (tests use a short one; never in production)",
    )
    p.add_argument(
        "--selector",
        action="append",
        type=_selector,
        default=[],
        metavar="NAME=SELECTOR",
        help="PromQL label matchers instead of a default of SELECTORS, e.g. "
        f"sidecar_targets='{SELECTORS['sidecar_targets']}' (the scrape job of the sidecars)",
    )
    args = p.parse_args(argv)
    if args.for_override is not None and not re.fullmatch(r"\d+(ms|s|m|h)", args.for_override):
        p.error(f"--for: expected a Prometheus duration like 5s, got {args.for_override!r}")
    for path in write(args.out, args.runbook_base_url, args.for_override, dict(args.selector)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
