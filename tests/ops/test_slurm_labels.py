"""A Slurm job's owner on its series, in `/v1/status` and in its incidents (issue 44), through a real
sidecar and real hooks: ranks started with the variables slurmd sets register, and their series, the
job's own series, their status entries and the job's exit incident name the Slurm job, the user (the
uid the sidecar verified, whatever SLURM_JOB_USER says), the account and the partition.
`metrics.slurm_labels: false` keeps them off the series only. A malformed `slurm` is refused with 400
naming the field, and the sidecar goes on."""

from __future__ import annotations

import os
import pwd
import re
import signal
import subprocess
import sys

import pytest

from tests.exits.helpers import SETTINGS as EXIT_SETTINGS
from tests.exits.helpers import incidents, wait_for_exit
from tests.ops.helpers import post
from tests.support import ROOT, Sidecar, wait_until

ME = pwd.getpwuid(os.getuid()).pw_name
SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_ACCOUNT": "proj-a",
    "SLURM_JOB_PARTITION": "gpu",
    "SLURM_JOB_USER": "somebody-else",  # never read: the user is the uid the sidecar verified
}
RANK_SCRIPT = """
import sys, time
from trainer_hooks import Monitor
mon = Monitor(job_id=sys.argv[1], rank=int(sys.argv[2]), world_size=2, local_rank=int(sys.argv[2]),
              local_world_size=2, flush_interval=0.2)
for step in range(1, 4):
    mon.step(step, loss=2.0)
    time.sleep(0.2)
print("ready", flush=True)
time.sleep(600)
"""
SLURM_LABELS = re.compile(r'\bslurm_(job_id|user|account|partition)="')


