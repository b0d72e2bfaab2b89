"""Attention mechanisms by name: `register_attention`, `build_attention`, `list_attentions`.

A mechanism's options are the keyword arguments of its constructor beyond (dim, heads, causal);
`build_attention` checks them and names the valid ones when a user gets one wrong.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

_REGISTRY: dict[str, type[nn.Module]] = {}
_CORE_ARGUMENTS = ("dim", "heads", "causal")


def register_attention(name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: make the layer buildable as `build_attention(name, ...)`."""

    def decorate(cls: type[nn.Module]) -> type[nn.Module]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"attention name {name!r} is already registered by {_REGISTRY[name]}")
        _REGISTRY[name] = cls
        cls.attention_name = name
        return cls

    return decorate


def attention_options(name: str) -> dict[str, Any]:
    """The options of mechanism `name` with their defaults.

    A constructor that forwards `**common` to its parent inherits the parent's options too.
    """
    options: dict[str, Any] = {}
    for klass in _get(name).__mro__:
        if "__init__" not in vars(klass):
            continue
        forwards_more = False
        for parameter in inspect.signature(klass.__init__).parameters.values():
            if parameter.kind is parameter.VAR_KEYWORD:
                forwards_more = True
            elif parameter.kind is parameter.VAR_POSITIONAL:
                continue
            elif parameter.name not in ("self", *_CORE_ARGUMENTS) and parameter.name not in options:
                default = parameter.default
                options[parameter.name] = None if default is inspect.Parameter.empty else default
        if not forwards_more:
            break
    return options


def list_attentions() -> dict[str, dict[str, Any]]:
    """Every registered mechanism and its options (with defaults), sorted by name."""
    _load_builtin_layers()
    return {name: attention_options(name) for name in sorted(_REGISTRY)}


def build_attention(name: str, *, dim: int, heads: int, causal: bool = True, **options: Any) -> nn.Module:
    """Build the attention layer registered as `name`."""
    cls = _get(name)
    valid = attention_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for attention {name!r}; valid options: {sorted(valid)}"
        )
    return cls(dim=dim, heads=heads, causal=causal, **options)


def _get(name: str) -> type[nn.Module]:
    _load_builtin_layers()
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def _load_builtin_layers() -> None:
    # Importing the package registers the built-in layers; done lazily to avoid an import cycle.
    import routeformer.attention  # noqa: F401
