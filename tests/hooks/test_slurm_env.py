"""The hooks read a Slurm job's account and partition from the job's environment and send them in the
registration's `slurm` (protocol 9), well-formed values only; never the user (the sidecar names the uid
it verified), and nothing outside Slurm."""

from __future__ import annotations

import collections
import json
import logging
import os

import pytest

from trainer_hooks import environment
from trainer_hooks.sender import Sender

SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_ACCOUNT": "proj-a", "SLURM_JOB_PARTITION": "gpu_h100.x"}


def _registration(environ: dict) -> dict:
    """The body the hooks' registration sends with `environ` (captured, not posted)."""
    sender = Sender(
        collections.deque(), environment.Endpoint(socket_path="/nonexistent"), environment.identity(environ),
        os.getpid(), None, 1.0, False,
    )  # fmt: skip
    sent: list[dict] = []
    sender._post = lambda path, body, deadline: sent.append(json.loads(body))
    sender.register()
    (body,) = sent
    return body


def test_a_slurm_jobs_rank_sends_its_account_and_partition_and_never_a_user():
    body = _registration({**SLURM, "SLURM_JOB_USER": "root", "SLURM_JOB_UID": "0"})
    assert body["slurm"] == {"account": "proj-a", "partition": "gpu_h100.x"}
    assert environment.identity(SLURM).slurm == (("account", "proj-a"), ("partition", "gpu_h100.x"))


def test_outside_slurm_the_registration_carries_no_slurm():
    body = _registration({"SLURM_JOB_ACCOUNT": "proj-a", "SLURM_JOB_ID": "  "})  # no job id: not a Slurm job
    assert "slurm" not in body
    assert environment.identity({}).slurm is None


def test_a_slurm_job_without_account_or_partition_still_says_it_is_one():
    assert _registration({"SLURM_JOB_ID": "7", "SLURM_JOB_ACCOUNT": ""})["slurm"] == {}


@pytest.mark.parametrize(
    "variable, value",
    [
        ("SLURM_JOB_ACCOUNT", "a" * 65),  # too long
        ("SLURM_JOB_ACCOUNT", "proj a"),
        ("SLURM_JOB_PARTITION", "gpu,cpu"),  # a list, not the partition it runs in
        ("SLURM_JOB_PARTITION", 'gpu"} 1\n'),  # an exposition line's end
        ("SLURM_JOB_PARTITION", "-gpu"),
        ("SLURM_JOB_ACCOUNT", "ünï"),
    ],
)
def test_a_malformed_value_is_left_out_with_a_warning(variable, value, caplog):
    with caplog.at_level(logging.WARNING, logger="trainer_hooks"):
        slurm = environment.slurm({**SLURM, variable: value})
    key = "account" if variable == "SLURM_JOB_ACCOUNT" else "partition"
    assert slurm is not None and key not in dict(slurm) and len(slurm) == 1
    assert f"ignoring {variable}=" in caplog.text


def test_values_at_the_bound_are_sent():
    slurm = environment.slurm({**SLURM, "SLURM_JOB_ACCOUNT": "a" * 64, "SLURM_JOB_PARTITION": " Batch-1 "})
    assert slurm == (("account", "a" * 64), ("partition", "Batch-1"))
