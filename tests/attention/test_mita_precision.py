"""MiTA in bf16/fp16 routes in fp32: its landmark scores and routing logits are fp32
whatever the dtype, so a low-precision layer chooses what an fp32 computation on the same numbers
chooses, and its output stays within 5e-2 (relative norm) of fp32 — causal and bidirectional.

Three settings. Under torch.autocast (how `routeformer train --train.precision bf16` runs: fp32
weights), the op's matmuls used to run in bf16 again (bidirectional: 0.2-0.5 from fp32, NaN for
some inputs); now routing is the fp32 model's exactly. A model cast to bf16/fp16 routes exactly as
the fp32 layer holding the same (rounded) weights. Against the original fp32 weights the rounding
of the weights themselves (~2e-3 relative on the logits) can flip a near-tied choice; every choice
that differs is checked to be such a near tie."""

from __future__ import annotations

import pytest
import torch

import routeformer.attention.mita as mita_layer
from routeformer.attention import build_attention
from routeformer.ops.mita import mita_attention

DIM, HEADS, LENGTH = 32, 4, 72
OPTIONS = {"landmarks": 3, "topk": 4, "block": 8}  # T = 72: 9 causal blocks, 3 windows of 24
TOLERANCE = 5e-2
# A choice that flips between fp32 weights and their bf16 rounding must be this close to a tie:
# its fp32 margin (best minus runner-up logit) over the scale of the logits (|q|·|L|·scale).
NEAR_TIE = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm())


def make_layer(causal: bool, seed: int):
    torch.manual_seed(seed)
    return build_attention("mita", dim=DIM, heads=HEADS, causal=causal, **OPTIONS).eval()


def inputs(seed: int) -> torch.Tensor:
    return torch.randn(2, LENGTH, DIM, generator=torch.Generator().manual_seed(100 + seed))


