"""bench/bench_scale.py in its quick mode: the cluster-scale stack (vmagent shards, victoria-metrics,
vmalert) stores every simulated node's series, every rule evaluates, and the report has its figures."""

from __future__ import annotations

import subprocess

import pytest

from tests.support import PYTHON, ROOT

pytestmark = [pytest.mark.slow, pytest.mark.system]


def test_the_quick_scale_bench_stores_every_node_and_reports_its_figures():
    out = subprocess.run(
        [PYTHON, "-m", "bench.bench_scale", "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for figure in ("samples/s", "B/sample", "store RSS", "sidecar-training-global", "extrapolated to 2,000 nodes"):
        assert figure in out.stdout, figure
    assert "every node's series stored, every rule evaluated: PASS" in out.stdout


def test_the_scale_bench_refuses_a_bad_node_count():
    out = subprocess.run(
        [PYTHON, "-m", "bench.bench_scale", "--nodes", "ten"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "--nodes: expected node counts" in out.stderr, out.stderr
