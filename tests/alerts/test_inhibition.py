"""One hang, one page: the inhibit rules of deploy/alertmanager/alertmanager.yml, on the real
Alertmanager with a webhook receiver this test runs. A hung job fires its cause (SidecarJobHungOnRank)
and its consequences (SidecarRankStalled on every rank, SidecarJobNotProgressing, throughput,
goodput, would-kill and collective-timeout alerts); exactly one notification reaches the
receivers per hung job.

The test's copy of the config is the shipped file with only the timings (group_wait,
group_interval, repeat_interval) shortened and the receivers' URLs pointed at the webhook: the
routes and inhibit rules under test are the shipped ones. The alerts come either as Prometheus
would post them (Alertmanager's /api/v2/alerts), or from the shipped rules themselves, evaluated
by a real Prometheus over a hung job's series."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from alerts import build as alerts_build
from sidecar.testing.fake_grafana import BackgroundServer
from tests.alerts.realstack import Alertmanager, Prometheus, Webhook, alertmanager_config
from tests.support import wait_until

pytestmark = pytest.mark.system

# Alerts posted at once (one API call) are grouped within any group_wait: 1 s. Alerts from the rules
# fire at evaluation times a few seconds apart, and a consequence that fired before its cause would
# page if its group were sent first: 3 s there.
POSTED, FROM_RULES = (1, 1), (3, 2)  # (group_wait, group_interval) in seconds


def short_timings(route: dict, group_wait: int, group_interval: int) -> None:
    """Every route's timings shortened (the test waits seconds, not minutes); nothing else."""
    route.update(group_wait=f"{group_wait}s", group_interval=f"{group_interval}s", repeat_interval="1h")
    for child in route.get("routes", []):
        short_timings(child, group_wait, group_interval)


@contextlib.contextmanager
def alertmanager(workdir: Path, timings: tuple[int, int] = POSTED) -> Iterator[tuple[Alertmanager, Webhook]]:
    with contextlib.ExitStack() as stack:
        webhook = stack.enter_context(Webhook())
        config = alertmanager_config(webhook.url)
        short_timings(config["route"], *timings)
        am = stack.enter_context(Alertmanager(workdir, config).running())
        yield am, webhook


def delivered(webhook: Webhook, count: int, timings: tuple[int, int] = POSTED) -> list[tuple[str, list[str], dict]]:
    """Wait for `count` firing notifications, then long enough that any further one would have
    come; every notification as (receiver, its alerts' names, its group labels)."""

    def firing() -> list[tuple[str, list[str], dict]]:
        return [
            (receiver, sorted(a["labels"]["alertname"] for a in body["alerts"]), body["groupLabels"])
            for receiver, body in webhook.all()
            if body["status"] == "firing"
        ]

    wait_until(lambda: len(firing()) >= count, 60, interval=0.2, what=f"{count} notification(s)")
    group_wait, group_interval = timings
    time.sleep(group_wait + 2 * group_interval + 1.0)  # any further notification would have come by now
    return firing()


def alert(name: str, severity: str, **labels: str) -> dict:
    return {
        "labels": {"alertname": name, "severity": severity, **labels},
        "annotations": {"summary": f"{name} {labels}"},
    }


def hang(job_id: str, namespace: str = "team-a", cluster: str = "c1", culprit: bool = True) -> list[dict]:
    """What one hung job of 4 ranks on 2 nodes fires, with the labels the rules give each alert.
    The alerts built on the sidecar's job-level series (no rank) carry no namespace."""
    job = {"cluster": cluster, "namespace": namespace, "job_id": job_id}
    job_level = {"cluster": cluster, "job_id": job_id}
    alerts = [
        alert("SidecarRankStalled", "critical", **job, instance=f"n{rank // 2}", rank=str(rank)) for rank in range(4)
    ]
    alerts += [
        alert("SidecarJobNotProgressing", "critical", **job),
        alert("SidecarThroughputDrop", "warning", **job),
        alert("SidecarJobGoodputLow", "warning", **job_level),
        alert("SidecarWouldHaveKilled", "warning", **job_level),
        alert("SidecarCollectiveTimeout", "warning", **job_level, instance="n0"),
    ]
    if culprit:
        alerts.append(alert("SidecarJobHungOnRank", "critical", **job, rank="3", node="node-1"))
    return alerts


def test_one_hung_job_pages_once_with_its_culprit(tmp_path):
    with alertmanager(tmp_path) as (am, webhook):
        am.post(hang("j1"))
        assert delivered(webhook, 1) == [
            (
                "pager",
                ["SidecarJobHungOnRank"],
                {"alertname": "SidecarJobHungOnRank", "cluster": "c1", "namespace": "team-a", "job_id": "j1"},
            )
        ]


def test_two_hung_jobs_page_twice(tmp_path):
    with alertmanager(tmp_path) as (am, webhook):
        am.post(hang("j1") + hang("j2"))
        got = delivered(webhook, 2)
        assert sorted((r, names, g["job_id"]) for r, names, g in got) == [
            ("pager", ["SidecarJobHungOnRank"], "j1"),
            ("pager", ["SidecarJobHungOnRank"], "j2"),
        ]


