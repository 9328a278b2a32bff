"""A rank's Slurm job (sidecar/ranks/slurmjob.py): the registration's `slurm` checked as untrusted
input, the user named from the verified uid, the labels a rank and its job carry, and its job's facts
in an incident."""

from __future__ import annotations

import os
import pwd
from types import SimpleNamespace

import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sidecar.incidents.store import IncidentStore
from sidecar.ranks import podlabels, protocol, slurmjob
from sidecar.ranks.protocol import Registration
from sidecar.ranks.registry import Registry
from tests.support import make_settings


def _registration(**fields) -> dict:
    return {"job_id": "j", "rank": 0, "world_size": 2, "pid": 4242, **fields}


def test_a_registration_carries_its_account_and_partition():
    reg = protocol.parse_registration(_registration(slurm={"account": "proj-a", "partition": "gpu"}))
    assert reg.slurm == {"account": "proj-a", "partition": "gpu"}
    assert protocol.parse_registration(_registration(slurm={"account": None, "partition": "gpu"})).slurm == {
        "partition": "gpu"
    }
    assert protocol.parse_registration(_registration()).slurm is None  # hooks of 8, or no Slurm
    assert protocol.parse_registration(_registration(slurm=None)).slurm is None
    assert protocol.parse_registration(_registration(slurm={})).slurm == {}  # a Slurm job, nothing more said


@pytest.mark.parametrize(
    "slurm, message",
    [
        ({"account": "a" * 65}, "slurm.account: expected a Slurm account name"),
        ({"partition": "gpu,cpu"}, "slurm.partition: expected a Slurm partition name"),
        ({"partition": 'gpu"} 1\nsidecar_x{a="'}, "slurm.partition: expected a Slurm partition name"),
        ({"account": ""}, "slurm.account: expected a Slurm account name"),
        ({"account": 7}, "slurm.account: expected a Slurm account name (letters, digits, '_', '.' and '-', at most 64"),
        ({"account": ["a"]}, "got list"),
        ({"user": "root"}, "slurm: unknown key 'user'; known: account, partition (the user is the uid of the process"),
        ({"job_id": "4242"}, "slurm: unknown key 'job_id'"),
        ("proj-a/gpu", "slurm: expected an object with account and partition"),
        (["proj-a"], "slurm: expected an object"),
    ],
)
def test_a_bad_slurm_value_is_refused_naming_the_field(slurm, message):
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.parse_registration(_registration(slurm=slurm))
    assert message in str(refused.value) and refused.value.status == 400 and refused.value.code == "bad_field"


def _rank(**fields) -> SimpleNamespace:
    return SimpleNamespace(**{"pid": os.getpid(), "owner_uid": os.getuid(), "slurm_job_id": None, "slurm_user": None,
                              "slurm": None, **fields})  # fmt: skip


def test_the_user_is_the_verified_uids_name_and_only_for_a_slurm_jobs_rank():
    me = pwd.getpwuid(os.getuid()).pw_name
    # this test's process is in no Slurm job's cgroup: a Slurm job's only by its own `slurm`
    assert slurmjob.verified(_rank(slurm={})) == (None, me)
    assert slurmjob.verified(_rank()) == (None, None)  # no Slurm job: no user named
    assert slurmjob.verified(_rank(slurm={}, owner_uid=None)) == (None, None)  # nothing verified: no user


def test_a_uid_without_a_plain_name_is_shown_as_its_number(monkeypatch):
    assert slurmjob.user_name(2**31 - 7) == str(2**31 - 7)  # in no user database
    monkeypatch.setattr(slurmjob.pwd, "getpwuid", lambda uid: SimpleNamespace(pw_name='eve"} 1\n'))
    assert slurmjob.user_name(1234) == "1234"


def test_a_ranks_facts_and_labels():
    rank = _rank(slurm_job_id="4242", slurm_user="alice", slurm={"account": "proj-a", "partition": "gpu"})
    assert slurmjob.facts(rank) == {"job_id": "4242", "user": "alice", "account": "proj-a", "partition": "gpu"}
    assert slurmjob.labels(rank) == {"slurm_job_id": "4242", "slurm_user": "alice", "slurm_account": "proj-a",
                                     "slurm_partition": "gpu"}  # fmt: skip
    assert slurmjob.labels(_rank(slurm_job_id="7")) == {"slurm_job_id": "7"}  # hooks that send no `slurm`
    assert slurmjob.facts(_rank()) is None and slurmjob.labels(_rank()) == {}


