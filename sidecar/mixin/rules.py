"""The Prometheus rule files, rendered from a `MixinConfig`: the recording rules, the alert groups
(one module each: `rules_*.py`) and the two GPU sources (`gpu_source.py`, docs/dcgm.md).

`rendered_files(cfg)` is every rule file by name (`training.rules.yml`, ...), `source_files(cfg)`
the GPU sources by their name under alerts/ (`gpu-source/dcgm.rules.yml`); `sidecar provision`
and `sidecar deploy-gen` read the files, so Prometheus, Grafana and the dashboards follow the
same numbers.
"""

from __future__ import annotations

from sidecar.mixin import (
    gpu_source,
    rules_gpu,
    rules_network,
    rules_overlap,
    rules_recording,
    rules_self,
    rules_training,
)
from sidecar.mixin.config import DEFAULT, MixinConfig
from sidecar.mixin.promql import CONFIGURED_HEADER, HEADER, Alert, Group, Record, render


def files(cfg: MixinConfig = DEFAULT) -> dict[str, list[Group]]:
    """File stem -> the groups of that rule file."""
    return {
        "recording": [rules_recording.group(cfg)],
        "training": [rules_training.group(cfg)],
        "gpu": [rules_gpu.group(cfg)],
        "network": [rules_network.group(cfg)],
        "self": [rules_self.group(cfg)],
        "overlap": [rules_overlap.group(cfg)],
    }


def sources() -> dict[str, Group]:
    """The GPU source a cluster loads, one of the two (docs/dcgm.md): alerts/gpu-source/<source>.rules.yml."""
    return {
        "sidecar": Group("sidecar-gpu-source-sidecar", [Record(r, e) for r, e in gpu_source.sidecar_source()]),
        "dcgm": Group("sidecar-gpu-source-dcgm", [Record(r, e, labels) for r, e, labels in gpu_source.dcgm_source()]),
    }


def _header(cfg: MixinConfig) -> str:
    """The checkout's header for the defaults (`python -m alerts.build` writes them), another for an
    operator's settings."""
    return HEADER if cfg == DEFAULT else CONFIGURED_HEADER


def all_alerts(cfg: MixinConfig = DEFAULT) -> list[Alert]:
    return [r for groups in files(cfg).values() for g in groups for r in g.rules if isinstance(r, Alert)]


def all_records(cfg: MixinConfig = DEFAULT) -> list[Record]:
    return [r for groups in files(cfg).values() for g in groups for r in g.rules if isinstance(r, Record)]


def rendered_files(
    cfg: MixinConfig = DEFAULT, for_override: str | None = None, header: str | None = None
) -> dict[str, str]:
    """File name -> content of every rule file (`header` first: by default the one `cfg` calls for)."""
    header = header or _header(cfg)
    return {
        f"{stem}.rules.yml": render(groups, cfg.runbook_base_url, for_override, cfg.cluster_label, header)
        for stem, groups in files(cfg).items()
    }


def source_files(cfg: MixinConfig = DEFAULT) -> dict[str, str]:
    """Name under alerts/ -> content of each GPU source's recording rules."""
    return {
        f"gpu-source/{name}.rules.yml": render(
            [group], cfg.runbook_base_url, cluster_label=cfg.cluster_label, header=_header(cfg)
        )
        for name, group in sources().items()
    }
