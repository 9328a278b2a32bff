"""The wire contract (trainer_hooks/wire.py) is defined once, both sides use it, and it does not
change without its protocol version changing."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from trainer_hooks import wire

# protocol version -> the fingerprint of the contract it names. A change to wire.py's constants
# changes the fingerprint: bump wire.PROTOCOL_VERSION and add the new pair here.
PINNED = {
    1: "95e2a8ad6b11b67f",
    2: "e7d1122c50241be7",
    3: "603d52117a16c850",
    4: "37705c1f6281d32b",
    5: "d4120c123f532cd8",
    6: "ea85157531a62a1e",  # (6 had not landed when STEP_GAP_SEND_SECONDS, then OBSERVE_ONLY joined it)
    7: "f6f85674e615ff73",
    8: "e957f3738b00dd4f",
    9: "3bfa4a306ed3e63c",
}


def fingerprint() -> str:
    return hashlib.sha256(json.dumps(wire.contract(), sort_keys=True).encode()).hexdigest()[:16]


def test_the_contract_does_not_change_without_a_new_protocol_version():
    got = fingerprint()
    pinned = PINNED.get(wire.PROTOCOL_VERSION)
    assert pinned == got, (
        f"the wire contract (trainer_hooks/wire.py) has fingerprint {got}, but protocol version "
        f"{wire.PROTOCOL_VERSION} is pinned to {pinned}. If the change is meant, bump PROTOCOL_VERSION in "
        f"trainer_hooks/wire.py, describe it in docs/architecture/wire-protocol.md (the wire protocol) and add "
        f"{{{wire.PROTOCOL_VERSION + 1 if pinned else wire.PROTOCOL_VERSION}: {got!r}}} to PINNED in "
        f"tests/hooks/test_wire_contract.py; a pinned version's contract never changes."
    )


def test_the_fingerprint_sees_every_kind_of_constant(monkeypatch):
    before = fingerprint()
    for name, value in (
        ("MAX_EVENT_FIELDS", 17),
        ("WELL_KNOWN_METRICS", wire.WELL_KNOWN_METRICS | {"x"}),
        ("POD_LABEL_RULES", {**wire.POD_LABEL_RULES, "pod": wire.POD_LABEL_RULES["namespace"]}),
        ("NAME_RE", __import__("re").compile(r"[a-z]+\Z")),
    ):
        with monkeypatch.context() as m:
            m.setattr(wire, name, value)
            assert fingerprint() != before, name
    assert fingerprint() == before


def test_both_sides_use_the_one_contract():
    from sidecar import config
    from sidecar.ranks import podlabels, protocol, push, registry, slurmjob
    from trainer_hooks import environment, exits, records

    assert protocol.NAME_RE is push.NAME_RE is records.NAME_RE is wire.NAME_RE
    assert push.MAX_EVENT_FIELDS == records.MAX_EVENT_FIELDS == wire.MAX_EVENT_FIELDS
    assert registry.WELL_KNOWN_METRICS is records.WELL_KNOWN_METRICS is wire.WELL_KNOWN_METRICS
    assert registry.WELL_KNOWN_PHASES is wire.WELL_KNOWN_PHASES
    assert podlabels.RULES is wire.POD_LABEL_RULES and podlabels.KEYS is wire.POD_LABEL_KEYS
    assert slurmjob.RULES is wire.SLURM_LABEL_RULES and slurmjob.KEYS is wire.SLURM_LABEL_KEYS
    assert {key for _, key in environment.SLURM_VARIABLES} == set(wire.SLURM_LABEL_KEYS)
    assert {label: n for _, label, n in environment.POD_VARIABLES} == {
        k: rule[1] for k, rule in wire.POD_LABEL_RULES.items()
    }
    assert (exits.MAX_TEXT, exits.MAX_FRAMES, exits.MAX_TYPES) == (
        protocol.EXIT_MAX_TEXT,
        protocol.EXIT_MAX_FRAMES,
        protocol.EXIT_MAX_TYPES,
    )
    limits = config.LimitSettings()
    assert (limits.max_custom_metrics, limits.max_phases) == (wire.MAX_CUSTOM_METRICS, wire.MAX_PHASES)
    assert records.Encoder().max_custom_metrics == limits.max_custom_metrics


def test_the_contract_needs_only_the_standard_library():
    """The hooks ship alone (packaging/hooks/): the system's bare Python imports the contract,
    and nothing of the daemon comes with it."""
    root = str(Path(wire.__file__).resolve().parent.parent)
    code = (
        f"import sys; sys.path.insert(0, {root!r}); import trainer_hooks.wire; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('sidecar', 'aiohttp', 'prometheus_client', "
        "'yaml', 'psutil', 'msgspec')]; print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run(["/usr/bin/python3", "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
