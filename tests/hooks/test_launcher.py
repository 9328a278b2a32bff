"""Whether the rank's launcher restarts it once killed travels at registration (`launcher`,
wire protocol 2): the hooks read torchrun's variables, the sidecar parses them, and a
registration without them (hooks of protocol 1) is still accepted, as "not said"."""

from __future__ import annotations

import pytest

from sidecar.ranks.protocol import Launcher, ProtocolError, parse_registration
from trainer_hooks import environment

TORCHRUN_WORKER = {"TORCHELASTIC_RUN_ID": "run-42", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "1"}
REGISTRATION = {"job_id": "run-42", "rank": 0, "world_size": 1, "pid": 1234}


def test_a_torchrun_worker_names_torchrun_and_its_restart_budget():
    ident = environment.identity(TORCHRUN_WORKER)
    assert ident.launcher == environment.Launcher("torchrun", 3) and ident.restart_count == 1


def test_a_process_torchrun_did_not_start_has_no_launcher():
    assert environment.identity({"RANK": "0", "WORLD_SIZE": "1"}).launcher == environment.Launcher("none")


def test_a_torchrun_that_does_not_give_its_budget_is_torchrun_with_an_unknown_budget():
    launcher = environment.launcher({"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_MAX_RESTARTS": "many"})
    assert launcher == environment.Launcher("torchrun", None)


def test_the_sidecar_reads_the_launcher_the_hooks_send():
    sent = environment.identity(TORCHRUN_WORKER).launcher.as_wire()
    assert parse_registration({**REGISTRATION, "launcher": sent}).launcher == Launcher("torchrun", 3)
    none = environment.Launcher("none").as_wire()
    assert parse_registration({**REGISTRATION, "launcher": none}).launcher == Launcher("none", None)


def test_a_registration_without_a_launcher_is_accepted_as_not_said():
    assert parse_registration(dict(REGISTRATION)).launcher is None
    assert parse_registration({**REGISTRATION, "launcher": None}).launcher is None


@pytest.mark.parametrize(
    "launcher, field",
    [
        ({"name": "slurm"}, "launcher.name"),
        ({"max_restarts": 3}, "launcher.name"),
        ({"name": "torchrun", "max_restarts": -1}, "launcher.max_restarts"),
        ({"name": "torchrun", "max_restarts": "3"}, "launcher.max_restarts"),
        ("torchrun", "launcher"),
    ],
)
def test_a_malformed_launcher_is_refused_naming_the_field(launcher, field):
    with pytest.raises(ProtocolError) as e:
        parse_registration({**REGISTRATION, "launcher": launcher})
    assert str(e.value).startswith(field + ":") and e.value.status == 400, str(e.value)