def test_a_jobs_facts_are_those_its_ranks_agree_on():
    a = _rank(slurm_user="alice", slurm={"account": "proj-a", "partition": "gpu"})
    b = _rank(slurm_user="alice", slurm={"account": "proj-b", "partition": "gpu"})
    assert slurmjob.job_facts([a, b, _rank()]) == {"user": "alice", "partition": "gpu"}  # two accounts: none
    assert slurmjob.job_facts([_rank(), _rank()]) is None


def _families() -> list:
    job = CounterMetricFamily("sidecar_job_failures", "", labels=["job_id", "reason"])
    rank = GaugeMetricFamily("sidecar_training_step", "", labels=["job_id", "rank"])
    for j in ("slurm", "mixed", "plain"):
        job.add_metric([j, "watchdog"], 1)
        rank.add_metric([j, "0"], 5)
    return [job, rank]


def test_the_labels_go_on_the_ranks_series_and_its_jobs_own_where_its_ranks_agree():
    lookup = {
        ("slurm", "0"): {"slurm_user": "alice", "slurm_account": "proj-a", "slurm_partition": "gpu"},
        ("slurm", "1"): {"slurm_user": "alice", "slurm_account": "proj-a", "slurm_partition": "gpu"},
        ("mixed", "0"): {"namespace": "team-a", "slurm_user": "bob", "slurm_account": "x"},
        ("mixed", "1"): {"namespace": "team-a", "slurm_user": "bob", "slurm_account": "y"},
    }
    job, rank = podlabels.attach(_families(), lambda: lookup)
    of_job = {s.labels["job_id"]: s.labels for s in job.samples}
    assert of_job["slurm"] == {"job_id": "slurm", "reason": "watchdog", "slurm_user": "alice",
                               "slurm_account": "proj-a", "slurm_partition": "gpu"}  # fmt: skip
    assert of_job["mixed"] == {"job_id": "mixed", "reason": "watchdog", "namespace": "team-a", "slurm_user": "bob"}
    assert of_job["plain"] == {"job_id": "plain", "reason": "watchdog"}
    of_rank = {s.labels["job_id"]: s.labels for s in rank.samples}
    assert of_rank["mixed"]["slurm_account"] == "x" and of_rank["plain"] == {"job_id": "plain", "rank": "0"}


@pytest.mark.parametrize("on", [True, False])
def test_the_switch_takes_the_slurm_labels_off_the_series_only(tmp_path, on):
    registry = Registry(make_settings(tmp_path, metrics__slurm_labels=on))
    reg = Registration(job_id="j", rank=0, local_rank=0, world_size=1, local_world_size=1, pid=100,
                       kubernetes={"namespace": "team-a"}, slurm={"account": "proj-a"})  # fmt: skip
    rank = registry.register(reg, pid_start_time=None, peer_verified=True, owner_uid=0)
    rank.slurm_job_id, rank.slurm_user = "4242", "root"
    slurm = {"slurm_job_id": "4242", "slurm_user": "root", "slurm_account": "proj-a"}
    assert registry.series_labels() == {("j", "0"): {"namespace": "team-a", **(slurm if on else {})}}
    assert slurmjob.facts(rank) == {"job_id": "4242", "user": "root", "account": "proj-a"}  # status keeps them


def test_an_incident_names_the_jobs_slurm_job_and_owner(tmp_path):
    store = IncidentStore(tmp_path, node="n1")
    store.slurm_of = lambda job_id: {"job_id": "4242", "user": "alice", "account": "proj-a"} if job_id == "j" else None
    incident = store.open("j", blamed_rank=0, blame_reason="r", timeout_seconds=1.0, observe_only=True, ranks=[])
    other = store.open("k", blamed_rank=0, blame_reason="r", timeout_seconds=1.0, observe_only=True, ranks=[])
    assert incident.to_dict()["slurm"] == {"job_id": "4242", "user": "alice", "account": "proj-a"}
    assert incident.brief()["slurm"] == incident.slurm and other.slurm is None
    assert "  slurm     job_id 4242, user alice, account proj-a\n" in incident.text()
    assert "slurm" not in other.text()