def _start(sidecar: Sidecar, job: str, rank: int, extra_env: dict, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIDECAR_", "SLURM_"))}
    env.update(sidecar.hook_env(), PYTHONPATH=str(ROOT), **extra_env)
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", RANK_SCRIPT, job, str(rank)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _lines(metrics: str, job: str) -> list[str]:
    return [line for line in metrics.splitlines() if line.startswith("sidecar_") and f'job_id="{job}"' in line]


def _wait_for_series(sidecar: Sidecar, *jobs: str) -> str:
    def ready() -> bool:
        m = sidecar.metrics()
        return all(
            any(line.startswith(name + "{") for line in _lines(m, job))
            for job in jobs
            for name in ("sidecar_training_step", "sidecar_training_world_size", "sidecar_process_cpu_seconds_total")
        )

    wait_until(ready, 60, interval=0.5, what=f"the series of {jobs}")
    return sidecar.metrics()


def _entries(sidecar: Sidecar, job: str) -> list[dict]:
    return [r for r in sidecar.status()["ranks"] if r["job_id"] == job]


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    with Sidecar(tmp_path_factory.mktemp("slurm-labels"), "collectors.enabled=[process]", *EXIT_SETTINGS) as s:
        yield s


def test_a_slurm_jobs_series_status_and_incident_name_its_owner(sidecar):
    procs = []
    try:
        procs += [_start(sidecar, "sl", rank, SLURM_ENV) for rank in (0, 1)]
        procs.append(_start(sidecar, "plain", 0, {}))
        metrics = _wait_for_series(sidecar, "sl", "plain")
        owner = f'slurm_user="{ME}"', 'slurm_account="proj-a"', 'slurm_partition="gpu"'
        slurm = _lines(metrics, "sl")
        rank_series = [line for line in slurm if 'rank="' in line]
        job_series = [line for line in slurm if 'rank="' not in line]
        assert len(rank_series) >= 10 and any(line.startswith("sidecar_training_world_size{") for line in job_series)
        for line in slurm:  # the rank's series and the job's own
            assert all(label in line for label in owner) and "somebody-else" not in line, line
            assert "slurm_job_id=" not in line, line  # its cgroup is no Slurm job's: no id is claimed for it
        assert not any(SLURM_LABELS.search(line) for line in _lines(metrics, "plain"))
        entries = _entries(sidecar, "sl")
        assert [e["slurm"] for e in entries] == [{"user": ME, "account": "proj-a", "partition": "gpu"}] * 2
        assert [e["slurm"] for e in _entries(sidecar, "plain")] == [None]

        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        exit_ = wait_for_exit(sidecar, "sl", "signal")
        (incident,) = [i for i in incidents(sidecar, "exit") if i["id"] == exit_["incident"]]
        assert incident["slurm"] == {"user": ME, "account": "proj-a", "partition": "gpu"}
        with open(incident["path"][: -len(".json")] + ".txt") as f:
            assert f"  slurm     user {ME}, account proj-a, partition gpu\n" in f.read()
        brief = [b for b in sidecar.status()["incidents"] if b["id"] == exit_["incident"]]
        assert brief and brief[0]["slurm"] == incident["slurm"]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _job_cgroup(job: str):
    """A cgroup as slurmstepd makes one for a job's task (cgroup v1: slurm/uid_U/job_J/step_0/task_0)."""
    from tests.ops.test_slurm import _slurm_job_cgroup

    return _slurm_job_cgroup(job)


def test_a_rank_in_a_slurm_jobs_cgroup_carries_the_job_id_the_kernel_says(sidecar, tmp_path):
    from tests.ops.test_slurm import _remove_cgroup

    task = _job_cgroup("4243")
    proc = None
    try:
        # hooks that send no `slurm` (no SLURM_* variables): the cgroup alone makes it a Slurm job's
        enter = ("sh", "-c", 'echo $$ > "$0" && exec "$@"', str(task / "cgroup.procs"))
        proc = _start(sidecar, "cg", 0, {}, prefix=enter)
        metrics = _wait_for_series(sidecar, "cg")
        for line in _lines(metrics, "cg"):
            assert 'slurm_job_id="4243"' in line and f'slurm_user="{ME}"' in line and "slurm_account" not in line, line
        (entry,) = _entries(sidecar, "cg")
        assert entry["slurm_job_id"] == "4243" and entry["slurm"] == {"job_id": "4243", "user": ME}
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        _remove_cgroup(task)


def test_the_switch_keeps_the_labels_off_the_series_and_in_status(tmp_path):
    with Sidecar(tmp_path, "collectors.enabled=[process]", "metrics.slurm_labels=false") as sidecar:
        proc = _start(sidecar, "off", 0, SLURM_ENV)
        try:
            metrics = _wait_for_series(sidecar, "off")
            (entry,) = _entries(sidecar, "off")
        finally:
            proc.kill()
            proc.wait()
    assert not any(SLURM_LABELS.search(line) for line in _lines(metrics, "off"))
    assert entry["slurm"] == {"user": ME, "account": "proj-a", "partition": "gpu"}


@pytest.mark.parametrize(
    "slurm, message",
    [
        ({"account": "a" * 65}, "slurm.account: expected a Slurm account name"),
        ({"partition": 'gpu"} 1\nsidecar_up 0'}, "slurm.partition: expected a Slurm partition name"),
        ({"partition": "gpu,cpu"}, "slurm.partition: expected a Slurm partition name"),
        ({"account": 12}, "slurm.account: expected a Slurm account name (letters, digits, '_', '.' and '-', at most"),
        ({"account": {"nested": "x"}}, "got dict"),
        ({"user": "root"}, "slurm: unknown key 'user'"),
        ("proj-a", "slurm: expected an object with account and partition"),
    ],
)
def test_a_bad_slurm_value_is_refused_naming_the_field_and_the_sidecar_goes_on(sidecar, slurm, message):
    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    job = f"bad-slurm-{sleeper.pid}"
    try:
        body = {"job_id": job, "rank": 0, "world_size": 1, "pid": sleeper.pid}
        status, answer = post(sidecar.socket, "/v1/register", {**body, "slurm": slurm})
        assert status == 400 and answer["code"] == "bad_field" and message in answer["error"], answer
        assert _entries(sidecar, job) == []
        status, answer = post(sidecar.socket, "/v1/register", {**body, "slurm": {"account": "ok"}})
        assert status == 200, answer  # the sidecar answers on, and takes a well-formed one
        assert _entries(sidecar, job)[0]["slurm"] == {"user": ME, "account": "ok"}
        status, answer = post(sidecar.socket, "/v1/deregister", {"job_id": job, "rank": 0, "pid": sleeper.pid})
        assert status == 200, answer
    finally:
        sleeper.kill()
        sleeper.wait()
