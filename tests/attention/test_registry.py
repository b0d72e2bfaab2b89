import pytest
import torch

from routeformer.attention import (
    AttentionLayer,
    attention_options,
    build_attention,
    list_attentions,
    register_attention,
    registry,
)


def test_builtin_mechanisms_are_listed_with_options():
    listed = list_attentions()
    assert {"full", "linear", "local", "gated"} <= set(listed)
    assert listed["local"]["window"] == 256
    assert listed["linear"]["chunk"] == 64
    assert "rotary" in listed["full"]


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown attention 'nope'.*'full'"):
        build_attention("nope", dim=8, heads=2)


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['windw'\].*'window'"):
        build_attention("local", dim=8, heads=2, windw=3)


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("local", {"window": 0}, "window must be a positive integer"),
        ("linear", {"chunk": -1}, "chunk must be a positive integer"),
        ("linear", {"eps": 0.0}, "eps must be > 0"),
        ("full", {"head_dim": 0}, "head_dim must be a positive integer"),
        ("full", {"rotary": True, "head_dim": 3}, "even head_dim"),
    ],
)
def test_bad_option_values_raise(name, options, message):
    with pytest.raises(ValueError, match=message):
        build_attention(name, dim=8, heads=2, **options)


def test_dim_must_divide_by_heads():
    with pytest.raises(ValueError, match=r"dim \(10\) must be divisible by heads \(3\)"):
        build_attention("full", dim=10, heads=3)


def test_a_new_layer_registers_and_builds(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register_attention("zeros-for-test")
    class Zeros(AttentionLayer):
        def __init__(self, dim, heads, causal=True, *, scale: float = 0.0, **common):
            super().__init__(dim, heads, causal, **common)
            self.scale = scale

        def attend(self, q, k, v, mask):
            return v * self.scale, 0

    assert attention_options("zeros-for-test")["scale"] == 0.0
    layer = build_attention("zeros-for-test", dim=8, heads=2, scale=0.0)
    assert layer(torch.randn(1, 3, 8)).out.abs().max() == 0
