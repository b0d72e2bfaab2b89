"""Config values typed by the schema: each dataclass field's annotation says what a value may be.

PyYAML follows YAML 1.1, where `3e-4` (no dot) and `1_000` are strings; `--lr 3e-4` on the command
line and `lr: 3e-4` in a file must still mean the number. So every value is converted here, by the
type of the field it lands in, before a config dataclass sees it:

- `int`: an integer, or text/float that is one exactly (`1_000`, `1e3`, `64.0`); never a bool;
- `float`: any finite number or numeric text (`3e-4`, `1_000`, `.5`);
- `bool`: true/false (YAML's spellings);
- `str`: text; an override's raw text is kept as typed (`--out_dir 010` stays "010");
- `X | None`, `str | list[str]`, `list[str]`, `dict[str, dict[str, Any]]`: checked member by member.

Anything else raises one `ValueError` line naming the field, the value and what is allowed.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import fields
from typing import Any

import yaml

_HINTS = {"an integer": "like 1000, 1_000 or 1e3", "a number": "like 3e-4, 0.1 or 1_000"}


def field_types(section: type) -> dict[str, Any]:
    """{field name: resolved annotation} of a config dataclass."""
    hints = typing.get_type_hints(section)
    return {f.name: hints[f.name] for f in fields(section)}


def coerce_section(prefix: str, types_by_name: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each key in `types_by_name` converted to its type (unknown keys pass through,
    for the section's own unknown-key error)."""
    if not isinstance(values, dict):
        raise ValueError(f"config section {prefix!r} must be a mapping of keys to values; got {values!r}")
    return {key: coerce(f"{prefix}.{key}", value, types_by_name[key]) if key in types_by_name else value
            for key, value in values.items()}


def parse_override(name: str, raw: str, annotation: Any) -> Any:
    """The value of `--name raw`: plain `str` fields keep the text; others read it as YAML first."""
    if annotation is str:
        return raw
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or "not valid YAML"
        raise ValueError(f"{name}: cannot read {raw!r} ({problem})") from None
    return coerce(name, value, annotation)


def coerce(name: str, value: Any, annotation: Any) -> Any:
    """`value` as `annotation` says, or ValueError naming `name`, the value and what is allowed."""
    origin = typing.get_origin(annotation)
    if origin in (types.UnionType, typing.Union):
        return _coerce_union(name, value, typing.get_args(annotation))
    if annotation is Any:
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{name} must be true or false; got {value!r}")
    if annotation is int:
        return _to_int(name, value)
    if annotation is float:
        return _to_float(name, value)
    if annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `out_dir: 2024` in a file
        raise ValueError(f"{name} must be a string; got {value!r}")
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ValueError(f"{name} must be a list like [a, b]; got {value!r}")
        return [coerce(f"{name}[{i}]", element, item) for i, element in enumerate(value)]
    if origin is dict:
        key_type, item = typing.get_args(annotation)
        if not isinstance(value, dict):
            example = " like {local: {window: 64}}" if typing.get_origin(item) is dict else ""
            raise ValueError(f"{name} must be a mapping{example}; got {value!r}")
        return {coerce(f"{name} key", key, key_type): coerce(f"{name}.{key}", element, item)
                for key, element in value.items()}
    raise TypeError(f"{name}: config fields of type {annotation!r} are not supported")


def _coerce_union(name: str, value: Any, members: tuple[Any, ...]) -> Any:
    if value is None and type(None) in members:
        return None
    concrete = [member for member in members if member is not type(None)]
    if isinstance(value, str) and str in concrete:
        return value
    for member in concrete:
        try:
            return coerce(name, value, member)
        except ValueError:
            continue
    allowed = " or ".join(_describe(member) for member in members)
    raise ValueError(f"{name} must be {allowed}; got {value!r}")


def _describe(annotation: Any) -> str:
    """What a value of `annotation` looks like, for error messages."""
    origin = typing.get_origin(annotation)
    if origin is list:
        return f"a list of {_describe(typing.get_args(annotation)[0]).removeprefix('a ')}s"
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            type(None): "null"}.get(annotation, str(annotation))


def _number(name: str, value: Any, kind: str) -> float | int:
    """An int/float from a number or numeric text (`3e-4`, `1_000`); bools and the rest refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{name} must be {kind} ({_HINTS[kind]}); got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{name} must be {kind} ({_HINTS[kind]}); got {value!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number; got {value!r}")
    return value


def _to_int(name: str, value: Any) -> int:
    number = _number(name, value, "an integer")
    if isinstance(number, float):
        if not number.is_integer():
            raise ValueError(f"{name} must be an integer ({_HINTS['an integer']}); got {value!r}")
        number = int(number)
    return number


def _to_float(name: str, value: Any) -> float:
    return float(_number(name, value, "a number"))


def coerce_attention_options(options: Any) -> Any:
    """model.attention_options with numeric text (`window: 3e1`, `temperature: 1e-2`) read as the
    number the option's default says (int or float); other values pass through for the layer to
    check (its error names the option). Options of unknown mechanisms pass through too."""
    if not isinstance(options, dict):
        return options
    from routeformer.attention.registry import attention_options

    typed = {}
    for mechanism, values in options.items():
        try:
            defaults = attention_options(mechanism)
        except ValueError:
            defaults = {}
        if isinstance(values, dict):
            values = {key: _numeric_text(value, defaults.get(key)) for key, value in values.items()}
        typed[mechanism] = values
    return typed


def _numeric_text(value: Any, default: Any) -> Any:
    """`value` as a number of `default`'s type when it is numeric text; otherwise unchanged."""
    if not isinstance(value, str) or isinstance(default, bool) or not isinstance(default, (int, float)):
        return value
    try:
        number = _number("option", value, "a number")
    except ValueError:
        return value
    if isinstance(default, float):
        return float(number)
    return int(number) if isinstance(number, float) and number.is_integer() else number
