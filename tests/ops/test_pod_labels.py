"""A rank's Kubernetes identity on its series: the hooks read the downward-API variables the job
examples set and send them at registration; the sidecar checks them as untrusted input and puts
`namespace`, `pod` and `container` on every series of that rank (training, watchdog, process),
and on none when the variables are absent."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.ops.helpers import post
from tests.support import ROOT, Sidecar, wait_until

POD_ENV = {
    "SIDECAR_POD_NAMESPACE": "team-a",
    "SIDECAR_POD_NAME": "llm-worker-1.abc",
    "SIDECAR_CONTAINER_NAME": "pytorch",
}
RANK_SCRIPT = """
import os, sys, time
from trainer_hooks import Monitor
mon = Monitor(job_id=sys.argv[1], rank=int(sys.argv[2]), world_size=4, local_rank=int(sys.argv[2]),
              local_world_size=4, flush_interval=0.2)
for step in range(1, 4):
    mon.step(step, loss=2.0, grad_norm=1.0)
    time.sleep(0.2)
print("ready", flush=True)
time.sleep(600)
"""


def _rank(sidecar: Sidecar, job: str, rank: int, extra_env: dict) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env.update(sidecar.hook_env(), PYTHONPATH=str(ROOT), **extra_env)
    return subprocess.Popen(
        [sys.executable, "-c", RANK_SCRIPT, job, str(rank)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _series(metrics: str, name: str, job: str) -> list[str]:
    return [line for line in metrics.splitlines() if line.startswith(name + "{") and f'job_id="{job}"' in line]


def test_rank_series_carry_the_pod_labels_and_only_when_set(tmp_path):
    procs = []
    with Sidecar(tmp_path, "collectors.enabled=[process]") as sidecar:
        try:
            procs.append(_rank(sidecar, "k8s", 0, POD_ENV))
            procs.append(_rank(sidecar, "bare", 0, {"SIDECAR_POD_NAME": ""}))  # set but empty: no label
            procs.append(_rank(sidecar, "bad", 0, {"SIDECAR_POD_NAMESPACE": "Not_A_Namespace"}))
            for p in procs:
                assert p.stdout.readline().strip() == "ready"

            def labelled() -> bool:
                m = sidecar.metrics()
                return all(
                    _series(m, n, "k8s") and _series(m, n, "bare") and _series(m, n, "bad")
                    for n in ("sidecar_training_step", "sidecar_process_cpu_seconds_total")
                )

            wait_until(labelled, 60, interval=0.5, what="rank series of the three jobs")
            metrics = sidecar.metrics()
        finally:
            for p in procs:
                p.kill()
                p.wait()
    k8s = [line for line in metrics.splitlines() if 'job_id="k8s"' in line and line.startswith("sidecar_")]
    rank_series = [line for line in k8s if 'rank="0"' in line]
    assert len(rank_series) >= 10
    for line in rank_series:
        assert 'namespace="team-a"' in line and 'pod="llm-worker-1.abc"' in line and 'container="pytorch"' in line, line
    for name in ("sidecar_training_step", "sidecar_rank_state", "sidecar_process_cpu_seconds_total"):
        assert any(line.startswith(name + "{") for line in rank_series), name
    # Job-level series carry the job's namespace (one, from its ranks here), never a pod or container;
    # ranks without the variables carry no such label at all.
    job_level = [line for line in k8s if 'rank="' not in line]
    assert any(line.startswith("sidecar_training_world_size{") for line in job_level), job_level
    for line in job_level:
        assert 'namespace="team-a"' in line and "pod=" not in line and "container=" not in line, line
    for job in ("bare", "bad"):
        lines = [line for line in metrics.splitlines() if f'job_id="{job}"' in line]
        assert lines and not any(re.search(r'\b(namespace|pod|container)="', line) for line in lines), job


@pytest.mark.parametrize(
    "kubernetes, message",
    [
        ({"namespace": "Team-A"}, "kubernetes.namespace: expected a DNS-1123 label"),
        ({"pod": "a" * 254}, "kubernetes.pod: expected a DNS-1123 subdomain"),
        ({"pod": "x\ny"}, "kubernetes.pod: expected a DNS-1123 subdomain"),
        ({"container": ""}, "kubernetes.container: expected a DNS-1123 label"),
        ({"container": 7}, "kubernetes.container: expected a DNS-1123 label"),
        ({"node": "n1"}, "kubernetes: unknown key 'node'"),
        ("team-a/pod", "kubernetes: expected an object"),
    ],
)
def test_a_registration_with_a_bad_pod_name_is_refused_naming_the_field(tmp_path, kubernetes, message):
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        with Sidecar(tmp_path, "collectors.enabled=[]") as sidecar:
            status, answer = post(
                sidecar.socket,
                "/v1/register",
                {"job_id": "j", "rank": 0, "world_size": 1, "pid": proc.pid, "kubernetes": kubernetes},
            )
            assert sidecar.status()["ranks"] == []
    finally:
        proc.kill()
        proc.wait()
    assert status == 400 and answer["code"] == "bad_field" and message in answer["error"], answer


def _pod_env(pod_spec: dict) -> dict:
    container = pod_spec["containers"][0]
    return {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}


def test_the_job_examples_set_the_variables_from_the_downward_api():
    from trainer_hooks.environment import POD_VARIABLES

    wanted = {"SIDECAR_POD_NAMESPACE": "metadata.namespace", "SIDECAR_POD_NAME": "metadata.name"}
    assert {v for v, _, _ in POD_VARIABLES} == {*wanted, "SIDECAR_CONTAINER_NAME"}
    examples = ROOT / "deploy" / "kubernetes" / "examples"
    job = yaml.safe_load((examples / "pytorchjob.yaml").read_text())
    jobset = yaml.safe_load((examples / "jobset.yaml").read_text())
    pods = [
        job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"],
        *(r["template"]["spec"]["template"]["spec"] for r in jobset["spec"]["replicatedJobs"]),
    ]
    for pod in pods:
        env = _pod_env(pod)
        assert wanted.items() <= env.items()
        container = pod["containers"][0]
        names = {e["name"]: e.get("value") for e in container["env"]}
        assert names["SIDECAR_CONTAINER_NAME"] == container["name"]  # no downward-API field for it


def test_a_jobs_own_series_get_its_namespace_only_when_its_ranks_name_one():
    from prometheus_client.core import CounterMetricFamily

    from sidecar.ranks.podlabels import attach

    def family() -> CounterMetricFamily:
        f = CounterMetricFamily("sidecar_job_failures", "", labels=["job_id", "reason"])
        for job in ("one", "two", "none"):
            f.add_metric([job, "watchdog"], 1)
        return f

    lookup = {("one", "0"): {"namespace": "team-a", "pod": "p0"}, ("one", "1"): {"namespace": "team-a", "pod": "p1"},
              ("two", "0"): {"namespace": "team-a"}, ("two", "1"): {"namespace": "team-b"}}  # fmt: skip
    (got,) = attach([family()], lambda: lookup)
    labels = {s.labels["job_id"]: s.labels for s in got.samples}
    assert labels["one"] == {"job_id": "one", "reason": "watchdog", "namespace": "team-a"}  # never a pod
    assert "namespace" not in labels["two"] and "namespace" not in labels["none"]  # two namespaces, or none