def test_one_job_id_hung_in_two_namespaces_pages_once_per_namespace(tmp_path):
    with alertmanager(tmp_path) as (am, webhook):
        am.post(hang("j1", namespace="team-a") + hang("j1", namespace="team-b"))
        got = delivered(webhook, 2)
        assert sorted((r, names, g.get("namespace")) for r, names, g in got) == [
            ("pager", ["SidecarJobHungOnRank"], "team-a"),
            ("pager", ["SidecarJobHungOnRank"], "team-b"),
        ]


def test_without_a_named_culprit_the_job_alert_pages_alone(tmp_path):
    """No rank named (the job view could not judge): the job alert silences its ranks' stalls."""
    with alertmanager(tmp_path) as (am, webhook):
        am.post(hang("j1", culprit=False))
        assert [(r, names) for r, names, _ in delivered(webhook, 1)] == [("pager", ["SidecarJobNotProgressing"])]


def test_a_hang_silences_only_its_own_job(tmp_path):
    """The same alerts of another job (another id, or the same id in another namespace or
    cluster) are not inhibited by this job's cause."""
    with alertmanager(tmp_path) as (am, webhook):
        others = [
            alert(
                "SidecarRankStalled", "critical", cluster="c1", namespace="team-a", job_id="j2", instance="n5", rank="0"
            ),
            alert(
                "SidecarRankStalled", "critical", cluster="c1", namespace="team-b", job_id="j1", instance="n6", rank="0"
            ),
            alert(
                "SidecarRankStalled", "critical", cluster="c2", namespace="team-a", job_id="j1", instance="n7", rank="0"
            ),
        ]
        am.post(hang("j1") + others)
        got = delivered(webhook, 4)
        assert sorted((names[0], g["cluster"], g.get("namespace"), g["job_id"]) for _, names, g in got) == [
            ("SidecarJobHungOnRank", "c1", "team-a", "j1"),
            ("SidecarRankStalled", "c1", "team-a", "j2"),
            ("SidecarRankStalled", "c1", "team-b", "j1"),
            ("SidecarRankStalled", "c2", "team-a", "j1"),
        ]


# ---------------------------------------------------------------- from the shipped rules


class HungJobsExporter(BackgroundServer):
    """A scrape target that exposes, as the sidecars would, jobs whose rank 3 hangs: every rank
    stalled at one step, ranks 0-2 waiting in a collective, rank 3 running its own code, no
    progress for an hour."""

    def __init__(self, job_ids: list[str]) -> None:
        lines = []
        last_progress = time.time() - 3600
        for j, job_id in enumerate(job_ids):
            for n in range(2):
                instance = f"n{2 * j + n}"
                lines.append(f'sidecar_node_info{{instance="{instance}",node="node-{2 * j + n}"}} 1')
            for rank in range(4):
                labels = f'instance="n{2 * j + rank // 2}",job_id="{job_id}",rank="{rank}"'
                lines += [
                    f"sidecar_training_step{{{labels}}} 29",
                    f"sidecar_rank_waiting_in_collective{{{labels}}} {0 if rank == 3 else 1}",
                    f'sidecar_rank_state{{{labels},state="stalled"}} 1',
                    f"sidecar_training_last_progress_timestamp_seconds{{{labels}}} {last_progress:.0f}",
                ]
        self.text = "\n".join(lines) + "\n"
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        super().__init__(app)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.text, content_type="text/plain")


@pytest.mark.slow
@pytest.mark.parametrize("job_ids", [["j1"], ["j1", "j2"]], ids=["one-job", "two-jobs"])
def test_hung_jobs_through_the_shipped_rules_page_once_per_job(tmp_path, job_ids):
    rules = tmp_path / "rules"
    alerts_build.write(rules, for_override="1s")
    with contextlib.ExitStack() as stack:
        exporter = stack.enter_context(HungJobsExporter(job_ids))
        am, webhook = stack.enter_context(alertmanager(tmp_path / "am", FROM_RULES))
        target = exporter.url.removeprefix("http://")
        prom = stack.enter_context(
            Prometheus(
                tmp_path / "prom",
                rule_files=[*sorted(rules.glob("*.rules.yml")), rules / "gpu-source" / "sidecar.rules.yml"],
                alertmanager=am.address,
                scrape_configs=[
                    {"job_name": "sidecar", "honor_labels": True, "static_configs": [{"targets": [target]}]}
                ],
            ).running()
        )
        expected = {
            "SidecarJobHungOnRank": len(job_ids),
            "SidecarRankStalled": 4 * len(job_ids),
            "SidecarJobNotProgressing": len(job_ids),
        }
        wait_until(
            lambda: {name: len(prom.firing(name)) for name in expected} == expected,
            60,
            interval=0.5,
            what=f"{expected} firing in Prometheus",
        )
        got = delivered(webhook, len(job_ids), FROM_RULES)
        assert sorted((r, names, g["job_id"]) for r, names, g in got) == [
            ("pager", ["SidecarJobHungOnRank"], job_id) for job_id in job_ids
        ]
