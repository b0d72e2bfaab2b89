"""The Triton log-sum-exp merge against `merge_partials`, values and gradients (lse included)."""

import pytest
import torch

from routeformer.ops.attention_lse import MASKED, attention_with_lse_reference, merge_partials
from routeformer.ops.triton.lse_merge import triton_merge_partials
from tests.ops.triton._checks import assert_same_gradients


def make_parts(device, dtype=torch.float32, count=3, shape=(2, 3, 11, 8), seed=0):
    generator = torch.Generator().manual_seed(seed)
    parts = []
    for _ in range(count):
        out = torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_()
        lse = (3 * torch.randn(*shape[:-1], generator=generator)).to(device).requires_grad_()
        parts.append((out, lse))
    return parts


def gradients(merge, parts, weight):
    for out, lse in parts:
        out.grad = lse.grad = None
    merged = merge(parts)
    (merged.float() * weight).sum().backward()
    return merged, [t.grad.clone() for pair in parts for t in pair]


def test_values_and_gradients_match_merge_partials(device):
    parts = make_parts(device)
    parts[1][1].data[0, 0, :4] = MASKED  # a part with no key on some rows: no weight
    weight = torch.randn(2, 3, 11, 8).to(device)
    got, got_grads = gradients(triton_merge_partials, parts, weight)
    want, want_grads = gradients(merge_partials, parts, weight)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_merging_split_keys_equals_attention_over_all_keys(device):
    """The point of the merge: attention over two disjoint key halves, merged, is attention over all
    keys (the spec is attention_with_lse_reference on the whole set), gradients included."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=generator).to(device).requires_grad_() for _ in range(3))
    halves = [attention_with_lse_reference(q, k[:, :, :4], v[:, :, :4]),
              attention_with_lse_reference(q, k[:, :, 4:], v[:, :, 4:])]
    merged = triton_merge_partials(halves)
    whole, _ = attention_with_lse_reference(q, k, v)
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-5)
    weight = torch.randn_like(whole)
    assert_same_gradients(merged, whole, weight, (q, k, v))


def test_bf16_parts_within_tolerance(device):
    parts = make_parts(device, dtype=torch.bfloat16, count=2)
    merged = triton_merge_partials(parts)
    want = merge_partials([(out.float(), lse) for out, lse in parts])
    assert merged.dtype == torch.bfloat16
    torch.testing.assert_close(merged.float(), want, atol=1e-2, rtol=1e-2)  # bf16 output rounding


def test_bad_arguments_raise_value_errors(device):
    parts = make_parts(device, count=2)
    with pytest.raises(ValueError, match="at least one"):
        triton_merge_partials([])
    with pytest.raises(ValueError, match=r"parts\[1\]"):
        triton_merge_partials([parts[0], (parts[1][0][..., :4], parts[1][1])])
