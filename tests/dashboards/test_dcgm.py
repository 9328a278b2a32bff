"""The dcgm GPU source on the real stack: a dcgm-exporter page (tests/dashboards/fixtures/
dcgm-exporter.prom, names, labels and units as dcgm-exporter 3.x/4.x write them) served over
HTTP and a real sidecar with `collectors.gpu_source=dcgm` are scraped by a real Prometheus that
loads alerts/gpu-source/dcgm.rules.yml and the shipped rules. Every GPU panel of the dashboards
shows data, and every GPU alert fires on the fixture's unwell GPUs, through dcgm's series only."""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from pathlib import Path

import pytest
from aiohttp import web

from alerts import build as alerts_build
from sidecar.testing.fake_grafana import BackgroundServer
from tests.alerts.realstack import Prometheus
from tests.dashboards.panels import DASHBOARD_FILES, load, queries, substitute
from tests.ops.helpers import post, run_cli
from tests.support import Sidecar, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.system, pytest.mark.xdist_group("dcgm-stack")]

FIXTURE = Path(__file__).parent / "fixtures" / "dcgm-exporter.prom"
NODE = "gpu-node-1"  # the fixture's Hostname; the sidecar's target is relabelled to the same node name
POD = {"namespace": "team-a", "pod": "llm-worker-0", "container": "pytorch"}  # GPU 0's pod in the fixture
# Counters that grow while the test runs (per second), on the fixture's GPU 0: errors the alerts count.
GROWING = {
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": 0.5,
    "DCGM_FI_DEV_THERMAL_VIOLATION": 2e8,
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": 500.0,
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 50.0,
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 600000.0,
}
# What dcgm-exporter does not export at all: the panels that stay empty on this source (docs/dcgm.md).
NO_DCGM_COUNTERPART = {
    "NVLink links up": "gpu:sidecar_gpu_nvlink_up",
    "GPU fields NVML does not give": "gpu:sidecar_gpu_field_unavailable",
}
NO_DCGM_ALERT = {"SidecarGpuNvlinkDown"}
SHORT_FOR = "1s"


class DcgmExporter(BackgroundServer):
    """The fixture page at /metrics, its GROWING counters advancing with time on GPU 0."""

    def __init__(self) -> None:
        self.text = FIXTURE.read_text()
        self.started = time.monotonic()
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        super().__init__(app)

    async def _metrics(self, _request: web.Request) -> web.Response:
        elapsed = time.monotonic() - self.started

        def grow(m: re.Match) -> str:
            rate = GROWING.get(m.group(1))
            if rate is None or 'gpu="0"' not in m.group(2):
                return m.group(0)
            return f"{m.group(1)}{{{m.group(2)}}} {float(m.group(3)) + rate * elapsed}"

        text = re.sub(r"^(\w+)\{(.*)\} (\S+)$", grow, self.text, flags=re.M)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")


@contextlib.contextmanager
def dcgm_stack(workdir: Path):
    rules = workdir / "rules"
    alerts_build.write(rules, for_override=SHORT_FOR)
    with contextlib.ExitStack() as stack:
        exporter = DcgmExporter().start()
        stack.callback(exporter.stop)
        sidecar = stack.enter_context(
            Sidecar(workdir / "daemon", "collectors.gpu_source=dcgm", "collectors.enabled=[gpu,process,node]")
        )
        rank = subprocess.Popen(["sleep", "600"], start_new_session=True)
        stack.callback(lambda: (rank.kill(), rank.wait()))
        status, answer = post(
            sidecar.socket,
            "/v1/register",
            {"job_id": "j1", "rank": 0, "world_size": 1, "pid": rank.pid, "kubernetes": POD},
        )
        assert status == 200, answer
        status, answer = post(
            sidecar.socket,
            "/v1/push",
            {
                "job_id": "j1",
                "rank": 0,
                "pid": rank.pid,
                "items": [{"type": "step", "step": 1, "metrics": {"loss": 2.0, "step_time_seconds": 0.5}}],
            },
        )
        assert status == 200, answer
        node = [{"target_label": "instance", "replacement": NODE}]
        prom = stack.enter_context(
            Prometheus(
                workdir / "prom",
                rule_files=[rules / "gpu-source" / "dcgm.rules.yml", *sorted(rules.glob("*.rules.yml"))],
                scrape_configs=[
                    {
                        "job_name": "sidecar",
                        "static_configs": [{"targets": [f"127.0.0.1:{sidecar.port}"]}],
                        "relabel_configs": node,
                    },
                    {
                        "job_name": "gpu-metrics",
                        "static_configs": [{"targets": [exporter.url.removeprefix("http://")]}],
                    },
                ],
            ).running()
        )
        yield sidecar, prom


def _gpu_queries() -> list[tuple[str, str, str]]:
    out = []
    for path in DASHBOARD_FILES:
        d = load(path)
        panels = {p["title"]: p for p in d["panels"]}
        for where, expr in queries(d):
            if "gpu:" in expr or "sidecar_gpu_" in expr:
                title = next((t for t in panels if f"panel {t!r}" in where), "")
                out.append((where, title, expr))
    return out


def test_dcgm_mode_gpu_panels_and_alerts_work_from_dcgm_exporter_series(tmp_path):
    values = {
        "cluster": ".*",
        "namespace": ".*",
        "job_id": "j1",
        "instance": NODE,
        "rank": "0",
        "gpu": ".*",
        "datasource": "unused",
    }
    gpu_alerts = [a.name for a in alerts_build.GPU.rules]
    with dcgm_stack(tmp_path) as (sidecar, prom):
        # No NVML poller: the sidecar exports no GPU series of its own.
        assert "sidecar_gpu_" not in sidecar.metrics()
        status = sidecar.status()
        assert "gpu" not in status["collectors"] and "process" in status["collectors"]
        assert status["node"]["gpu_source"] == "dcgm" and status["gpus"] == []
        assert "read by dcgm-exporter" in run_cli("status", "--url", sidecar.url).stdout
        wait_until(
            lambda: (
                prom.series_count("gpu:sidecar_gpu_process_memory_bytes") > 0
                and prom.series_count("job_id_instance:sidecar_gpu_utilization_ratio:avg") > 0
            ),
            90,
            interval=1,
            what="recorded GPU series from dcgm-exporter",
        )
        time.sleep(3)  # a few samples for the rate() panels
        empty = []
        for where, title, expr in _gpu_queries():
            answer = prom.query(substitute(expr, values))
            assert answer["status"] == "success", f"{where}: {answer.get('error')}"
            if not answer["data"]["result"] and title not in NO_DCGM_COUNTERPART:
                empty.append(where)
        assert not empty, f"GPU panels without data on the dcgm source: {empty}"
        memory = prom.query('gpu:sidecar_gpu_process_memory_bytes{job_id="j1", rank="0"}')["data"]["result"]
        assert [(m["metric"]["instance"], m["metric"]["gpu"], float(m["value"][1])) for m in memory] == [
            (NODE, "0", 64512 * 1048576)
        ]

        def firing() -> set[str]:
            return {a for a in gpu_alerts if any(x["labels"].get("instance") == NODE for x in prom.firing(a))}

        wanted = set(gpu_alerts) - NO_DCGM_ALERT
        wait_until(
            lambda: firing() >= wanted,
            120,
            interval=1,
            what=f"GPU alerts firing through dcgm series (missing {wanted - firing()})",
        )
        xids = {
            (a["labels"]["gpu"], a["labels"]["xid"])
            for n in ("SidecarGpuXidCritical", "SidecarGpuXid")
            for a in prom.firing(n)
        }
        assert xids == {("0", "79"), ("2", "13")}
