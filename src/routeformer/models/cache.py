"""The state `CausalLM.generate` carries between decoding steps."""

from __future__ import annotations

from dataclasses import dataclass, field

# The mechanisms whose layers can decode incrementally (meta only with a fixed position_scale).
CACHED_MECHANISMS = ("full", "gated", "local", "linear", "meta", "meta_tokens", "mita")
CACHED_DESCRIPTION = "full, gated, local, linear, meta (with position_scale), meta_tokens and mita"


@dataclass
class DecodeCache:
    """Tokens seen so far and one dict per layer, owned by that layer's attention `decode`
    (keys/values, a window's last keys, or a linear-attention state). Start empty:
    `model(prompt, cache=cache)` fills it, then feed one new token per call."""

    length: int = 0
    layers: list[dict] = field(default_factory=list)
