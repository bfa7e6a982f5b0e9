"""Strict YAML loading of (nested) frozen config dataclasses: `load_config`, `config_from_dict`.

Unknown keys, duplicate keys, wrong types, NaN and ints past 64 bits are errors that name the key
and the file; the dataclass's own checks (`__post_init__`) run last and their errors are prefixed
with the file. Tags never execute (PyYAML's SafeLoader underneath).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from jpaged.config.checks import show

T = TypeVar("T")


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader (tags never execute, no Python object is built) that refuses duplicate
    keys and reads YAML 1.2 floats such as `1e20` or `1.5e3` as floats: YAML 1.1, PyYAML's dialect,
    reads them as strings, and `num_blocks: 1e20` would then be "a str"."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden by own keys
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first_line:
                    raise ValueError(f"{key_node.start_mark.name}: line {line}: duplicate key {key!r} "
                                     f"(first on line {first_line[key]})")
                first_line[key] = line
            except TypeError:  # an unhashable key: SafeLoader reports it below
                continue
        return super().construct_mapping(node, deep)


_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))

_INT64 = 2**63


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Checks `value` against the annotation `tp` and converts nested dataclasses."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"{source}: {key} must be a mapping, got {type(value).__name__}")
        return _build(tp, value, source, prefix=f"{key}.")
    if origin is Literal:
        if not any(type(value) is type(c) and value == c for c in typing.get_args(tp)):
            raise ValueError(f"{source}: {key} must be one of {list(typing.get_args(tp))}, got {show(value)}")
        return value
    if origin in (typing.Union, types.UnionType):
        arms = [arm for arm in typing.get_args(tp) if arm is not type(None)]
        if value is None and len(arms) < len(typing.get_args(tp)):
            return None
        if len(arms) == 1:  # an optional X: a value that is not None is checked as an X, with X's error
            return _coerce(value, arms[0], key, source)
        errors = []
        for arm in arms:
            try:
                return _coerce(value, arm, key, source)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        raise TypeError(f"{source}: {key} has the wrong type: {'; '.join(errors) or type(value).__name__}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{source}: {key} must be a list, got {type(value).__name__}")
        args = typing.get_args(tp)
        item_type = args[0] if args else Any
        items = [_coerce(v, item_type, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"{source}: {key} must be a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    if tp in (int, float) and isinstance(value, bool):
        raise TypeError(f"{source}: {key} must be {_type_name(tp)}, got bool")
    if tp is float and isinstance(value, int):
        value = float(value) if -_INT64 < value < _INT64 else value
    if tp is float and isinstance(value, float) and math.isnan(value):
        raise ValueError(f"{source}: {key} must be a number, got nan")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise TypeError(f"{source}: {key} must be {_type_name(tp)}, got {type(value).__name__} ({show(value)})")
    if tp is int and not -_INT64 <= value < _INT64:
        raise ValueError(f"{source}: {key} must fit in 64 bits, got {value}")
    return value


def _build(cls: type[T], data: dict, source: str, prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(prefix + k for k in unknown)}; "
                         f"allowed: {', '.join(sorted(fields))}")
    kwargs = {name: _coerce(value, hints[name], prefix + name, source) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise (TypeError if isinstance(exc, TypeError) else ValueError)(f"{source}: {exc}") from exc


def config_from_dict(cls: type[T], data: dict, source: str = "<dict>") -> T:
    """Builds dataclass `cls` from a plain mapping with the same strict checks as `load_config`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TypeError(f"{source}: must be a mapping, got {type(data).__name__}")
    return _build(cls, data, source)


def load_config(path: str | Path, cls: type[T]) -> T:
    """Loads YAML at `path` into dataclass `cls`; unknown keys, duplicate keys, wrong types and values
    out of range raise, naming the key and the file."""
    path = Path(path)
    with path.open("rb") as f:  # bytes: PyYAML decodes and reports bad encodings with the file's name
        try:
            data = yaml.load(f, Loader=_StrictLoader)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TypeError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return _build(cls, data, str(path))


def config_to_dict(config: Any) -> dict:
    """A plain, YAML/JSON-ready dict of a (nested) config dataclass."""
    return dataclasses.asdict(config)
