"""What the trainer's configuration sections share: `ConfigError`, the field documentation and the
checks each section's `__post_init__` runs (sidecar_trainer/config.py is the public face)."""

from __future__ import annotations

import importlib
import math
import os
import typing
from collections.abc import Callable
from typing import Any

ENV_PREFIX = "TRAINER_"


def world_size_from_env() -> int:
    """The world size torchrun announces (1 without torchrun); known before any rendezvous."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class ConfigError(ValueError):
    """A setting is invalid; the message is one line naming the field and the problem."""


def doc(text: str) -> dict:
    return {"help": text}


def fail(name: str, problem: str) -> typing.NoReturn:
    raise ConfigError(f"{name}: {problem}")


def _check(name: str, ok: bool, problem: str) -> None:
    if not ok:
        fail(name, problem)


def _at_least(name: str, value: float, low: float) -> None:
    _check(name, math.isfinite(value) and value >= low, f"must be >= {low}, got {value!r}")


def _one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    _check(name, value in choices, f"expected one of {', '.join(choices)}, got {value!r}")


def _import_path(name: str, path: str) -> tuple[str, str]:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        fail(name, f"expected an import path 'package.module:factory', got {path!r}")
    return module_name, attr


def import_factory(name: str, path: str) -> Callable[..., Any]:
    """Resolve `package.module:attribute`; a ConfigError names the field, the path and the ImportError."""
    module_name, attr = _import_path(name, path)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an ImportError or whatever the module raises while importing
        fail(name, f"cannot import {path!r}: {type(e).__name__}: {e}")
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            fail(name, f"cannot import {path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    _check(name, callable(obj), f"{path!r} is not callable")
    return obj
