"""Grouped-query attention in the ops: k, v with G heads read by H = G·g query heads equal the same
op on k, v repeated per query head (`repeat_kv`, the reference), values and gradients."""

from __future__ import annotations

import pytest
import torch

from routeformer.ops.decode import cached_softmax_attention, linear_attention_step
from routeformer.ops.full import full_attention
from routeformer.ops.grouped_heads import (
    check_kv_heads,
    group_queries,
    repeat_kv,
    spread_heads,
    ungroup_queries,
)
from routeformer.ops.linear import feature_map
from routeformer.ops.topk import routed_attention

BATCH, HEADS, LENGTH, DIM = 2, 4, 21, 8


def tensors(kv_heads: int, seed: int = 0, value_dim: int = DIM):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, LENGTH, DIM, generator=gen, requires_grad=True)
    k = torch.randn(BATCH, kv_heads, LENGTH, DIM, generator=gen, requires_grad=True)
    v = torch.randn(BATCH, kv_heads, LENGTH, value_dim, generator=gen, requires_grad=True)
    return q, k, v


def assert_same_values_and_grads(grouped_fn, q, k, v, atol=1e-5):
    """grouped_fn(q, k, v) against grouped_fn(q, repeat_kv(k), repeat_kv(v))."""
    weight = torch.randn_like(grouped_fn(q, k, v).detach())
    outputs, grads = [], []
    for repeat in (False, True):
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        qi, ki, vi = inputs
        if repeat:
            ki, vi = repeat_kv(ki, HEADS), repeat_kv(vi, HEADS)
        out = grouped_fn(qi, ki, vi)
        (out * weight).sum().backward()
        outputs.append(out)
        grads.append([t.grad for t in inputs])
    torch.testing.assert_close(outputs[0], outputs[1], atol=atol, rtol=1e-5)
    for grouped, repeated in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(grouped, repeated, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "padded"])
def test_full_attention_reads_grouped_keys(kv_heads, causal, masked):
    mask = None
    if masked:
        mask = torch.ones(BATCH, LENGTH, dtype=torch.bool)
        mask[1, 15:] = False
        mask[0, :3] = False
    assert_same_values_and_grads(
        lambda q, k, v: full_attention(q, k, v, mask=mask, causal=causal), *tensors(kv_heads))


def routed_index(slots: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct causal key indices per (batch, head, query) row; some slots invalid."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(BATCH, HEADS, LENGTH, LENGTH, generator=gen)
    eligible = torch.arange(LENGTH)[None, :] <= torch.arange(LENGTH)[:, None]
    index = scores.masked_fill(~eligible, -1.0).topk(slots, dim=-1).indices
    valid = index <= torch.arange(LENGTH)[:, None]
    return index, valid


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_routed_attention_reads_grouped_keys(kv_heads):
    index, valid = routed_index(5)
    assert not bool(valid.all()) and bool(valid.any())
    assert_same_values_and_grads(
        lambda q, k, v: routed_attention(q, k, v, index, valid)[0], *tensors(kv_heads, value_dim=6))


def test_routed_attention_refuses_heads_that_do_not_divide():
    q, k, v = tensors(3)
    index, valid = routed_index(2)
    with pytest.raises(ValueError, match="must divide the query heads"):
        routed_attention(q, k, v, index, valid)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("query_start", [0, 14, 20])
@pytest.mark.parametrize("window", [None, 4])
def test_cached_softmax_attention_reads_grouped_keys(kv_heads, query_start, window):
    q, k, v = tensors(kv_heads)
    queries = LENGTH - query_start if query_start else LENGTH

    def attend(q, k, v):
        return cached_softmax_attention(q[:, :, :queries], k, v, query_start, 0, window=window)

    assert_same_values_and_grads(attend, q, k, v)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_linear_attention_step_shares_a_state_per_group(kv_heads):
    q, k, v = tensors(kv_heads)

    def steps(q, k, v):
        cache, outputs = {}, []
        for start, stop in ((0, 6), (6, 7), (7, LENGTH)):
            outputs.append(linear_attention_step(feature_map(q[:, :, start:stop]),
                                                 feature_map(k[:, :, start:stop]), v[:, :, start:stop],
                                                 cache, 1e-6))
        assert cache["state"].shape[1] == k.shape[1]
        return torch.cat(outputs, dim=2)

    assert_same_values_and_grads(steps, q, k, v)


def test_group_queries_round_trip_and_layout():
    q = torch.randn(BATCH, HEADS, LENGTH, DIM).transpose(1, 2).contiguous().transpose(1, 2)  # strided
    grouped = group_queries(q, 2)
    assert grouped.shape == (BATCH, 2, 2 * LENGTH, DIM)
    # row r of group j is query head j·g + r // T, token r % T
    torch.testing.assert_close(grouped[:, 1, LENGTH + 3], q[:, 3, 3])
    torch.testing.assert_close(ungroup_queries(grouped, HEADS), q)


def test_spread_heads_and_repeat_kv():
    t = torch.randn(BATCH, 2, LENGTH, DIM)
    spread = spread_heads(t, HEADS)
    torch.testing.assert_close(spread[:, 3], t[:, 1])
    torch.testing.assert_close(repeat_kv(t, HEADS), spread)
    assert spread_heads(t[:, :1], HEADS).stride(1) == 0  # one shared head: a broadcast view
    assert repeat_kv(t, 2) is t


@pytest.mark.parametrize("kv_heads", [0, 3, -1, 1.0, True])
def test_check_kv_heads_names_the_argument(kv_heads):
    with pytest.raises(ValueError, match="kv_heads"):
        check_kv_heads(HEADS, kv_heads)


def test_full_attention_refuses_heads_that_do_not_divide():
    q, k, v = tensors(3)
    with pytest.raises(ValueError, match="k, v may have G heads, G dividing q's"):
        full_attention(q, k, v)
