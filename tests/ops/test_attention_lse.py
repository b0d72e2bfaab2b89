"""attention_with_lse (fused kernel + folded lse gradient) against its dense reference; the merge."""

import pytest
import torch

from routeformer.ops.attention_lse import (
    MASKED,
    attention_with_lse,
    attention_with_lse_reference,
    merge_partials,
)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_reference_in_output_lse_and_both_gradients(dtype, causal, with_bias):
    gen = torch.Generator().manual_seed(0)
    keys = 7 if causal else 9
    q = torch.randn(2, 3, 7, 8, generator=gen, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 3, keys, 8, generator=gen, dtype=dtype, requires_grad=True) for _ in range(2))
    bias = None
    if with_bias:
        allowed = torch.rand(2, 1, 7, keys, generator=gen) > 0.4
        allowed[..., 0] = True  # every row keeps a key (empty rows are checked below)
        bias = torch.where(allowed, 0.0, MASKED).to(dtype)
    fast = attention_with_lse(q, k, v, bias=bias, causal=causal)
    slow = attention_with_lse_reference(q, k, v, bias=bias, causal=causal)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, **tolerance)
    grad_out, grad_lse = torch.randn_like(slow[0]), torch.randn_like(slow[1])
    fast_grads = torch.autograd.grad((fast[0] * grad_out).sum() + (fast[1] * grad_lse).sum(), (q, k, v))
    slow_grads = torch.autograd.grad((slow[0] * grad_out).sum() + (slow[1] * grad_lse).sum(), (q, k, v))
    for a, b in zip(fast_grads, slow_grads, strict=True):
        torch.testing.assert_close(a, b, **tolerance)


def test_merging_two_halves_equals_attention_over_all_keys_with_gradients():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    k2, v2 = (torch.randn(1, 2, 6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
              for _ in range(2))
    merged = merge_partials([attention_with_lse(q, k, v), attention_with_lse(q, k2, v2)])
    whole, _ = attention_with_lse_reference(q, torch.cat([k, k2], 2), torch.cat([v, v2], 2))
    torch.testing.assert_close(merged, whole)
    weight = torch.randn_like(whole)
    for a, b in zip(torch.autograd.grad((merged * weight).sum(), (q, k, k2, v2)),
                    torch.autograd.grad((whole * weight).sum(), (q, k, k2, v2)), strict=True):
        torch.testing.assert_close(a, b)


def test_a_row_with_no_key_gets_no_weight_and_no_nan():
    q, k, v = (torch.randn(1, 1, 3, 4, requires_grad=True) for _ in range(3))
    bias = torch.zeros(1, 1, 3, 3)
    bias[0, 0, 1] = MASKED  # query 1 reads nothing in this part
    empty_part = attention_with_lse(q, k, v, bias=bias)
    other_part = attention_with_lse(q, k * 2, v * 2)
    merged = merge_partials([empty_part, other_part])
    torch.testing.assert_close(merged[0, 0, 1], other_part[0][0, 0, 1])
    merged.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match=r"q must have shape \[B, H, L, d\]"):
        attention_with_lse(torch.randn(3, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_runs_in_fp32_and_keeps_empty_rows_finite(dtype):
    """fp16 cannot hold MASKED (-1e30 rounds to -inf): the op computes in fp32, so a bias built in
    fp16 and a row with no allowed key still give finite outputs, lse and gradients, and the result
    is the fp32 op's on the same inputs up to rounding the output (relative error <= 1e-2 bf16,
    2e-3 fp16)."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    bias = torch.zeros(1, 1, 5, 5)
    bias[0, 0, 2] = MASKED  # query 2 reads nothing here
    bias[0, 0, 3, :2] = MASKED
    low = attention_with_lse(q, k, v, bias=bias.to(dtype))
    high = attention_with_lse(*(t.detach().float() for t in (q, k, v)), bias=bias)
    assert low[0].dtype == dtype and low[1].dtype == torch.float32
    tolerance = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert float((low[0].float() - high[0]).norm() / high[0].norm()) <= tolerance
    other = attention_with_lse(q, k * 2, v)
    merged = merge_partials([low, other])
    assert merged.dtype == dtype and torch.isfinite(merged).all()
    merged.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_blocked_pass_over_many_key_blocks_matches_the_fp64_reference(dtype, causal, monkeypatch):
    """Keys in blocks of 4 (so 23 keys take six blocks, the last one partial): output, lse and the
    gradients of q, k, v through both equal the float64 reference on the same values (float64:
    to rounding; bf16: computed in fp32, out rounded to bf16, gradients to bf16: 2e-2)."""
    from routeformer.ops import attention_lse

    monkeypatch.setattr(attention_lse, "DEFAULT_KEY_BLOCK", 4)
    gen = torch.Generator().manual_seed(3)
    keys = 23
    q = torch.randn(2, 3, 23 if causal else 11, 8, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 3, keys, 8, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    allowed = torch.rand(2, 1, q.shape[2], keys, generator=gen) > 0.3
    allowed[..., 0] = True
    bias = torch.where(allowed, 0.0, MASKED)
    out, lse = attention_with_lse(q, k, v, bias=bias, causal=causal)
    high = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = attention_with_lse_reference(*high, bias=bias.double(), causal=causal)
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out.double(), want_out, **tolerance)
    torch.testing.assert_close(lse.double(), want_lse, **({"atol": 1e-5, "rtol": 1e-5} if tolerance else {}))
    grad_out = torch.randn(want_out.shape, generator=gen, dtype=torch.float64)
    grad_lse = torch.randn(want_lse.shape, generator=gen, dtype=torch.float64)
    loss = (out * grad_out.to(dtype)).sum() + (lse * grad_lse.to(lse.dtype)).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    want = torch.autograd.grad((want_out * grad_out).sum() + (want_lse * grad_lse).sum(), high)
    for grad, expected in zip(grads, want, strict=True):
        assert grad.dtype == dtype
        torch.testing.assert_close(grad.double(), expected, **tolerance)


def test_the_blocked_pass_holds_one_key_block_of_scores_at_a_time(monkeypatch):
    """Memory O(Lq·block): every score tensor the pass builds has at most `block` key columns."""
    from routeformer.ops import attention_lse

    monkeypatch.setattr(attention_lse, "DEFAULT_KEY_BLOCK", 8)
    widths = []
    original = attention_lse._block_logits

    def recorded(*args):
        scores = original(*args)
        widths.append(scores.shape[-1])
        return scores

    monkeypatch.setattr(attention_lse, "_block_logits", recorded)
    q, k, v = (torch.randn(1, 2, 50, 4, requires_grad=True) for _ in range(3))
    out, lse = attention_with_lse(q, k, v, causal=True)
    (out.sum() + lse.sum()).backward()
    assert len(widths) == 2 * 7 and max(widths) == 8  # 50 keys: 7 blocks, forward and backward
