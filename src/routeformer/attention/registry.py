"""Attention mechanisms by name: `register_attention`, `build_attention`, `list_attentions`.

A mechanism's options are the keyword arguments of its constructor beyond (dim, heads, causal);
`build_attention` checks them and names the valid ones when a user gets one wrong.

What callers ask of a mechanism is asked of its class (`attention_class(name)`), never of its name:
the traits declared where it is registered (`is_baseline`, `needs_meta_tokens`, `grid_aware`,
`every_parameter_used`), and
what the class itself knows (`supports_cache`, `budget_options(seq_len, keys)`, and on a built
layer `decode_read_bytes(cache)`). `baseline_first` / `with_baseline` hold the one definition of
"the baseline goes first".
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

_REGISTRY: dict[str, type[nn.Module]] = {}
_CORE_ARGUMENTS = ("dim", "heads", "causal")


def register_attention(
    name: str, *, baseline: bool = False, needs_meta_tokens: bool = False, grid_aware: bool = False,
    every_parameter_used: bool = False,
) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: make the layer buildable as `build_attention(name, ...)`.

    The keywords declare the mechanism's traits, set on the class (each registered class gets its
    own, never its parent's: `gated` derives from `full` but is not the baseline):
    - `baseline` (`is_baseline`): the mechanism the others are measured against (ratios "vs full",
      listed first); one registered mechanism at most;
    - `needs_meta_tokens`: it reads meta-tokens a task injects, so it trains on tasks that inject
      them (the LM) and its models get a `meta_token_id`;
    - `grid_aware`: a ViT tells it the patch grid and the CLS token (options `grid`, `extra_tokens`);
    - `every_parameter_used`: every parameter takes part in every forward (no data-dependent choice
      of experts or projections), so DDP can skip its unused-parameter search (train/distributed.py;
      tests/train/test_distributed.py checks it of every mechanism that declares it).
    """

    def decorate(cls: type[nn.Module]) -> type[nn.Module]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"attention name {name!r} is already registered by {_REGISTRY[name]}")
        if baseline:
            others = [other for other, klass in _REGISTRY.items()
                      if other != name and getattr(klass, "is_baseline", False)]
            if others:
                raise ValueError(f"attention {name!r} cannot be the baseline: {others[0]!r} already is")
        _REGISTRY[name] = cls
        cls.attention_name = name
        cls.is_baseline = baseline
        cls.needs_meta_tokens = needs_meta_tokens
        cls.grid_aware = grid_aware
        cls.every_parameter_used = every_parameter_used
        return cls

    return decorate


def attention_class(name: str) -> type[nn.Module]:
    """The class registered as `name` (ValueError listing the registered ones if none is)."""
    return _get(name)


def baseline_name() -> str:
    """The registered baseline mechanism (`register_attention(..., baseline=True)`: `full`)."""
    _load_builtin_layers()
    names = [name for name, cls in _REGISTRY.items() if cls.is_baseline]
    if not names:
        raise ValueError(f"no registered attention is the baseline; registered: {sorted(_REGISTRY)}")
    return names[0]


def baseline_first(names: Iterable[str]) -> list[str]:
    """`names` with the baseline moved to the front (if present), the others in their order."""
    baseline = baseline_name()
    return sorted(names, key=lambda name: name != baseline)


def with_baseline(names: Iterable[str]) -> list[str]:
    """The baseline, then the other `names` in their order: the baseline is always measured."""
    baseline = baseline_name()
    return [baseline, *[name for name in names if name != baseline]]


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
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool (True or False); got {causal!r}")
    for option, value in options.items():
        if isinstance(valid[option], bool) and not isinstance(value, bool):
            raise TypeError(f"option {option!r} of attention {name!r} must be a bool (True or False); "
                            f"got {value!r}")
    return cls(dim=dim, heads=heads, causal=causal, **options)


def _get(name: str) -> type[nn.Module]:
    _load_builtin_layers()
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def _load_builtin_layers() -> None:
    # Importing the package registers the built-in layers; done lazily to avoid an import cycle.
    import routeformer.attention  # noqa: F401
