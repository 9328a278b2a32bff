"""The real Prometheus and Alertmanager binaries on free loopback ports, for the tests that
check rules and dashboards against live data. Each runs in its own session and is killed
with everything it started when its context ends."""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import yaml
from aiohttp import web

from sidecar.testing.fake_grafana import BackgroundServer
from tests.support import ROOT, free_port, http_get, spawned, tail, wait_until

PROMETHEUS = "/usr/bin/prometheus"
ALERTMANAGER = "/usr/bin/prometheus-alertmanager"
ALERTMANAGER_CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"


class Prometheus:
    def __init__(
        self,
        workdir: Path,
        targets: Sequence[str] = (),
        rule_files: Sequence[Path] = (),
        alertmanager: str | None = None,
        interval: str = "1s",
        scrape_configs: Sequence[dict] = (),
    ):
        self.workdir = Path(workdir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.workdir / "prometheus.log"
        config: dict = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": list(scrape_configs)
            or [{"job_name": "sidecar", "static_configs": [{"targets": list(targets)}]}],
        }
        if alertmanager:
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
        self.config = self.workdir / "prometheus.yml"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config.write_text(yaml.safe_dump(config))

    @contextlib.contextmanager
    def running(self, timeout: float = 60.0) -> Iterator[Prometheus]:
        cmd = [
            PROMETHEUS,
            f"--config.file={self.config}",
            f"--storage.tsdb.path={self.workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        with spawned(cmd, self.log) as proc:
            wait_until(
                lambda: proc.poll() is not None or http_get(self.url + "/-/ready")[0] == 200,
                timeout,
                what="prometheus ready",
            )
            assert proc.poll() is None, f"prometheus exited:\n{tail(self.log)}"
            yield self

    def api(self, path: str, **params: str) -> dict:
        status, body = http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=30)
        assert body, f"no answer from prometheus ({status}):\n{tail(self.log)}"
        return json.loads(body)

    def query(self, expr: str) -> dict:
        return self.api("query", query=expr)

    def series_count(self, expr: str) -> int:
        answer = self.query(expr)
        return len(answer["data"]["result"]) if answer["status"] == "success" else 0

    def firing(self, alertname: str) -> list[dict]:
        return [
            a
            for a in self.api("alerts")["data"]["alerts"]
            if a["labels"].get("alertname") == alertname and a["state"] == "firing"
        ]


class Alertmanager:
    def __init__(self, workdir: Path, config: dict):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        self.log = self.workdir / "alertmanager.log"
        self.config = self.workdir / "alertmanager.yml"
        self.config.write_text(yaml.safe_dump(config))

    @contextlib.contextmanager
    def running(self, timeout: float = 60.0) -> Iterator[Alertmanager]:
        cmd = [
            ALERTMANAGER,
            f"--config.file={self.config}",
            f"--storage.path={self.workdir / 'data'}",
            f"--web.listen-address={self.address}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ]
        with spawned(cmd, self.log) as proc:
            wait_until(
                lambda: proc.poll() is not None or http_get(self.url + "/-/ready")[0] == 200,
                timeout,
                what="alertmanager ready",
            )
            assert proc.poll() is None, f"alertmanager exited:\n{tail(self.log)}"
            yield self

    def post(self, alerts: Sequence[dict]) -> None:
        """Send alerts as Prometheus does (API v2): each a dict with `labels` (and `annotations`)."""
        request = urllib.request.Request(
            f"{self.url}/api/v2/alerts",
            data=json.dumps(list(alerts)).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200, answer.read()


class Webhook(BackgroundServer):
    """Alertmanager's webhook receiver: records every notification by path."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict]] = []
        self._lock = threading.Lock()
        app = web.Application()
        app.router.add_post("/{receiver}", self._receive)
        super().__init__(app)

    async def _receive(self, request: web.Request) -> web.Response:
        body = await request.json()
        with self._lock:
            self.received.append((request.match_info["receiver"], body))
        return web.json_response({"ok": True})

    def notifications(self, receiver: str) -> list[dict]:
        with self._lock:
            return [b for r, b in self.received if r == receiver]

    def all(self) -> list[tuple[str, dict]]:
        """Every notification so far, as (receiver, body), in order of arrival."""
        with self._lock:
            return list(self.received)


def alertmanager_config(webhook_url: str) -> dict:
    """The shipped routing with every receiver pointed at the test's webhook (/<receiver name>)."""
    config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{webhook_url}/{receiver['name']}"
    return config
