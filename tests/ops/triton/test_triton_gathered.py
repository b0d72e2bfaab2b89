"""The Triton gathered-attention kernel against its reference twins, values and gradients."""

import pytest
import torch

from routeformer.ops.topk import routed_attention_reference
from routeformer.ops.triton.gathered import triton_routed_attention


def random_routing(batch, heads, length, slots, *, causal, key_mask=None, seed=0, shared_heads=False):
    """Distinct eligible keys per query (random scores, top-`slots`), invalid where a row has fewer."""
    generator = torch.Generator().manual_seed(seed)
    routing_heads = 1 if shared_heads else heads
    scores = torch.rand(batch, routing_heads, length, length, generator=generator)
    if causal:
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    values, index = scores.topk(min(slots, length), dim=-1)
    valid = values > float("-inf")
    index = torch.where(valid, index, torch.zeros_like(index))
    return index.expand(batch, heads, -1, -1), valid.expand(batch, heads, -1, -1)


def gathered_reference(q, k, v, index, valid, scale=None):
    """Explicit gather + masked softmax (a repeated key counts twice) -> (out, lse)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    expand = lambda t: t[:, :, None].expand(-1, -1, index.shape[2], -1, -1)  # [B, H, T, S, .]
    slots = lambda t: expand(t).gather(3, index[..., None].expand(-1, -1, -1, -1, t.shape[-1]))
    logits = (q[:, :, :, None, :] * slots(k)).sum(-1) * scale
    logits = logits.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.exp(logits - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return (weights[..., None] * slots(v)).sum(-2), lse


def make_qkv(batch, heads, length, dim, value_dim, dtype=torch.float32, seed=1, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    make = lambda last: torch.randn(batch, heads, length, last, generator=generator).to(device, dtype)
    return [t.requires_grad_() for t in (make(dim), make(dim), make(value_dim))]


def grads_of(fn, tensors, weights):
    for t in tensors:
        t.grad = None
    out, lse = fn()
    finite_lse = torch.where(torch.isinf(lse), 0.0, lse).float()
    loss = (out.float() * weights[0]).sum() + (finite_lse * weights[1]).sum()
    loss.backward()
    return out, lse, [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("causal,padded,shared",
                         [(True, False, True), (False, True, False), (True, True, True)])
def test_values_and_gradients_match_the_reference_fp32(device, causal, padded, shared):
    batch, heads, length, dim, value_dim, slots = 2, 2, 21, 16, 8, 5
    key_mask = None
    if padded:
        key_mask = torch.ones(batch, length, dtype=torch.bool)
        key_mask[0, 15:] = False
        key_mask[1, :3] = False  # with causal, rows 0-2 of batch 1 have no key: zeros, lse -inf
    index, valid = random_routing(batch, heads, length, slots, causal=causal, key_mask=key_mask,
                                  shared_heads=shared)
    index, valid = index.to(device), valid.to(device)
    q, k, v = make_qkv(batch, heads, length, dim, value_dim, device=device)
    generator = torch.Generator().manual_seed(2)
    weights = (torch.randn(batch, heads, length, value_dim, generator=generator).to(device),
               torch.randn(batch, heads, length, generator=generator).to(device))
    out, lse, grads = grads_of(lambda: triton_routed_attention(q, k, v, index, valid), (q, k, v), weights)
    ref_out, ref_lse, ref_grads = grads_of(lambda: gathered_reference(q, k, v, index, valid), (q, k, v),
                                           weights)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)  # -inf where the row is empty
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The op's own specification (a dense mask of the routed keys) agrees too.
    torch.testing.assert_close(out, routed_attention_reference(q, k, v, index, valid), atol=1e-5, rtol=1e-5)
    if padded and causal:
        assert bool(torch.isinf(lse[1, :, :3]).all()) and bool((out[1, :, :3] == 0).all())


def test_repeated_keys_count_twice_and_a_custom_scale(device):
    """MiTA's overlapping experts: a key in two slots of one row is weighted twice."""
    batch, heads, length, dim, slots = 1, 2, 9, 8, 6
    generator = torch.Generator().manual_seed(3)
    index = torch.randint(0, 3, (batch, heads, length, slots), generator=generator).to(device)
    valid = (torch.rand(batch, heads, length, slots, generator=generator) > 0.2).to(device)
    q, k, v = make_qkv(batch, heads, length, dim, dim, seed=4, device=device)
    weights = (torch.randn(batch, heads, length, dim).to(device),
               torch.randn(batch, heads, length).to(device))
    got = grads_of(lambda: triton_routed_attention(q, k, v, index, valid, scale=0.3), (q, k, v), weights)
    want = grads_of(lambda: gathered_reference(q, k, v, index, valid, scale=0.3), (q, k, v), weights)
    for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_tolerance_of_fp32(device, dtype):
    """Inputs in bf16/fp16, accumulation in fp32: out within 2e-2 (bf16 has 8 bits of mantissa),
    gradients within 3e-2 relative to their largest entry, of the fp32 reference on the same values."""
    batch, heads, length, dim, slots = 1, 2, 19, 16, 4
    index, valid = random_routing(batch, heads, length, slots, causal=True)
    index, valid = index.to(device), valid.to(device)
    low = make_qkv(batch, heads, length, dim, dim, dtype=dtype, device=device)
    high = [t.detach().float().requires_grad_() for t in low]
    weights = (torch.randn(batch, heads, length, dim).to(device),
               torch.zeros(batch, heads, length).to(device))
    out, _, grads = grads_of(lambda: triton_routed_attention(*low, index, valid), low, weights)
    ref_out, _, ref_grads = grads_of(lambda: gathered_reference(*high, index, valid), high, weights)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    for got, want in zip(grads, ref_grads, strict=True):
        assert float((got.float() - want).abs().max()) <= 3e-2 * float(want.abs().max())


def test_bad_arguments_raise_value_errors(device):
    q, k, v = make_qkv(1, 1, 4, 8, 8, device=device)
    index = torch.zeros(1, 1, 4, 2, dtype=torch.long, device=device)
    valid = torch.ones(1, 1, 4, 2, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match="index"):
        triton_routed_attention(q, k, v, index.int(), valid)
    with pytest.raises(ValueError, match="valid"):
        triton_routed_attention(q, k, v, index, valid.float())
    with pytest.raises(ValueError, match="q, k, v"):
        triton_routed_attention(q, k[..., :4], v, index, valid)
    with pytest.raises(ValueError, match="float32"):
        triton_routed_attention(q.double(), k.double(), v.double(), index, valid)
