"""The trainer's configuration: nested dataclasses, one YAML file, `TRAINER_<SECTION>_<FIELD>`
environment variables and `--set section.field=value` flags (flag > env > file > default).

Every field documents itself in `metadata["help"]` (printed by `python -m sidecar_trainer --help-config`).
Each section validates itself in `__post_init__`; anything wrong raises `ConfigError` with one
line that names the field, which `python -m sidecar_trainer` turns into exit status 2.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from sidecar.settings_tree import SettingsTree
from sidecar_trainer.config_checks import (  # noqa: F401  (re-exported)
    ENV_PREFIX,
    ConfigError,
    _check,
    doc,
    fail,
    import_factory,
    world_size_from_env,
)
from sidecar_trainer.config_sections import (  # noqa: F401  (re-exported)
    FAULT_KINDS,
    BatchConfig,
    CheckpointConfig,
    DataConfig,
    DDPOptions,
    EvalConfig,
    FaultConfig,
    FSDPOptions,
    ModelConfig,
    MonitorConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)

    def check_imports(self) -> None:
        """Import the model and dataset factories (slow: they import torch), after the cheap checks."""
        import_factory("model.factory", self.model.factory)
        import_factory("data.factory", self.data.factory)

    def validate_for(self, world_size: int) -> int:
        """Checks that need the world size; returns grad_accum_steps."""
        if self.faults.kind != "none":
            _check(
                "faults.rank",
                self.faults.rank < world_size,
                f"rank {self.faults.rank} does not exist in world_size {world_size}",
            )
        return self.batch.accumulation_for(world_size)


# ---------------------------------------------------------------- loading

# The file and text values read as YAML (safe_load): `1e-3`, `true`, `{hidden: 64}` are typed values.
_TREE = SettingsTree(fail, loader=yaml.SafeLoader, noun="field")


def env_overrides(environ: Mapping[str, str]) -> dict:
    """TRAINER_<SECTION>_<FIELD> for every field of every section (e.g. TRAINER_BATCH_GLOBAL_BATCH_SIZE)."""
    return _TREE.env_overrides(Config, ENV_PREFIX, environ, parse=yaml.safe_load)


def parse_set(items: list[str]) -> dict[str, Any]:
    """`--set section.field=value` flags; values are parsed as YAML (numbers, booleans, mappings)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            fail("--set", f"expected section.field=value, got {item!r}")
        try:
            out[key.strip()] = yaml.safe_load(value) if value else ""
        except yaml.YAMLError:
            fail(key.strip(), f"cannot parse value {value!r}")
    return out


def load_config(
    path: str | None = None, overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> Config:
    """Config from the YAML file < TRAINER_* environment < dotted overrides < defaults underneath."""
    environ = os.environ if environ is None else environ
    tree = _TREE.read_file(path, "--config") if path else {}
    return _TREE.load(Config, tree, env_overrides(environ), overrides=overrides)


def help_text() -> str:
    """Every field with its type, default, environment variable and documentation."""
    lines = [
        "Trainer configuration: YAML file (--config or TRAINER_CONFIG) < environment "
        "TRAINER_<SECTION>_<FIELD> < flags --set section.field=value (values parse as YAML).",
        "",
    ]

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            inner = [a for a in typing.get_args(tp) if a is not type(None)]
            sub = inner[0] if inner and dataclasses.is_dataclass(inner[0]) else tp
            if isinstance(sub, type) and dataclasses.is_dataclass(sub):
                if prefix:
                    lines.append(f"  {prefix}{f.name}: {f.metadata.get('help', '')}")
                else:
                    lines.append(f"[{f.name}]")
                walk(sub, f"{prefix}{f.name}.")
                if not prefix:
                    lines.append("")
                continue
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            env = f"{ENV_PREFIX}{prefix.replace('.', '_')}{f.name}".upper() if prefix.count(".") == 1 else "-"
            lines.append(f"  {prefix}{f.name} (default {default!r}; env {env})")
            lines.append(f"      {f.metadata.get('help', '')}")

    walk(Config, "")
    return "\n".join(lines).rstrip() + "\n"
