"""Prometheus rules: `alerts/build.py` is the source, `*.rules.yml` are generated."""
