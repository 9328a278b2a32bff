"""Importing the hooks makes the next process group restart-safe under torchrun (no torch import
of its own), and every registration says whether the rank's group would come back after a
torchrun restart (`restart_safe`, wire protocol 4)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sidecar.ranks.protocol import ProtocolError, parse_registration
from tests.support import ROOT, free_port

SHARED_STORE = {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_USE_AGENT_STORE": "True"}
REGISTRATION = {"job_id": "run-42", "rank": 0, "world_size": 1, "pid": 1234}


def python(code: str, **env: str) -> str:
    """Run `code` in a fresh interpreter with only `env` of torchrun's variables; its last line."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SIDECAR_", "RANK", "MASTER_"))}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, "PYTHONPATH": str(ROOT), **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_hooks_imported_before_torch_install_the_remedy_when_torch_loads_without_importing_it():
    out = python(
        "import sys, trainer_hooks\n"
        "from trainer_hooks import distributed as d\n"
        "assert 'torch' not in sys.modules and not d.installed()\n"
        "import torch\n"
        "finders = [f for f in sys.meta_path if type(f).__name__ == '_InstallAfterTorchLoads']\n"
        "print(d.installed(), finders, d.restart_safety())",
        **SHARED_STORE,
    )
    assert out == "True [] True"


def test_hooks_imported_after_torch_install_the_remedy_at_once():
    out = python(
        "import torch, trainer_hooks\nfrom trainer_hooks import distributed as d\nprint(d.installed())", **SHARED_STORE
    )
    assert out == "True"


@pytest.mark.parametrize(
    "env, safe",
    [
        ({}, "None"),  # no torchrun
        ({"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_USE_AGENT_STORE": "False"}, "True"),  # a store per attempt
        ({**SHARED_STORE, "SIDECAR_ATTEMPT_STORE": "0"}, "False"),  # the remedy switched off
    ],
)
def test_without_the_shared_store_or_with_the_switch_off_nothing_is_installed(env, safe):
    out = python(
        "import torch, trainer_hooks\nfrom trainer_hooks import distributed as d\n"
        "print(d.installed(), d.restart_safety())",
        **env,
    )
    assert out == f"False {safe}"


# With TORCHELASTIC_USE_AGENT_STORE=True the workers connect to the agent's store server as clients:
# this process plays the agent too.
FORM_GROUP = (
    "import torch.distributed as dist\n"
    "agent = dist.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False)\n"
    "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=0, world_size=1)\n"
)


def test_a_group_formed_after_the_hooks_were_imported_is_restart_safe():
    out = python(
        "import trainer_hooks\nfrom trainer_hooks import distributed as d\n"
        + FORM_GROUP.format(port=free_port())
        + "print(d.generation(), d.restart_safety())",
        **SHARED_STORE,
    )
    assert out == "1 True"


def test_a_group_formed_before_the_hooks_were_imported_is_not_restart_safe():
    out = python(
        FORM_GROUP.format(port=free_port())
        + "import trainer_hooks\nfrom trainer_hooks import distributed as d\nprint(d.generation(), d.restart_safety())",
        **SHARED_STORE,
    )
    assert out == "None False"


@pytest.mark.parametrize("value", [True, False, None])
def test_the_sidecar_reads_restart_safe_from_a_registration(value):
    assert parse_registration({**REGISTRATION, "restart_safe": value}).restart_safe is value


def test_a_registration_without_restart_safe_is_accepted_as_not_said():
    assert parse_registration(dict(REGISTRATION)).restart_safe is None


@pytest.mark.parametrize("value", ["yes", 1, {"safe": True}])
def test_a_restart_safe_that_is_not_a_boolean_is_refused_naming_it(value):
    with pytest.raises(ProtocolError) as e:
        parse_registration({**REGISTRATION, "restart_safe": value})
    assert str(e.value).startswith("restart_safe:") and e.value.status == 400
