"""The sidecar's settings: precedence, typing by schema, one-line errors, generated reference."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sidecar.commands.config_doc import reference_markdown
from sidecar.config import ConfigError, load_settings, settings_from_args

ROOT = Path(__file__).resolve().parent.parent


def args(*sets: str, config: str | None = None, listen: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(set=list(sets), config=config, listen=listen, socket=None)


def test_defaults_are_valid_and_listen_on_loopback():
    s = load_settings(environ={})
    assert (s.listen_host, s.listen_port) == ("127.0.0.1", 9402)
    assert not s.requires_token()


def test_flag_beats_environment_beats_file(tmp_path, monkeypatch):
    cfg = tmp_path / "s.yml"
    cfg.write_text("watchdog:\n  floor_seconds: 3\n  ceiling_seconds: 100\nlisten: 127.0.0.1:1000\n")
    monkeypatch.setenv("SIDECAR_WATCHDOG_FLOOR_SECONDS", "4")
    monkeypatch.setenv("SIDECAR_LISTEN", "127.0.0.1:2000")
    s = settings_from_args(args("watchdog.floor_seconds=5", config=str(cfg)))
    assert s.watchdog.floor_seconds == 5.0  # flag
    assert s.listen == "127.0.0.1:2000"  # env over file
    assert s.watchdog.ceiling_seconds == 100.0  # file over default


def test_octal_socket_mode_survives_yaml_and_flags(tmp_path):
    cfg = tmp_path / "s.yml"
    cfg.write_text("socket_mode: 0640\n")
    assert load_settings(str(cfg), environ={}).socket_mode_int == 0o640
    assert settings_from_args(args("socket_mode=0600")).socket_mode_int == 0o600


def test_lists_and_mappings_from_strings():
    s = settings_from_args(args("collectors.enabled=gpu,nic", "watchdog.phase_timeouts={eval: 5}"))
    assert s.collectors.enabled == ["gpu", "nic"]
    assert s.watchdog.phase_timeouts == {"eval": 5.0}


@pytest.mark.parametrize(
    "setting, fragment",
    [
        ("watchdog.floor_seconds=-1", "setting watchdog.floor_seconds: must be > 0"),
        ("watchdog.floor_seconds=abc", "setting watchdog.floor_seconds: expected a number"),
        ("watchdog.ceiling_seconds=1", "setting watchdog.ceiling_seconds: must be >= watchdog.floor_seconds"),
        ("watchdog.quantile=2", "setting watchdog.quantile"),
        ("watchdog.nonsense=1", "setting watchdog.nonsense: unknown setting"),
        ("collectors.enabled=gpu,disk", "unknown collector(s) disk"),
        ("collectors.gpu_source=nvidia", "setting collectors.gpu_source: expected sidecar or dcgm, got 'nvidia'"),
        ("listen=nowhere", "setting listen: expected HOST:PORT"),
        ("socket_mode=999", "setting socket_mode: expected an octal mode"),
        ("watchdog.observe_only=maybe", "expected true or false"),
    ],
)
def test_bad_settings_raise_one_line_naming_the_setting(setting, fragment):
    with pytest.raises(ConfigError) as err:
        settings_from_args(args(setting))
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_unreadable_and_invalid_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(str(tmp_path / "missing.yml"), environ={})
    bad = tmp_path / "bad.yml"
    bad.write_text("watchdog: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(str(bad), environ={})


def test_token_comes_from_environment_or_file_never_a_flag(tmp_path, monkeypatch):
    monkeypatch.delenv("SIDECAR_TOKEN", raising=False)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    s = load_settings(overrides={"token_file": str(token), "listen": "0.0.0.0:9402"}, environ={})
    assert s.requires_token() and s.push_token() == "s3cret"
    monkeypatch.setenv("SIDECAR_TOKEN", "from-env")
    assert s.push_token() == "from-env"


def test_settings_reference_is_current():
    doc = ROOT / "docs" / "configuration.md"
    assert doc.exists() and doc.read_text() == reference_markdown(), (
        "docs/configuration.md is stale: run `sidecar config-doc --write docs/configuration.md`"
    )


def test_an_empty_list_can_be_given_as_a_flag():
    assert settings_from_args(args("collectors.enabled=[]")).collectors.enabled == []
    assert settings_from_args(args("collectors.enabled=[gpu, nic]")).collectors.enabled == ["gpu", "nic"]


def test_a_missing_procfs_root_is_refused_at_start_with_one_line(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "run",
            "--listen",
            "127.0.0.1:0",
            "--socket",
            str(tmp_path / "s.sock"),
            "--set",
            f"collectors.procfs_root={tmp_path / 'nope'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"sidecar: setting collectors.procfs_root: '{tmp_path / 'nope'}' is not a directory"
    ]


def test_a_step_floor_shorter_than_the_hooks_flush_interval_is_refused():
    with pytest.raises(ConfigError, match="setting watchdog.floor_seconds: must be at least 2 x hooks_flush"):
        settings_from_args(args("watchdog.floor_seconds=2", "hooks_flush_interval_seconds=1"))
    settings = settings_from_args(args("watchdog.floor_seconds=2", "hooks_flush_interval_seconds=0.5"))
    assert settings.watchdog.floor_seconds == 2
