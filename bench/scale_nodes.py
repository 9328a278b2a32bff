"""Simulated training nodes for the cluster-scale stack (bench/bench_scale.py and
tests/alerts/test_scale_stack.py): each answers `/metrics` with the exposition a real sidecar gave
on an 8-GPU node (fixtures/node-8gpu.prom, recorded from the node tests/dashboards/test_scale.py
builds: 8 GPUs with 18 NVLinks each, 8 ranks, 4 NICs, 2 InfiniBand ports), relabelled per node (its
job, its ranks, its node name) and moving as a healthy node's series do: the step and every counter
that has counted advance with time (one step a second, of STEP_SECONDS; the job's productive
seconds too), counters still at 0 (errors, drops, kills) stay there, and gauges that are not 0/1
wander by a few percent.

One HTTP server listens on one port per node (`Nodes`), since scrapers shard by `__address__`;
a node's answer can be changed (`Node.override`) or extended (`Node.extra`) while it runs.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from sidecar.testing.fake_grafana import BackgroundServer

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "node-8gpu.prom"
RANKS_PER_NODE = 8
FIXTURE_JOB, FIXTURE_NODE = "scale-job", "vm"
STEP_SECONDS = 0.1  # the recorded step time: the histogram's sum grows by this per step
_COUNTER = re.compile(r"_(total|count|bucket)$")
_RANK = re.compile(r'rank="(\d+)"')


@dataclass
class Sample:
    name: str
    labels: str  # `{...}` or ""
    value: float
    rank: int | None  # the rank it belongs to, if any


def load_fixture(path: Path = FIXTURE) -> list[Sample]:
    """The recorded exposition's samples (comments left out: scrapers do not need them)."""
    out = []
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, brace, rest = series.partition("{")
        rank = _RANK.search(rest)
        out.append(Sample(name, brace + rest, float(value), int(rank[1]) if rank else None))
    if not out:
        raise ValueError(f"{path}: no samples")
    return out


# (metric name, its labels as rendered, base value) -> the value to answer, or None for the default.
Override = Callable[[str, str, float], float | None]


@dataclass
class Node:
    name: str
    job: str
    first_rank: int
    override: Override | None = None
    extra: Callable[[], str] | None = None  # more exposition lines (ending in a newline)
    _lines: list[tuple[str, str, str, float, bool]] = field(default_factory=list, repr=False)

    def prepare(self, samples: list[Sample]) -> None:
        """Each sample with this node's job, ranks and name: (prefix, name, labels, base, counter)."""
        self._lines = []
        for s in samples:
            labels = s.labels.replace(f'job_id="{FIXTURE_JOB}"', f'job_id="{self.job}"')
            labels = labels.replace(f'node="{FIXTURE_NODE}"', f'node="{self.name}"')
            if s.rank is not None:
                labels = _RANK.sub(f'rank="{self.first_rank + s.rank}"', labels, count=1)
            self._lines.append((f"{s.name}{labels} ", s.name, labels, s.value, bool(_COUNTER.search(s.name))))

    def render(self, elapsed: float, rng: random.Random) -> str:
        out = []
        for prefix, name, labels, base, counter in self._lines:
            value = self.override(name, labels, base) if self.override else None
            if value is None:
                if counter and (base or 'state="productive"' in labels):
                    value = base + elapsed
                elif name == "sidecar_training_step":
                    value = base + elapsed // 1
                elif name.endswith("_sum"):
                    value = base + elapsed * STEP_SECONDS
                elif base not in (0.0, 1.0):
                    value = base * (1 + 0.04 * (rng.random() - 0.5))
                else:
                    value = base
            out.append(f"{prefix}{value:g}\n")
        return "".join(out) + (self.extra() if self.extra else "")


class Nodes(BackgroundServer):
    """The simulated nodes, node i on `ports[i]` of 127.0.0.1 (`address(i)`)."""

    def __init__(self, nodes: list[Node], ports: list[int] | None = None, samples: list[Sample] | None = None):
        """`ports`: one per node (0 or None: any free one)."""
        ports = list(ports) if ports is not None else [0] * len(nodes)
        if len(nodes) != len(ports):
            raise ValueError(f"{len(nodes)} nodes need as many ports, got {len(ports)}")
        samples = samples or load_fixture()
        for node in nodes:
            node.prepare(samples)
        self.nodes, self.ports = nodes, ports
        self.by_port: dict[int, Node] = {}
        self.started = time.monotonic()
        self.scrapes = 0
        self._rng = random.Random(45)
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        super().__init__(app)

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        for i, port in enumerate(self.ports):
            site = web.TCPSite(self._runner, "127.0.0.1", port, backlog=1024)
            await site.start()
            self.ports[i] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.by_port = dict(zip(self.ports, self.nodes, strict=True))
        self.url = f"http://{self.address(0)}"

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    async def _metrics(self, request: web.Request) -> web.Response:
        port: int = request.transport.get_extra_info("sockname")[1] if request.transport else -1
        node = self.by_port.get(port)
        if node is None:
            raise web.HTTPNotFound(text=f"no simulated node on port {port}")
        self.scrapes += 1
        body = node.render(time.monotonic() - self.started, self._rng)
        return web.Response(text=body, content_type="text/plain", charset="utf-8")
