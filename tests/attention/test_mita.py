"""The `mita` layer: presets, changing the budget at inference, stats, errors."""

import pytest
import torch

from routeformer.attention import build_attention
from routeformer.ops.mita import mita_attention

DIM, HEADS = 16, 2


def make(**options):
    torch.manual_seed(0)
    return build_attention("mita", dim=DIM, heads=HEADS, causal=False, **options).eval()


def test_layer_output_is_the_op_on_its_projections():
    layer = make(landmarks=4, topk=3, route=2)
    x = torch.randn(2, 20, DIM)
    q, k, v = layer.project_qkv(x, torch.arange(20).expand(2, 20))
    heads = mita_attention(q, k, v, landmarks=4, topk=3, route=2).out
    expected = layer.out_proj(heads.transpose(1, 2).reshape(2, 20, DIM))
    torch.testing.assert_close(layer(x).out, expected)


@pytest.mark.parametrize(("preset", "topk", "shared"), [("mita", 5, True), ("agent", 0, True),
                                                       ("route_only", 5, False)])
def test_presets_set_topk_and_shared(preset, topk, shared):
    layer = make(landmarks=4, topk=5, preset=preset)
    assert (layer.topk, layer.shared) == (topk, shared)
    x = torch.randn(1, 16, DIM)
    q, k, v = layer.project_qkv(x, torch.arange(16)[None])
    expected = mita_attention(q, k, v, landmarks=4, topk=topk, shared=shared).out
    torch.testing.assert_close(layer(x).out, layer.out_proj(expected.transpose(1, 2).reshape(1, 16, DIM)))


def test_budget_changes_at_inference_without_new_parameters():
    layer = make(landmarks=4, topk=4)
    x = torch.randn(2, 32, DIM)
    before = [p.clone() for p in layer.parameters()]
    small = layer(x)
    layer.set_budget(landmarks=8, topk=16)
    large = layer(x)
    assert (layer.landmarks, layer.topk, layer.route) == (8, 16, 1)
    assert not torch.allclose(small.out, large.out)
    assert large.stats["flops"] > small.stats["flops"]
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters(), strict=True))
    with pytest.raises(ValueError, match="route must be a positive integer"):
        layer.set_budget(route=0)


def test_stats_report_savings_and_balance():
    layer = make(landmarks=4, topk=8)
    stats = layer(torch.randn(1, 256, DIM)).stats
    assert 0 < stats["flops_vs_full"] < 0.5
    assert 1.0 <= stats["expert_load_max"] <= 4.0


def test_vision_options_pool_a_grid_and_skip_the_cls_token():
    layer = make(landmarks=4, topk=4, grid=[4, 4], extra_tokens=1)
    assert layer.grid == (4, 4)
    x = torch.randn(1, 17, DIM)
    q, k, v = layer.project_qkv(x, torch.arange(17)[None])
    expected = mita_attention(q, k, v, landmarks=4, topk=4, grid=(4, 4), extra_tokens=1).out
    torch.testing.assert_close(layer(x).out, layer.out_proj(expected.transpose(1, 2).reshape(1, 17, DIM)))
    with pytest.raises(ValueError, match="grid .4, 4. holds 16 tokens"):
        layer(torch.randn(1, 18, DIM))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"preset": "moba"}, "preset must be one of"),
        ({"topk": 0, "shared": False}, "nothing to read"),
        ({"landmarks": 0}, "landmarks must be a positive integer"),
        ({"pack": 0}, "pack must be a positive integer"),
        ({"causal": True, "grid": (4, 4)}, "grid and extra_tokens are for non-causal"),
    ],
)
def test_bad_options_raise_value_errors(options, message):
    causal = options.pop("causal", False)
    with pytest.raises(ValueError, match=message):
        build_attention("mita", dim=DIM, heads=HEADS, causal=causal, **options)
