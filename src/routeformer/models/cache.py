"""The state `CausalLM.generate` carries between decoding steps, and which mechanisms have one.

`CACHED_MECHANISMS` is derived from the layers, not kept by hand: a registered mechanism is listed
when its causal layer, built with its default options, says `supports_cache` (a class attribute,
or a property where it depends on the options: meta needs a fixed position_scale, mita a causal
build).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field


@functools.cache
def cached_mechanisms() -> tuple[str, ...]:
    """The registered mechanisms whose causal layer (default options) decodes with a cache."""
    import warnings

    from routeformer.attention import build_attention, list_attentions

    names = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in list_attentions():
            if build_attention(name, dim=16, heads=2, causal=True).supports_cache:
                names.append(name)
    return tuple(names)


def option_dependent(name: str) -> bool:
    """Whether mechanism `name` decides `supports_cache` per instance (from its options)."""
    from routeformer.attention import build_attention

    layer_class = type(build_attention(name, dim=16, heads=2, causal=True))
    return any(isinstance(vars(klass).get("supports_cache"), property) for klass in layer_class.__mro__)


@functools.cache
def cached_description() -> str:
    names = cached_mechanisms()
    conditional = [name for name in names if option_dependent(name)]
    text = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)
    if conditional:
        text += (f" ({', '.join(conditional)} depending on their options: meta needs a fixed "
                 "position_scale, a layer built non-causal has none)")
    return text


def __getattr__(name: str):
    # Lazy: the attention package registers its layers on import, after this module is loaded.
    if name == "CACHED_MECHANISMS":
        return cached_mechanisms()
    if name == "CACHED_DESCRIPTION":
        return cached_description()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class DecodeCache:
    """Tokens seen so far and one dict per layer, owned by that layer's attention `decode`
    (keys/values, a window's last keys, or a linear-attention state). Start empty:
    `model(prompt, cache=cache)` fills it, then feed one new token per call.

    `reserve`: the stream length expected (prompt + new tokens; 0 = unknown). Each layer's dict
    starts as {"reserve": reserve}, and a cache of keys/values is first allocated that long
    (ops/decode.append_rows), so generation never grows it; beyond it, it grows by doubling."""

    length: int = 0
    layers: list[dict] = field(default_factory=list)
    reserve: int = 0
