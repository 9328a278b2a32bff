"""docs/metrics.md is generated from the code and must stay current; the collectors define
every metric name the architecture contract promises."""

from __future__ import annotations

import importlib
import re

from sidecar.daemon import metrics_doc as docs
from tests.support import ROOT

HARDWARE = re.compile(r"`(sidecar_(?:gpu|network|infiniband|process|node|checkpoint|versions)_[a-z0-9_]*)")


def test_docs_metrics_md_is_current():
    path = ROOT / "docs" / "metrics.md"
    current = path.read_text() if path.exists() else ""
    assert current == docs.reference_markdown(), f"docs/metrics.md is stale: regenerate it with `{docs.REGENERATE}`"


def test_every_hardware_metric_of_the_contract_is_defined():
    contract = set(HARDWARE.findall((ROOT / "docs" / "architecture" / "metric-names.md").read_text()))
    defined = {s.exposed_name for s in docs.all_specs()}
    assert contract and contract <= defined, sorted(contract - defined)


def test_every_metric_has_help_and_the_prefix():
    for s in docs.all_specs():
        assert s.exposed_name.startswith("sidecar_") and s.help.strip(), s


def test_the_reference_lists_each_metric_with_its_labels():
    text = docs.reference_markdown()
    assert "| `sidecar_gpu_xid_errors_total` | counter | `gpu`, `xid` |" in text
    assert "| `sidecar_versions_info` | info |" in text


def test_the_command_writes_the_reference(tmp_path):
    import argparse

    out = tmp_path / "metrics.md"
    assert docs.main(argparse.Namespace(write=str(out))) == 0
    assert out.read_text() == docs.reference_markdown()


def test_every_module_that_defines_metrics_is_in_the_reference():
    defining = set()
    for path in (ROOT / "sidecar").rglob("*.py"):
        if re.search(r"^(RUNNER_)?METRICS\b.*=", path.read_text(), re.MULTILINE):
            defining.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    modules = docs.modules()
    listed = {m.__name__ for m in modules}
    # a module may keep its families apart (gpu_metrics.py for gpu.py): covered when a listed one exports them
    exported = {id(getattr(m, key, None)) for m in modules for key in ("METRICS", "RUNNER_METRICS")}

    def covered(name: str) -> bool:
        module = importlib.import_module(name)
        return name in listed or any(id(getattr(module, k, None)) in exported for k in ("METRICS", "RUNNER_METRICS"))

    missing = sorted(name for name in defining if not covered(name))
    assert defining and not missing, missing


def test_every_catalogued_collector_module_exists_and_defines_its_metrics():
    from sidecar.config import COLLECTORS

    for name, module in COLLECTORS.items():
        imported = __import__(module, fromlist=["NAME"])
        assert imported.NAME == name and imported.METRICS and callable(imported.build), module
