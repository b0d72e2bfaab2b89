import importlib

import pytest
import torch

from routeformer.ops import block_attention, block_attention_reference

# The package re-exports the function under the module's name, so fetch the module itself.
block_module = importlib.import_module("routeformer.ops.block_attention")


@pytest.mark.parametrize("attend", [block_attention, block_module.blockwise_sdpa])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 3e-5), (torch.float64, 1e-10)])
def test_block_attention_matches_reference_with_masks_and_empty_rows(attend, dtype, tol):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 5, 7, 8, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 3, 5, 11, 8, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 3, 5, 11, 6, generator=gen, dtype=dtype, requires_grad=True)
    allowed = torch.rand(2, 1, 5, 7, 11, generator=gen) > 0.5
    allowed[0, 0, 2, 3] = False  # one row with no allowed key
    out = attend(q, k, v, allowed)
    ref = block_attention_reference(q, k, v, allowed)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    assert out[0, :, 2, 3].abs().max() == 0
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=tol * 3, rtol=tol * 3)


def test_block_attention_gradcheck():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 3, 4, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    allowed = torch.rand(1, 1, 3, 4, 4, generator=gen) > 0.3
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: block_attention(a, b, c, allowed), inputs)


def test_grouping_does_not_change_the_result(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 4, 8, generator=gen, requires_grad=True) for _ in range(3))
    allowed = torch.ones(1, 1, 9, 4, 4, dtype=torch.bool).tril()
    whole = block_attention(q, k, v, allowed)
    grads = torch.autograd.grad(whole.square().sum(), (q, k, v))
    monkeypatch.setattr(block_module, "_GROUP_SCORE_ELEMENTS", 40)  # groups of a few blocks
    grouped = block_attention(q, k, v, allowed)
    grouped_grads = torch.autograd.grad(grouped.square().sum(), (q, k, v))
    torch.testing.assert_close(whole, grouped)
    for a, b in zip(grads, grouped_grads, strict=True):
        torch.testing.assert_close(a, b)
