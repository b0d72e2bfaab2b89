"""The Triton banded pass (expanding attention's final pass, meta's local rows) against a dense
reference: per-query horizon, distance decay, positions; values and gradients (log_decay too)."""

import pytest
import torch

from routeformer.ops.triton.band import triton_band_attention
from tests.ops.triton._checks import assert_same_gradients


def band_reference(q, k, v, log_decay, horizon, positions=None, scale=None):
    """Dense scores over every key, the band as a mask, the decay as a bias; empty rows give 0."""
    batch, heads, length, dim = k.shape
    scale = dim ** -0.5 if scale is None else scale
    queries = q.shape[1]
    if positions is None:
        positions = torch.arange(queries, device=q.device).expand(batch, queries)
    position = positions.repeat_interleave(heads, dim=0)  # [B·H, M]
    distance = position[:, :, None] - torch.arange(length, device=q.device)  # [B·H, M, T]
    allowed = (distance >= 0) & (distance < horizon[:, :, None])
    logits = q @ k.reshape(batch * heads, length, dim).transpose(1, 2) * scale
    logits = logits + distance.clamp_min(0) * log_decay[:, :, None]
    logits = logits.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return weights @ v.reshape(batch * heads, length, -1)


def make(device, dtype=torch.float32, positions=False, seed=0):
    batch, heads, length, dim = 2, 2, 37, 8
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_()
    queries = 11 if positions else length
    q = randn(batch * heads, queries, dim)
    k, v = randn(batch, heads, length, dim), randn(batch, heads, length, 6)
    log_decay = (-torch.rand(batch * heads, queries, generator=generator)).to(device).requires_grad_()
    where = None
    if positions:
        where = torch.sort(torch.randperm(length, generator=generator)[:queries]).values.expand(batch, -1)
        where = where.contiguous().to(device)
    horizon = torch.randint(0, 20, (batch * heads, queries), generator=generator).to(device)
    return q, k, v, log_decay, horizon, where


@pytest.mark.parametrize("positions", [False, True])
def test_values_and_gradients_match_the_dense_reference(device, positions):
    q, k, v, log_decay, horizon, where = make(device, positions=positions)
    horizon[0, :3] = 0  # empty rows: zeros
    got = triton_band_attention(q, k, v, log_decay, horizon, where)
    want = band_reference(q, k, v, log_decay, horizon, where)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert bool((got[0, :3] == 0).all())
    weight = torch.randn(want.shape).to(device)
    leaves = (q, k, v, log_decay)
    assert_same_gradients(got, want, weight, leaves)


def test_bf16_within_tolerance_of_fp32(device):
    q, k, v, log_decay, horizon, _ = make(device, dtype=torch.bfloat16, seed=1)
    got = triton_band_attention(q, k, v, log_decay, horizon)
    want = band_reference(q.float(), k.float(), v.float(), log_decay, horizon)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_bad_arguments_raise_value_errors(device):
    q, k, v, log_decay, horizon, _ = make(device)
    with pytest.raises(ValueError, match="horizon"):
        triton_band_attention(q, k, v, log_decay, horizon.int())
    with pytest.raises(ValueError, match="q, k, v"):
        triton_band_attention(q[..., :4], k, v, log_decay, horizon)
    with pytest.raises(ValueError, match="positions"):
        triton_band_attention(q, k, v, log_decay, horizon, torch.zeros(2, 3, dtype=torch.long))
