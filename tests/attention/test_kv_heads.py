"""Grouped-query attention (`kv_heads` < heads) on every mechanism that takes it.

The reference of a layer with G key/value heads is the same mechanism with G = heads whose K/V
projection rows are the grouped layer's, repeated for each group's query heads (what grouped-query
attention computes): values, aux losses and gradients (w.r.t. the input and the shared weights)
must match in fp32. Cached decoding must equal the parallel pass, and the decode cache must hold
kv_heads / heads of the reference's K/V bytes.
"""

from __future__ import annotations

import re

import pytest
import torch

from routeformer.attention import attention_class, build_attention, list_attentions
from routeformer.attention.base import AttentionLayer
from routeformer.ops.decode import state_bytes
from tests.attention.test_invariants import DIM, HEADS, SMALL_OPTIONS
from tests.attention.test_invariants import _spread_meta_routing as spread_meta_routing

GROUPED = [name for name in list_attentions() if attention_class(name).reads_grouped_kv]
# Builds whose grouped code paths differ from the defaults': name -> (mechanism, options).
CASES = {name: (name, SMALL_OPTIONS.get(name, {})) for name in GROUPED}
CASES.update({
    "topk_group": ("topk", {**SMALL_OPTIONS["topk"], "route_per": "group"}),
    "topk_dense_path": ("topk", {"topk": 3, "block": 4}),
    "topk_shared_score_bias": ("topk", {**SMALL_OPTIONS["topk"], "shared_routing": True,
                                        "routing_learning": "score_bias"}),
    "topk_group_score_bias": ("topk", {**SMALL_OPTIONS["topk"], "route_per": "group",
                                       "routing_learning": "score_bias"}),
    "meta_shared_qkv": ("meta", {**SMALL_OPTIONS["meta"], "share_qkv": True}),
    "meta_hard": ("meta", {**SMALL_OPTIONS["meta"], "eval_eta": 0.0}),  # routing spread in build()
    "meta_tokens_parallel_gated": ("meta_tokens", {"meta_input": "parallel", "combine": "gated"}),
    "meta_tokens_parallel_shared": ("meta_tokens", {"meta_input": "parallel", "meta_projections": "shared"}),
})
KV_HEADS = [1, HEADS // 2]
# Cached entries that hold K/V (or a state built from them), per query-head count of the layer.
KEY_VALUE_ENTRIES = ("k_buffer", "v_buffer", "meta_k_buffer", "meta_v_buffer", "state", "normaliser")
# Mechanisms whose decode state holds more than K/V-derived tensors: multihop's hop outputs (per
# query head: each has its own attention matrix), meta_tokens' meta-token flags [B, L], mita's
# landmarks, experts and incomplete block's queries (per query head: pooled from its queries).
STATE_BEYOND_KEY_VALUES = {"multihop", "meta_tokens", "mita"}


def build(name: str, kv_heads: int, causal: bool = True, seed: int = 0):
    mechanism, options = CASES[name]
    torch.manual_seed(seed)
    layer = build_attention(mechanism, dim=DIM, heads=HEADS, causal=causal, kv_heads=kv_heads, **options)
    if name == "meta_hard":  # hard-routed tokens reach all three experts: their routed-rows paths run
        spread_meta_routing(layer)
    return layer


def repeat_rows(weight: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """qkv_proj rows [(H + 2G)·d, ...] of a grouped layer -> [3·H·d, ...]: K/V rows of each head
    repeated for its group's query heads."""
    q, k, v = weight.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    group = heads // kv_heads

    def repeat(rows):
        return rows.unflatten(0, (kv_heads, head_dim)).repeat_interleave(group, 0).flatten(0, 1)

    return torch.cat([q, repeat(k), repeat(v)])


def summed_rows(grad: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The gradient of the repeated rows, mapped back to the grouped rows (summed over a group)."""
    q, k, v = grad.split(heads * head_dim)
    group = heads // kv_heads

    def fold(rows):
        return rows.unflatten(0, (kv_heads, group, head_dim)).sum(1).flatten(0, 1)

    return torch.cat([q, fold(k), fold(v)])


def is_qkv(param_name: str) -> bool:
    """A Q/K/V projection (q's heads, then the K/V heads): qkv_proj, meta_qkv_proj, expert_qkv.N."""
    return param_name.endswith(("qkv_proj.weight", "qkv_proj.bias")) or bool(
        re.fullmatch(r"expert_qkv\.\d+\.(weight|bias)", param_name))


def routes_per_group(layer) -> bool:
    return getattr(layer, "route_per", "head") == "group" and not layer.shared_routing


def reference_of(layer, name: str, causal: bool):
    """The same mechanism with kv_heads = heads and the grouped layer's weights, K/V repeated.
    topk routed per group: the reference routes per query head with each group's routing weights
    repeated for its query heads (so they pick the group's keys)."""
    mechanism, options = CASES[name]
    if routes_per_group(layer):
        options = {**options, "route_per": "head"}
    torch.manual_seed(0)
    reference = build_attention(mechanism, dim=DIM, heads=HEADS, causal=causal, kv_heads=HEADS, **options)
    state = layer.state_dict()
    for key in [key for key in state if is_qkv(key)]:
        state[key] = repeat_rows(state[key], HEADS, layer.kv_heads, layer.head_dim)
    if routes_per_group(layer):
        group = HEADS // layer.kv_heads
        routing = state["router.net.weight"].unflatten(0, (2, layer.kv_heads, -1))
        state["router.net.weight"] = routing.repeat_interleave(group, 1).flatten(0, 2)
        state["router.recency_logit"] = state["router.recency_logit"].repeat_interleave(group)
    reference.load_state_dict(state)
    return reference


def grouped_gradient(param_name: str, grad: torch.Tensor, layer) -> torch.Tensor:
    """A reference parameter's gradient mapped onto the grouped layer's parameter."""
    if is_qkv(param_name):
        return summed_rows(grad, HEADS, layer.kv_heads, layer.head_dim)
    if routes_per_group(layer) and param_name == "router.net.weight":
        group = HEADS // layer.kv_heads
        return grad.unflatten(0, (2, layer.kv_heads, group, -1)).sum(2).flatten(0, 2)
    if routes_per_group(layer) and param_name == "router.recency_logit":
        return grad.unflatten(0, (layer.kv_heads, -1)).sum(1)
    return grad


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kv_heads", KV_HEADS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_grouped_layer_equals_repeated_key_value_heads(name, kv_heads, causal):
    layer = build(name, kv_heads, causal).train()
    reference = reference_of(layer, name, causal).train()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 19, DIM, generator=gen)
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[1, 13:] = False
    weight = torch.randn(2, 19, DIM, generator=gen)
    results, grads = [], []
    for module in (layer, reference):
        inputs = x.clone().requires_grad_()
        torch.manual_seed(5)  # the routing loss's sampled rows
        result = module(inputs, mask=mask, **meta_tokens_of(module, 19))
        ((result.out * weight).sum() + result.aux_loss).backward()
        results.append(result)
        grads.append(inputs.grad)
    torch.testing.assert_close(results[0].out, results[1].out, atol=1e-5, rtol=1e-5)
    if not routes_per_group(layer):
        # Routed per group, the distillation target is the group's mean attention: the KL differs
        # from the per-head KLs' mean by the targets' entropies (constants), not in its gradients.
        torch.testing.assert_close(results[0].aux_loss, results[1].aux_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-5)
    reference_params = dict(reference.named_parameters())
    for param_name, param in layer.named_parameters():
        expected = grouped_gradient(param_name, reference_params[param_name].grad, layer)
        assert param.grad is not None, param_name
        torch.testing.assert_close(param.grad, expected, atol=1e-5, rtol=1e-4, msg=param_name)
    # Evaluation takes other paths (meta's hard routing to routed rows, topk's diagnostics).
    layer.eval()
    reference.eval()
    with torch.no_grad():
        extra = meta_tokens_of(layer, 19)
        evaluated, expected = layer(x, mask=mask, **extra), reference(x, mask=mask, **extra)
    torch.testing.assert_close(evaluated.out, expected.out, atol=1e-5, rtol=1e-5)
    if not routes_per_group(layer):  # per group, the routing heads (head_overlap's pairs) differ
        for key, value in evaluated.stats.items():
            torch.testing.assert_close(value, expected.stats[key], atol=1e-6, rtol=1e-5, equal_nan=True,
                                       msg=key)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_grouped_layer_holds_fewer_key_value_parameters(name, kv_heads):
    layer = build(name, kv_heads)
    head_dim = layer.head_dim
    for param_name, param in layer.named_parameters():
        if is_qkv(param_name) and param_name.endswith("weight"):
            assert param.shape == ((HEADS + 2 * kv_heads) * head_dim, DIM), param_name
    reference = reference_of(layer, name, causal=True)
    saved = sum(p.numel() for p in reference.parameters()) - sum(p.numel() for p in layer.parameters())
    routing_saved = 0
    if routes_per_group(layer):  # one routing head per K/V group instead of one per query head
        routing_saved = (HEADS - kv_heads) * (2 * layer.routing_dim * DIM + 1)
    projections = sum(is_qkv(name) and name.endswith("weight") for name, _ in layer.named_parameters())
    assert saved == projections * 2 * (HEADS - kv_heads) * head_dim * DIM + routing_saved


def meta_tokens_of(layer, length: int) -> dict:
    """A meta-token mask for layers that read one (every third token), else nothing."""
    if not getattr(layer, "reads_meta_mask", False):
        return {}
    return {"meta_mask": torch.arange(length).expand(2, length) % 3 == 1}


def decode_all(layer, x: torch.Tensor, pieces: list[int]) -> tuple[torch.Tensor, dict]:
    cache, outputs, start = {}, [], 0
    meta = meta_tokens_of(layer, x.shape[1]).get("meta_mask")
    for size in pieces:
        positions = torch.arange(start, start + size).expand(x.shape[0], size)
        extra = {} if meta is None else {"meta_mask": meta[:, start:start + size]}
        outputs.append(layer.decode(x[:, start:start + size], positions=positions, cache=cache, **extra))
        start += size
    return torch.cat(outputs, dim=1), cache


def cached_cases() -> list[str]:
    return [name for name in CASES if build(name, 1).supports_cache]


@pytest.mark.parametrize("name", cached_cases())
@pytest.mark.parametrize("kv_heads", KV_HEADS)
@pytest.mark.filterwarnings("ignore:topk attention")  # a one-token prefill reads all its keys
def test_grouped_cached_decoding_equals_the_parallel_pass(name, kv_heads):
    layer = build(name, kv_heads).eval()
    x = torch.randn(2, 16, DIM, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        parallel = layer(x, **meta_tokens_of(layer, 16)).out
        for pieces in ([1] * 16, [7, 1, 3, 1, 4]):
            decoded, _ = decode_all(layer, x, pieces)
            torch.testing.assert_close(decoded, parallel, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", cached_cases())
@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_grouped_decode_cache_holds_kv_heads_of_the_bytes(name, kv_heads):
    layer = build(name, kv_heads).eval()
    reference = reference_of(layer, name, causal=True).eval()
    x = torch.randn(2, 16, DIM, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, cache = decode_all(layer, x, [7, 1, 1])
        _, reference_cache = decode_all(reference, x, [7, 1, 1])

    def key_value_bytes(state):  # meta: one nested state per expert
        return sum(key_value_bytes(value) if isinstance(value, dict)
                   else state_bytes(value) if key in KEY_VALUE_ENTRIES else 0 for key, value in state.items())

    assert key_value_bytes(reference_cache) > 0
    assert key_value_bytes(cache) * HEADS == key_value_bytes(reference_cache) * kv_heads
    if hasattr(layer, "router_heads") and not routes_per_group(layer):
        return  # routing keys per query head, or one set for all heads: not K/V (checked below)
    if CASES[name][0] in STATE_BEYOND_KEY_VALUES:
        return
    assert state_bytes(cache) * HEADS == state_bytes(reference_cache) * kv_heads


def test_topk_routing_keys_follow_route_per():
    grouped = build("topk_group", 1).eval()
    per_head = build("topk", 1).eval()
    x = torch.randn(1, 9, DIM, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        group_cache, head_cache = decode_all(grouped, x, [5, 1])[1], decode_all(per_head, x, [5, 1])[1]
    routing = {"routing_keys", "routing_tiles", "routing_keys_buffer"}

    def routing_bytes(state):
        return state_bytes({key: value for key, value in state.items() if key in routing})

    assert routing_bytes(head_cache) == HEADS * routing_bytes(group_cache) > 0


def test_topk_group_routing_picks_one_key_set_per_group():
    layer = build("topk_group", HEADS // 2).eval()
    assert layer.router_heads() == HEADS // 2
    layer_per_head = build("topk", HEADS // 2).eval()
    assert layer_per_head.router_heads() == HEADS


@pytest.mark.parametrize("name", GROUPED)
@pytest.mark.parametrize("kv_heads", [0, 3, -2, 2.0, True])
def test_bad_kv_heads_raise(name, kv_heads):
    with pytest.raises(ValueError, match="kv_heads"):
        build_attention(name, dim=DIM, heads=HEADS, kv_heads=kv_heads, **SMALL_OPTIONS.get(name, {}))


def test_every_registered_mechanism_takes_kv_heads():
    assert GROUPED == list(list_attentions())


def test_a_layer_without_a_grouped_form_refuses_kv_heads():
    class Ungrouped(AttentionLayer):  # reads_grouped_kv stays False
        pass

    refusal = r"Ungrouped has no grouped-query form: kv_heads must equal heads \(4\)"
    with pytest.raises(ValueError, match=refusal):
        Ungrouped(DIM, HEADS, kv_heads=2)
    assert Ungrouped(DIM, HEADS, kv_heads=HEADS).kv_heads == HEADS


def test_topk_options_that_need_grouped_routing_keys():
    with pytest.raises(ValueError, match="route_per must be one of"):
        build_attention("topk", dim=DIM, heads=HEADS, route_per="token")
    with pytest.raises(ValueError, match="score_bias.*route_per='group' or shared_routing=True"):
        build_attention("topk", dim=DIM, heads=HEADS, kv_heads=2, routing_learning="score_bias")
