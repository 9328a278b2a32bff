"""The monitoring mixin: the generators of the Prometheus rules and Grafana dashboards, and the one
settings object they read (the shape of kubernetes-mixin's `_config`).

`config.py` holds `MixinConfig` (thresholds, selectors, the runbook URL, the cluster label, the
dashboards' settings) with its defaults, loaded from a YAML or JSON file that overrides any subset
of them. `rules.py` renders the rule files from it (one module per rule group: `rules_*.py`, their
PromQL helpers in `promql.py`, the GPU sources in `gpu_source.py`); `dashboards.py` renders the
dashboards (one module per dashboard: `dash_*.py`, their panels in `panels.py`). The generated
files in a checkout (`alerts/`, `dashboards/`) are these renderings with the defaults
(`python -m alerts.build`, `python -m dashboards.build`); `sidecar deploy-gen --config FILE` renders
them, and the deploy tree, with an operator's settings from an installed package. `scale.py` renders
the cluster-scale stack (deploy/scale/: sharded scrapers, the store, the global ruler), with the
rules split by `shards.py` into the global ruler's and the per-node ones.

May import: collectors (the XID catalogue) and the top-level modules; never the commands or the
daemon (the commands import it).
"""
