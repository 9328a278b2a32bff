"""Typing a tree of settings by a schema of nested dataclasses: the loading both the sidecar
(sidecar/config.py) and the bundled trainer (sidecar_trainer/config.py) share.

A program's settings arrive as a tree of plain values (a YAML file, environment variables,
dotted `section.field=value` overrides), are merged in precedence order, then typed field by
field from the dataclass annotations. Every problem goes to the program's own `fail(name,
problem)`, which raises its own error class with one line naming the dotted field.
Stdlib and PyYAML only: the sidecar must not import torch.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def merge(base: dict, over: Mapping) -> dict:
    """Deep-merge `over` into `base` (sections merge, values replace); returns `base`."""
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            merge(base[k], v)
        else:
            base[k] = v
    return base


@dataclass(frozen=True)
class SettingsTree:
    """How one program reads its settings tree."""

    fail: Callable[[str, str], NoReturn]  # raises the program's error for (dotted name, problem)
    loader: type = yaml.BaseLoader  # reads YAML text: the file, and lists/mappings given as text
    noun: str = "setting"  # what errors call a key the schema does not know

    def read_file(self, path: str, name: str) -> dict:
        """The mapping at the top of a YAML file; problems are reported as setting `name`."""
        try:
            loaded = yaml.load(Path(path).read_text(), Loader=self.loader)
        except OSError as e:
            self.fail(name, f"cannot read {path}: {e.strerror}")
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            self.fail(name, f"{path}{f' line {mark.line + 1}' if mark else ''} is not valid YAML")
        if loaded is not None and not isinstance(loaded, dict):
            self.fail(name, f"{path} must hold a mapping at the top")
        return loaded or {}

    def set_path(self, tree: dict, dotted: str, value: Any) -> None:
        """tree["a"]["b"] = value for "a.b", making sections on the way."""
        *sections, leaf = dotted.split(".")
        node = tree
        for i, part in enumerate(sections):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                self.fail(".".join(sections[: i + 1]), "is a value, not a section")
        node[leaf] = value

    def env_overrides(
        self, cls: type, prefix: str, environ: Mapping[str, str], parse: Callable[[str], Any] = str
    ) -> dict:
        """<PREFIX><FIELD> for top-level values and <PREFIX><SECTION>_<FIELD> for the fields of
        sections, as a tree; `parse` turns the text into the value the schema then types."""
        out: dict = {}
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                for sf in dataclasses.fields(hints[f.name]):
                    key = f"{prefix}{f.name}_{sf.name}".upper()
                    if key in environ:
                        self.set_path(out, f"{f.name}.{sf.name}", parse(environ[key]))
            elif (key := f"{prefix}{f.name}".upper()) in environ:
                out[f.name] = parse(environ[key])
        return out

    def load(self, cls: type, tree: dict, *layers: Mapping, overrides: Mapping[str, Any] | None = None) -> Any:
        """`cls` from `tree`, with each of `layers` merged over it, then the dotted `overrides`."""
        for layer in layers:
            merge(tree, layer)
        for dotted, value in (overrides or {}).items():
            self.set_path(tree, dotted, value)
        return self.build(cls, tree)

    def build(self, cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in data if k not in fields)
        if unknown:
            self.fail(
                prefix + unknown[0],
                f"unknown {self.noun}; known in {prefix.rstrip('.') or 'the top level'}: {', '.join(fields)}",
            )
        hints = typing.get_type_hints(cls)
        kwargs = {k: self.coerce(prefix + k, hints[k], v) for k, v in data.items()}
        try:
            return cls(**kwargs)
        except TypeError as e:  # pragma: no cover - guarded by the unknown check
            self.fail(prefix.rstrip(".") or "root", str(e))

    def coerce(self, name: str, tp: Any, value: Any) -> Any:
        """`value` (a string from env or a flag, or what YAML read) as the declared type `tp`."""
        if typing.get_origin(tp) in (typing.Union, types.UnionType):  # Optional[X]
            if value is None:
                return None
            (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
        origin = typing.get_origin(tp)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self.build(tp, self._mapping(name, value, from_text=False), prefix=name + ".")
        if tp is bool:
            if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
                return value.lower() in _TRUE
            if not isinstance(value, bool):
                self.fail(name, f"expected true or false, got {value!r}")
            return value
        if tp is int:
            try:
                if isinstance(value, bool) or not isinstance(value, (int, str)):
                    raise TypeError
                return int(value)
            except (TypeError, ValueError):
                self.fail(name, f"expected an integer, got {value!r}")
        if tp is float:
            try:
                if isinstance(value, bool):
                    raise TypeError
                out = float(value)
            except (TypeError, ValueError):
                self.fail(name, f"expected a number, got {value!r}")
            if not math.isfinite(out):
                self.fail(name, f"expected a finite number, got {value!r}")
            return out
        if tp is str:
            if isinstance(value, (dict, list)):
                self.fail(name, f"expected a string, got {type(value).__name__}")
            return "" if value is None else str(value)
        if origin is list:
            if isinstance(value, str):  # "a,b" or YAML's "[a, b]"
                value = (
                    self._parse(name, value)
                    if value.strip().startswith("[")
                    else [v.strip() for v in value.split(",") if v.strip()]
                )
            if not isinstance(value, list):
                self.fail(name, f"expected a list, got {value!r}")
            (item,) = typing.get_args(tp)
            return [self.coerce(f"{name}[{i}]", item, v) for i, v in enumerate(value)]
        if origin is dict:
            _, vt = typing.get_args(tp)
            return {str(k): self.coerce(f"{name}.{k}", vt, v) for k, v in self._mapping(name, value).items()}
        return value  # Any: as read

    def _mapping(self, name: str, value: Any, from_text: bool = True) -> Mapping:
        if from_text and isinstance(value, str):  # YAML's "{a: 1}" from env or a flag
            value = self._parse(name, value)
        if value is None:  # an empty section
            return {}
        if not isinstance(value, Mapping):
            self.fail(name, f"expected a mapping, got {value!r}")
        return value

    def _parse(self, name: str, text: str) -> Any:
        try:
            return yaml.load(text, Loader=self.loader)
        except yaml.YAMLError:
            self.fail(name, f"cannot parse {text!r} as YAML")
