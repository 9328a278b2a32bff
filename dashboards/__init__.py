"""Grafana dashboards: `dashboards/build.py` is the source, `*.json` are generated."""
