"""Config values typed by the schema: each dataclass field's annotation says what a value may be.

PyYAML follows YAML 1.1, where `3e-4` (no dot) and `1_000` are strings; `--lr 3e-4` on the command
line and `lr: 3e-4` in a file must still mean the number. So every value is converted here, by the
type of the field it lands in, before a config dataclass sees it:

- `int`: an integer, or text/float that is one exactly (`1_000`, `1e3`, `64.0`); never a bool;
- `float`: any finite number or numeric text (`3e-4`, `1_000`, `.5`);
- `bool`: true/false (YAML's spellings);
- `str`: text, or a number as its text (`corpus: 2024`); an override of a plain `str` field keeps its
  raw text (`--data.corpus 010` stays "010"), and so does one of a `str | None` field but for
  YAML's null spellings (`null`, `~`, empty), which give None;
- `Any`: the value as it is;
- `X | Y`: text goes to a `str` member first, None to a `None` member; otherwise the first member
  that takes the value, in order;
- `list[X]`, `dict[K, V]`: a list / mapping, checked member by member.

One table holds a converter per type (`_CONVERTERS`, keyed by the type or, for `list[...]` and
`dict[...]`, by its origin); `coerce` walks an annotation with `typing.get_origin`/`get_args`.
A value its type does not take raises one `ValueError` line naming the field, the value and what
is allowed; an annotation with no converter raises TypeError.
"""

from __future__ import annotations

import math
import types
import typing
from contextlib import suppress
from dataclasses import fields
from typing import Any

import yaml

_NO = object()  # a converter's answer for a value its type does not take
_WHAT = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null",
         list: "a list", dict: "a mapping"}
_LIKE = {int: " (like 1000, 1_000 or 1e3)", float: " (like 3e-4, 0.1 or 1_000)", list: " like [a, b]"}


def field_types(section: type) -> dict[str, Any]:
    """{field name: resolved annotation} of a config dataclass, in field order."""
    hints = typing.get_type_hints(section)
    return {f.name: hints[f.name] for f in fields(section)}


def coerce_section(prefix: str, types_by_name: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each key in `types_by_name` converted to its type, named `prefix.key` in errors
    (unknown keys pass through, for the section's own unknown-key error).

    Raises ValueError when `values` is not a mapping, or as `coerce` does."""
    if not isinstance(values, dict):
        raise ValueError(f"config section {prefix!r} must be a mapping of keys to values; got {values!r}")
    return {key: coerce(f"{prefix}.{key}", value, types_by_name[key]) if key in types_by_name else value
            for key, value in values.items()}


_NULLS = ("", "~", "null", "Null", "NULL")  # YAML 1.1's spellings of null


def parse_override(name: str, raw: str, annotation: Any) -> Any:
    """The value of `--name raw`: a `str` field keeps the text (a `str | None` field reads YAML's
    null spellings as None); any other reads it as YAML first, then `coerce`s it. Raises ValueError
    when `raw` is no YAML, or as `coerce` does."""
    if annotation is str or set(typing.get_args(annotation)) == {str, type(None)}:
        return None if annotation is not str and raw.strip() in _NULLS else raw
    try:
        return coerce(name, yaml.safe_load(raw), annotation)
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or "not valid YAML"
        raise ValueError(f"{name}: cannot read {raw!r} ({problem})") from None


def coerce(name: str, value: Any, annotation: Any) -> Any:
    """`value` as `annotation` says (see the module docstring).

    Raises ValueError naming `name`, the value and what is allowed; TypeError for an annotation
    the table has no converter for."""
    kind, args = typing.get_origin(annotation) or annotation, typing.get_args(annotation)
    if kind in (types.UnionType, typing.Union):
        return _union(name, value, args)
    if kind not in _CONVERTERS or kind in (list, dict) and not args:
        raise TypeError(f"{name}: config fields of type {annotation!r} are not supported")
    result = _CONVERTERS[kind](name, value, *args)
    if result is _NO:
        like = " like {local: {window: 64}}" if kind is dict and typing.get_origin(args[1]) is dict else ""
        raise ValueError(f"{name} must be {_WHAT[kind]}{_LIKE.get(kind, like)}; got {value!r}")
    return result


def _union(name: str, value: Any, members: tuple[Any, ...]) -> Any:
    """`value` as the first member of the union that takes it (text: `str` first; None: `None`)."""
    if value is None and type(None) in members or isinstance(value, str) and str in members:
        return value
    for member in (member for member in members if member is not type(None)):
        with suppress(ValueError):
            return coerce(name, value, member)
    raise ValueError(f"{name} must be {' or '.join(map(_describe, members))}; got {value!r}")


def _describe(annotation: Any) -> str:
    """What a value of `annotation` looks like in a union's error: "a list of strings", "null"."""
    if typing.get_origin(annotation) is list:
        return f"a list of {_describe(typing.get_args(annotation)[0]).removeprefix('a ')}s"
    return _WHAT.get(typing.get_origin(annotation) or annotation, str(annotation))


def _number(name: str, value: Any) -> int | float | None:
    """The int or float `value` is (never a bool) or spells (`3e-4`, `1_000`, ` 12 `; an int when int()
    reads the text, else a float when float() does); None for anything else.

    Raises ValueError naming `name` for a non-finite float (`nan`, `.inf`, `1e999`)."""
    if isinstance(value, str):
        for parse in (int, float):
            with suppress(ValueError):
                value = parse(value.strip())
                break
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number; got {value!r}")
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# {type, or origin of list[...] / dict[...]: converter(name, value, *type arguments) -> the value as that
# type, or _NO when that type does not take it}
_CONVERTERS: dict[Any, typing.Callable[..., Any]] = {
    Any: lambda name, v: v,
    bool: lambda name, v: v if isinstance(v, bool) else _NO,
    str: lambda name, v: str(v) if isinstance(v, (str, int, float)) and not isinstance(v, bool) else _NO,
    int: lambda name, v: _NO if (n := _number(name, v)) is None or n != int(n) else int(n),
    float: lambda name, v: _NO if (n := _number(name, v)) is None else float(n),
    list: lambda name, v, item: [coerce(f"{name}[{i}]", member, item) for i, member in enumerate(v)]
    if isinstance(v, list) else _NO,
    dict: lambda name, v, key, item: {coerce(f"{name} key", k, key): coerce(f"{name}.{k}", member, item)
                                      for k, member in v.items()} if isinstance(v, dict) else _NO,
}


def coerce_attention_options(options: Any) -> Any:
    """model.attention_options with numeric text (`window: 3e1`, `temperature: 1e-2`) read as the
    number the option's default says: a float default gives a float, an int default an int when the
    number is whole (else the number as read). Everything else passes through for the layer to check
    (its error names the option): numbers, non-numeric or non-finite text, options whose default is
    no number (bool, None, text), options and mechanisms that are not registered, a non-mapping."""
    if not isinstance(options, dict):
        return options
    from routeformer.attention.registry import list_attentions

    known = list_attentions()
    return {mechanism: {key: _numeric_text(value, known.get(mechanism, {}).get(key))
                        for key, value in values.items()} if isinstance(values, dict) else values
            for mechanism, values in options.items()}


def _numeric_text(value: Any, default: Any) -> Any:
    """`value` as a number of `default`'s type when it is finite numeric text and `default` a number
    (not a bool); otherwise `value` unchanged."""
    if not isinstance(value, str) or isinstance(default, bool) or not isinstance(default, (int, float)):
        return value
    with suppress(ValueError):  # non-finite text stays text
        if (number := _number("option", value)) is not None:
            return float(number) if isinstance(default, float) or number != int(number) else int(number)
    return value
