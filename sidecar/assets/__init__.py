"""The generated files the commands ship: dashboards, recording and alerting rules, the
Alertmanager example and the deploy files, as package data.

One copy exists: in a checkout, `sidecar/assets/{alerts,dashboards,deploy}` are symbolic links to
the top-level `alerts/`, `dashboards/` and `deploy/` directories that the generators write
(`python -m alerts.build`, `python -m dashboards.build`, `sidecar deploy-gen --write`); a wheel
built from the checkout carries their files here, so an installed `sidecar` provisions and
generates without the repository.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).parent  # not resolved: paths below it name the package location
ALERTS = ROOT / "alerts"
DASHBOARDS = ROOT / "dashboards"
DEPLOY = ROOT / "deploy"
