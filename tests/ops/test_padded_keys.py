"""Padding masks in O(T) memory (ops/padded_keys.py): same values as the dense reference, and SDPA
never receives a mask with a T×T extent."""

import pytest
import torch
import torch.nn.functional as F

from routeformer.ops.full import full_attention, full_attention_reference


def inputs(dtype=torch.float32, length=37, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(3, 2, length, 8, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    mask = torch.rand(3, length, generator=gen) > 0.3  # holes everywhere
    mask[1, :6] = False  # left padding: the first queries see no key under the causal rule
    mask[2] = False  # a sequence with no real token
    return q, k, v, mask


@pytest.mark.parametrize("causal", [True, False])
def test_matches_the_reference_with_gradients(causal):
    q, k, v, mask = inputs(torch.float64)
    out = full_attention(q, k, v, mask=mask, causal=causal)
    ref = full_attention_reference(q, k, v, mask=mask, causal=causal)
    torch.testing.assert_close(out, ref)
    assert out[2].abs().max() == 0, "a sequence with no real key returns zeros"
    weights = torch.randn_like(out)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    want = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_is_finite_and_close(causal, dtype):
    q, k, v, mask = inputs(dtype)
    out = full_attention(q, k, v, mask=mask, causal=causal)
    ref = full_attention_reference(*(t.double() for t in (q, k, v)), mask=mask, causal=causal)
    assert out.dtype == dtype and torch.isfinite(out).all()
    error = (out.double() - ref).norm() / ref.norm()
    assert error < (2e-2 if dtype == torch.bfloat16 else 3e-3)
    out.float().square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_never_gets_a_quadratic_mask(causal, monkeypatch):
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        seen.append(None if attn_mask is None else attn_mask.shape)
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k, v, mask = inputs()
    full_attention(q, k, v, mask=mask, causal=causal)
    assert seen, "the padded path runs through SDPA"
    for shape in seen:
        assert shape is None or shape[-2] == 1, f"a mask of shape {shape} holds T×T entries"