class OpInputs:
    """Records the q, k the layer hands to the op (monkeypatched into attention/mita.py)."""

    def __init__(self, monkeypatch):
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

        def spy(q, k, v, **options):
            self.seen.append((q, k))
            return mita_attention(q, k, v, **options)

        monkeypatch.setattr(mita_layer, "mita_attention", spy)

    def last(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.seen[-1]


def decisions(q: torch.Tensor, k: torch.Tensor, causal: bool):
    """The layer's discrete choices from the q, k it fed the op, recomputed in float64 (no padding,
    T a multiple of the windows and blocks): per landmark its top-K keys (as sets) and the
    margin between its K-th and (K+1)-th score; per query its routed expert and the margin between
    its best and runner-up logit — each margin over |L|·|k| or |q|·|L| (times the scale)."""
    q, k = q.double(), k.double()
    batch, heads, length, dim = q.shape
    scale, landmarks, width, block = dim ** -0.5, OPTIONS["landmarks"], OPTIONS["topk"], OPTIONS["block"]
    if causal:
        experts = length // block - 1
        landmark = q.view(batch, heads, length // block, block, dim)[:, :, :experts].mean(3)
        limit = (torch.arange(experts) + 1) * block  # landmark j reads the keys of blocks <= j
        key_ok = torch.arange(length)[None, :] < limit[:, None]  # [E, N]
        query_block = torch.arange(length) // block
        expert_index = torch.arange(experts)
        may_use = (expert_index[None, :] < query_block[:, None]) & (
            expert_index[None, :] >= query_block[:, None] - landmarks)  # [N, E]
    else:
        experts = landmarks
        landmark = q.view(batch, heads, landmarks, length // landmarks, dim).mean(3)
        key_ok = torch.ones(experts, length, dtype=torch.bool)
        may_use = torch.ones(length, experts, dtype=torch.bool)
    scores = (landmark @ k.transpose(-1, -2) * scale).masked_fill(~key_ok, float("-inf"))
    ranked = scores.sort(dim=-1, descending=True)
    top_sets = ranked.indices[..., :width].sort(-1).values
    key_norm = k.norm(dim=-1).amax(-1, keepdim=True)[..., None]
    score_scale = landmark.norm(dim=-1, keepdim=True) * key_norm * scale
    key_margin = ((ranked.values[..., width - 1] - ranked.values[..., width]) / score_scale[..., 0])
    key_margin = torch.nan_to_num(key_margin, nan=float("inf"), posinf=float("inf"))  # fewer keys than K
    logits = (q @ landmark.transpose(-1, -2) * scale).masked_fill(~may_use, float("-inf"))
    best = logits.topk(2, dim=-1)
    routed = best.indices[..., 0]
    logit_scale = q.norm(dim=-1) * landmark.norm(dim=-1).amax(-1, keepdim=True) * scale
    route_margin = torch.nan_to_num((best.values[..., 0] - best.values[..., 1]) / logit_scale,
                                    nan=float("inf"), posinf=float("inf"))  # a single usable expert
    usable = may_use.any(-1)  # causal block 0 routes nowhere
    return top_sets, key_margin, routed[..., usable], route_margin[..., usable]


def assert_same_decisions(low, high, causal: bool) -> None:
    low_sets, _, low_routes, _ = decisions(*low, causal)
    high_sets, _, high_routes, _ = decisions(*high, causal)
    assert torch.equal(low_sets, high_sets) and torch.equal(low_routes, high_routes)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_the_op_under_autocast_is_the_fp32_op(causal):
    """Autocast must not reach the op's matmuls (landmark scores, routing logits, softmax)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, LENGTH, 8, generator=gen) for _ in range(3))
    options = {"landmarks": 3, "topk": 4, "causal": causal, **({"block": 8} if causal else {})}
    expected = mita_attention(q, k, v, **options).out
    with torch.autocast("cpu", dtype=torch.bfloat16):
        actual = mita_attention(q, k, v, **options).out
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("seed", range(3))
def test_under_autocast_routing_is_the_fp32_models(causal, seed, monkeypatch):
    layer = make_layer(causal, seed)
    x = inputs(seed)
    spy = OpInputs(monkeypatch)
    with torch.no_grad():
        expected = layer(x).out
        high = spy.last()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            actual = layer(x).out
        low = spy.last()
    assert actual.dtype == torch.bfloat16 and low[0].dtype == torch.float32
    assert torch.equal(low[0], high[0]) and torch.equal(low[1], high[1])  # routing inputs bit for bit
    assert_same_decisions(low, high, causal)
    error = relative_error(actual, expected)
    assert error < TOLERANCE, f"autocast bf16 {'causal' if causal else 'bidirectional'}: {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("seed", range(3))
def test_a_cast_layer_routes_as_fp32_on_its_own_weights(dtype, causal, seed, monkeypatch):
    """The bf16/fp16 layer against the fp32 layer holding the same (rounded) weights, on the same
    (rounded) input: the routing inputs are identical fp32 numbers, so every choice is the same,
    and the output differs by the low-precision value path and output projection only."""
    low_layer = make_layer(causal, seed).to(dtype)
    same_weights = make_layer(causal, seed)
    same_weights.load_state_dict({name: value.float() for name, value in low_layer.state_dict().items()})
    x = inputs(seed).to(dtype)
    spy = OpInputs(monkeypatch)
    with torch.no_grad():
        actual = low_layer(x).out
        low = spy.last()
        expected = same_weights(x.float()).out
        high = spy.last()
    assert actual.dtype == dtype and low[0].dtype == torch.float32
    assert torch.equal(low[0], high[0]) and torch.equal(low[1], high[1])
    assert_same_decisions(low, high, causal)
    error = relative_error(actual, expected)
    assert error < TOLERANCE, f"{dtype} {'causal' if causal else 'bidirectional'}: {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_against_the_unrounded_weights_only_near_ties_flip(dtype, causal, monkeypatch):
    """The cast layer against the fp32 layer with the original weights, over 6 seeds: a choice
    (an expert's top-K keys, a query's expert) may differ only where fp32's own margin is within
    NEAR_TIE of a tie — the weights' rounding moves logits by ~2e-3 (bf16) relative, which no
    fp32 routing can undo."""
    flips = 0
    for seed in range(6):
        spy = OpInputs(monkeypatch)
        with torch.no_grad():
            make_layer(causal, seed).to(dtype)(inputs(seed).to(dtype))
            low = spy.last()
            make_layer(causal, seed)(inputs(seed))
            high = spy.last()
        low_sets, _, low_routes, _ = decisions(*low, causal)
        high_sets, key_margin, high_routes, route_margin = decisions(*high, causal)
        key_flips = (low_sets != high_sets).any(-1)
        route_flips = low_routes != high_routes
        flips += int(key_flips.sum() + route_flips.sum())
        assert (key_margin[key_flips] < NEAR_TIE[dtype]).all(), key_margin[key_flips]
        assert (route_margin[route_flips] < NEAR_TIE[dtype]).all(), route_margin[route_flips]
    # most choices are far from ties: at most a few of the 6 x (2 x 4 x (E + T)) flip
    assert flips <= 20, flips
