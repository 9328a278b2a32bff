"""The Grafana dashboards, rendered from a `MixinConfig`: one module per dashboard (`dash_*.py`),
their building blocks in `panels.py`."""

from __future__ import annotations

import json
from collections.abc import Callable

from sidecar.mixin.config import DEFAULT, MixinConfig
from sidecar.mixin.dash_node_hardware import node_hardware
from sidecar.mixin.dash_rank_drilldown import rank_drilldown
from sidecar.mixin.dash_training_job import training_job

DASHBOARDS: dict[str, Callable[[MixinConfig], dict]] = {
    "training-job.json": training_job,
    "node-hardware.json": node_hardware,
    "rank-drilldown.json": rank_drilldown,
}


def rendered_files(cfg: MixinConfig = DEFAULT) -> dict[str, str]:
    """File name -> JSON of every dashboard."""
    return {name: json.dumps(make(cfg), indent=2) + "\n" for name, make in DASHBOARDS.items()}
