"""The cluster-scale reference stack on this machine, from Debian's packages and the files
`sidecar deploy-gen` generates (sidecar/mixin/scale.py): N scraping shards (Prometheus agents, or
vmagents), victoria-metrics, and vmalert evaluating the split rules against it and sending to an
Alertmanager. Every part gets a free loopback port and a directory of its own under `workdir`, and
is stopped with everything it started when the context ends, also on failure.

Used by tests/alerts/test_scale_stack.py and bench/bench_scale.py.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import yaml

from harness.processes import Processes
from harness.processes import free_port as any_free_port
from sidecar.mixin import scale
from sidecar.mixin.config import DEFAULT, MixinConfig

SHARD_KINDS = ("prometheus", "vmagent")


def prometheus_shard(address: str, shards: int) -> int:
    """The shard Prometheus's `hashmod` relabelling gives `address` (the low 8 bytes of its MD5).
    vmagent hashes differently (xxhash): a cluster's shards are all of one kind."""
    return int.from_bytes(hashlib.md5(address.encode()).digest()[8:], "big") % shards


def _get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.read()
    except OSError:
        return 0, b""


class Stack:
    def __init__(
        self,
        workdir: Path,
        targets: Sequence[str],
        alertmanager_url: str,
        *,
        shards: int = 2,
        shard_kind: str = "prometheus",
        interval: str = "1s",
        for_override: str | None = "1s",
        cfg: MixinConfig = DEFAULT,
        free_port: Callable[[], int] = any_free_port,
        store_flags: Sequence[str] = ("-search.latencyOffset=1s",),
    ):
        if shard_kind not in SHARD_KINDS:
            raise ValueError(f"shard_kind: expected one of {', '.join(SHARD_KINDS)}, got {shard_kind!r}")
        self.workdir = Path(workdir)
        self.config_dir, self.data_dir = self.workdir / "config", self.workdir / "data"
        for d in (self.config_dir, self.data_dir, self.workdir / "targets"):
            d.mkdir(parents=True, exist_ok=True)
        self.store_port, self.free_port = free_port(), free_port
        self.store_url = f"http://127.0.0.1:{self.store_port}"
        self.cfg = replace(
            cfg,
            scale=replace(
                cfg.scale,
                shards=shards,
                scrape_interval=interval,
                evaluation_interval=interval,
                targets_file=str(self.workdir / "targets" / "*.yml"),
                store_url=self.store_url,
                alertmanager_url=alertmanager_url,
            ),
        )
        self.shard_kind, self.store_flags = shard_kind, list(store_flags)
        (self.workdir / "targets" / "nodes.yml").write_text(yaml.safe_dump([{"targets": list(targets)}]))
        for name, text in scale.files(self.cfg, for_override).items():
            (self.config_dir / name).write_text(text)
        self.procs = Processes(self.workdir)
        self.urls: dict[str, str] = {}

    def _start(self, name: str, cmd: list[str], ready: str, timeout: float = 60.0) -> None:
        proc = self.procs.start(name, cmd)
        deadline = time.monotonic() + timeout
        while _get(self.urls[name] + ready, timeout=2)[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{self.log(name)}")
            time.sleep(0.1)

    def log(self, name: str, lines: int = 40) -> str:
        try:
            return "\n".join(self.procs.log(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.procs.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.procs.close()

    def start(self) -> None:
        cmds = scale.commands(self.cfg, str(self.config_dir), str(self.data_dir))
        self.urls["victoria-metrics"] = self.store_url
        self._start("victoria-metrics", cmds["victoria-metrics"] + self.store_flags, "/health")
        for n in range(self.cfg.scale.shards):
            port = self.free_port()
            name = f"shard-{n}" if self.shard_kind == "prometheus" else f"vmagent-{n}"
            self.urls[name] = f"http://127.0.0.1:{port}"
            if self.shard_kind == "prometheus":
                listen = [f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
                self._start(name, cmds[name] + listen, "/-/ready")
            else:
                self._start(name, cmds[name] + [f"-httpListenAddr=127.0.0.1:{port}", "-loggerLevel=WARN"], "/health")
        port = self.free_port()
        self.urls["vmalert"] = f"http://127.0.0.1:{port}"
        self._start("vmalert", cmds["vmalert"] + [f"-httpListenAddr=127.0.0.1:{port}", "-loggerLevel=WARN"], "/health")

    @property
    def shard_names(self) -> list[str]:
        return [n for n in self.urls if n.startswith(("shard-", "vmagent-"))]

    def pid(self, name: str) -> int:
        names = ["victoria-metrics", *self.shard_names, "vmalert"]
        return self.procs.started[names.index(name)].pid

    def query(self, expr: str) -> list[dict]:
        """The store's answer to an instant query (its `result`); an error raises with the store's words."""
        status, body = _get(f"{self.store_url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=30)
        answer = json.loads(body) if body else {}
        if answer.get("status") != "success":
            raise RuntimeError(f"victoria-metrics answered {status} to {expr!r}: {body[:500]!r}")
        return answer["data"]["result"]

    def alerts(self) -> list[dict]:
        """vmalert's alerts, firing and pending."""
        status, body = _get(self.urls["vmalert"] + "/api/v1/alerts")
        if status != 200:
            raise RuntimeError(f"vmalert answered {status}:\n{self.log('vmalert')}")
        return json.loads(body)["data"]["alerts"] or []

    def groups(self) -> list[dict]:
        """vmalert's rule groups, each rule with its `lastError` and evaluation figures."""
        status, body = _get(self.urls["vmalert"] + "/api/v1/rules")
        if status != 200:
            raise RuntimeError(f"vmalert answered {status}:\n{self.log('vmalert')}")
        return json.loads(body)["data"]["groups"] or []

    def firing(self, alertname: str) -> list[dict]:
        return [a for a in self.alerts() if a["name"] == alertname and a["state"] == "firing"]

    def metrics(self, name: str) -> str:
        """A part's own /metrics."""
        return _get(self.urls[name] + "/metrics")[1].decode()
