"""Layer outputs checked against explicit computations with the layer's own weights."""

import math

import pytest
import torch

from routeformer.attention import build_attention
from routeformer.ops import (
    full_attention_reference,
    linear_attention_reference,
    local_attention_reference,
)
from routeformer.ops.local import local_kernel_serves_cpu


def explicit_heads(layer, x):
    batch, length, _ = x.shape
    q, k, v = layer.qkv_proj(x).chunk(3, dim=-1)
    split = lambda t: t.view(batch, length, layer.heads, layer.head_dim).transpose(1, 2)  # noqa: E731
    return split(q), split(k), split(v)


def merge(heads_out):
    batch, heads, length, dim = heads_out.shape
    return heads_out.transpose(1, 2).reshape(batch, length, heads * dim)


@pytest.mark.parametrize("causal", [True, False])
def test_layers_equal_reference_ops_with_their_weights(causal):
    torch.manual_seed(0)
    x = torch.randn(2, 30, 16)
    cases = {
        "full": lambda q, k, v: full_attention_reference(q, k, v, causal=causal),
        "linear": lambda q, k, v: linear_attention_reference(q, k, v, causal=causal),
        "local": lambda q, k, v: local_attention_reference(q, k, v, window=4, causal=causal),
    }
    for name, reference in cases.items():
        options = {"window": 4} if name == "local" else {}
        layer = build_attention(name, dim=16, heads=2, causal=causal, **options)
        expected = layer.out_proj(merge(reference(*explicit_heads(layer, x))))
        torch.testing.assert_close(layer(x).out, expected, atol=1e-5, rtol=1e-5)


def test_gated_attention_multiplies_heads_by_the_sigmoid_gate():
    torch.manual_seed(0)
    x = torch.randn(2, 12, 16)
    layer = build_attention("gated", dim=16, heads=2)
    heads_out = full_attention_reference(*explicit_heads(layer, x), causal=True)
    expected = layer.out_proj(merge(heads_out) * torch.sigmoid(layer.gate_proj(x)))
    torch.testing.assert_close(layer(x).out, expected, atol=1e-5, rtol=1e-5)
    # A strongly negative gate bias closes the gate: the output goes to the projection's bias (0).
    with torch.no_grad():
        layer.gate_proj.bias.fill_(-60.0)
        layer.gate_proj.weight.zero_()
    assert layer(x).out.abs().max() < 1e-12


def test_rotary_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    layer = build_attention("full", dim=16, heads=2, rotary=True)
    x = torch.randn(1, 10, 16)
    positions = torch.arange(10)[None]
    shifted = layer(x, positions=positions + 1000).out
    torch.testing.assert_close(layer(x, positions=positions).out, shifted, atol=1e-4, rtol=1e-4)
    scrambled = layer(x, positions=positions * 3).out
    assert not torch.allclose(layer(x).out, scrambled, atol=1e-3)


def test_flops_stats_match_the_op_formulas():
    x = torch.randn(2, 100, 32)
    full = build_attention("full", dim=32, heads=4)
    assert full(x).stats["flops"].item() == 2 * 4 * 4 * (100 * 101 // 2) * 8
    padded = full(x, mask=torch.ones(2, 100, dtype=torch.bool).tril(50)[:2]).stats["flops"]
    # Under a padding mask the causal kernel runs on heads widened to 16 (ops/padded_keys.py).
    assert padded.item() == 2 * 4 * 4 * (100 * 101 // 2) * 16
    local = build_attention("local", dim=32, heads=4, window=16)
    if local_kernel_serves_cpu():
        # The C kernel (ops/native/local.py): 17 blocks of 6 queries, each scoring the keys its
        # bands cover: Σ rows x keys = 1930 query-key pairs.
        assert local(x).stats["flops"].item() == 2 * 4 * 4 * 1930 * 8
    else:  # the blockwise path: 7 blocks of 16 queries, each scoring its own and the previous block
        assert local(x).stats["flops"].item() == 2 * 4 * 4 * 7 * 16 * 32 * 8
    blockwise = build_attention("local", dim=32, heads=4, window=16, block=16)
    assert blockwise(x).stats["flops"].item() == 2 * 4 * 4 * 7 * 16 * 32 * 8
    linear = build_attention("linear", dim=32, heads=4, causal=False)
    assert linear(x).stats["flops"].item() == 2 * 4 * (2 * 2 * 8 * 100 * 8 + 2 * 100 * 8)
    assert math.isfinite(full(x).stats["flops"].item())
