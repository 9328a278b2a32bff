"""Configuration: one typed object from file < env < flags; bad settings exit 2 with one line."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from sidecar_trainer.config import Config, ConfigError, help_text, load_config
from tests.trainer.helpers import trainer_cli


def one_error_line(result) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# ---------------------------------------------------------------- as the command line sees it


def test_grad_accum_steps_that_disagree_with_the_batch_sizes_exit_2_naming_the_numbers():
    line = one_error_line(
        trainer_cli(
            "--set",
            "batch.global_batch_size=64",
            "--set",
            "batch.micro_batch_size=8",
            "--set",
            "batch.grad_accum_steps=2",
            env={"WORLD_SIZE": "2"},
        )
    )
    assert "batch: global_batch_size=64 != micro_batch_size 8 x grad_accum_steps 2 x world_size 2 (= 32)" in line


def test_a_global_batch_not_divisible_by_micro_batch_times_world_size_exits_2():
    line = one_error_line(
        trainer_cli("--set", "batch.global_batch_size=60", "--set", "batch.micro_batch_size=8", env={"WORLD_SIZE": "2"})
    )
    assert "global_batch_size=60 is not divisible by micro_batch_size 8 x world_size 2 (= 16)" in line


def test_options_of_the_other_parallel_strategy_exit_2(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("parallel:\n  strategy: ddp\n  fsdp: {reshard_after_forward: false}\n")
    line = one_error_line(trainer_cli("--config", str(cfg)))
    assert "parallel.fsdp: options of strategy fsdp given but parallel.strategy is ddp" in line


def test_an_unknown_field_exits_2_naming_it():
    line = one_error_line(trainer_cli("--set", "parallel.ddp.bucket_size=4"))
    assert "parallel.ddp.bucket_size: unknown field" in line and "bucket_cap_mb" in line


def test_a_model_path_that_does_not_import_exits_2_naming_path_and_import_error():
    line = one_error_line(trainer_cli("--set", "model.factory=no_such_package.models:build"))
    assert "model.factory: cannot import 'no_such_package.models:build'" in line
    assert "ModuleNotFoundError" in line and "no_such_package" in line


def test_help_config_prints_every_field_with_its_documentation():
    result = trainer_cli("--help-config")
    assert result.returncode == 0, result.stderr
    assert "TRAINER_BATCH_GLOBAL_BATCH_SIZE" in result.stdout
    assert "faults.checkpoint_delay_seconds" in result.stdout


# ---------------------------------------------------------------- in process


def test_a_flag_beats_the_environment_which_beats_the_file(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("train: {steps: 10, seed: 1, log_every_steps: 3}\n")
    env = {"TRAINER_TRAIN_STEPS": "20", "TRAINER_TRAIN_SEED": "2"}

    loaded = load_config(str(cfg), {"train.steps": 30}, environ=env)

    assert (loaded.train.steps, loaded.train.seed, loaded.train.log_every_steps) == (30, 2, 3)
    assert loaded.train.device == "auto"  # untouched: the default


def test_grad_accum_steps_is_derived_from_the_batch_sizes_and_world_size():
    cfg = load_config(None, {"batch.global_batch_size": 64, "batch.micro_batch_size": 8}, environ={})
    assert cfg.validate_for(world_size=2) == 4
    assert cfg.validate_for(world_size=8) == 1


def test_the_strategy_gets_its_default_option_block_and_not_the_other():
    cfg = load_config(None, {"parallel.strategy": "fsdp"}, environ={})
    assert cfg.parallel.fsdp is not None and cfg.parallel.ddp is None


@pytest.mark.parametrize(
    "override, field",
    [
        ({"train.steps": 0}, "train.steps"),
        ({"faults.kind": "segfault"}, "faults.kind"),
        ({"checkpoint.keep_last": 0}, "checkpoint.keep_last"),
        ({"optim.lr": "fast"}, "optim.lr"),
    ],
)
def test_a_bad_value_names_its_field(override, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        load_config(None, override, environ={})


def test_every_field_is_documented():
    def undocumented(cls, prefix=""):
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            inner = next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), tp)
            if dataclasses.is_dataclass(inner):
                yield from undocumented(inner, f"{prefix}{f.name}.")
            elif not f.metadata.get("help"):
                yield prefix + f.name

    assert list(undocumented(Config)) == []
    assert "parallel.fsdp.reshard_after_forward" in help_text()
